-- Delete one reservation whose lease ended more than ARGV[1] microseconds ago (used by
-- `purge_expired` with a grace shorter than the store's own; Redis expires everything else).
-- KEYS[1] record key. Returns 1 (deleted) or 0.
local r = redis.call('HMGET', KEYS[1], 'st', 'ex')
if r[1] ~= 'f' or not tonumber(r[2]) then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
if tonumber(r[2]) + tonumber(ARGV[1]) > now then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
