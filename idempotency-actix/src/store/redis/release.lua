-- Drop the reservation, fenced by the token (one EVALSHA, atomic).
-- KEYS[1] record key   ARGV[1] token
-- Returns 1 (released) or 0 (stale).
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if r[1] ~= 'f' or r[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
