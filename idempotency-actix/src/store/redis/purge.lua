-- Delete one reservation whose lease ended more than ARGV[1] microseconds ago (used by
-- `purge_expired` with a grace shorter than the store's own; Redis expires everything else).
-- Record bytes: record.rs (1-based here: state 1, grace 102..117). The lease ended when the
-- key's remaining life fell to its grace, so it ended (grace - PTTL) ago.
-- KEYS[1] one of the store's record keys (parsed under its prefix). Returns 1 (deleted) or 0.
if redis.call('TYPE', KEYS[1])['ok'] ~= 'string' then
  return 0
end
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 1) ~= 'F' or string.len(v) ~= 117 then
  return 0
end
local pttl = redis.call('PTTL', KEYS[1])
-- No expiry (PTTL -1: a PERSIST, a RESTORE with TTL 0): no known lease end, never purged here.
if pttl < 0 or tonumber(string.sub(v, 102, 117)) - pttl * 1000 < tonumber(ARGV[1]) then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
