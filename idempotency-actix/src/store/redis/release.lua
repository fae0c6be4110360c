-- Drop the reservation, fenced by the token (one EVALSHA, atomic).
-- Record bytes: record.rs (1-based here: state 1, token 34..69).
-- KEYS[1] record key   ARGV[1] token
-- Returns 1 (released) or 0 (stale).
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 1) ~= 'F' or string.sub(v, 34, 69) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
