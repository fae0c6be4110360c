-- idem-cli release: delete the record only if it is still what was inspected (state and
-- token) and, without force, still a reservation whose lease ended by Redis's clock.
-- Record bytes: record.rs (1-based here: state 1, token 34..69, grace 102..117).
-- KEYS[1] record key   ARGV[1] state byte (F or C)   ARGV[2] token   ARGV[3] '1' to force
-- Returns 1 (deleted) or 0.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
  return 0
end
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 1) ~= ARGV[1] or string.sub(v, 34, 69) ~= ARGV[2] then
  return 0
end
if ARGV[3] ~= '1' then
  if ARGV[1] ~= 'F' then
    return 0
  end
  -- A key with no expiry (PTTL -1) has no known lease end: not ended.
  local pttl = redis.call('PTTL', KEYS[1])
  if pttl < 0 or pttl * 1000 > tonumber(string.sub(v, 102, 117)) then
    return 0
  end
end
redis.call('DEL', KEYS[1])
return 1
