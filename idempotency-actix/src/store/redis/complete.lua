-- Store the response, fenced by the reservation token (one EVALSHA, atomic). As in
-- PostgreSQL, the holder's late `complete` (after its lease) still applies until a takeover
-- or until Redis dropped the reservation (lease + grace). Idempotent for its token: a record
-- this token already completed answers 1 again and is left as it is, so a retry after an
-- applied call whose reply was lost, or whose `WAIT` was not acknowledged, is not `Stale`.
-- The token stays in the completed record for that (PostgreSQL keeps it too).
--
-- KEYS[1] record key
-- ARGV[1] token   ARGV[2] status   ARGV[3] encoded headers   ARGV[4] body
-- ARGV[5] TTL, microseconds
-- Returns 1 (applied, now or before) or 0 (stale: no reservation held by this token).
local r = redis.call('HMGET', KEYS[1], 'st', 'tok')
if r[2] ~= ARGV[1] then
  return 0
end
if r[1] == 'c' then
  return 1
end
if r[1] ~= 'f' then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], 'st', 'c', 's', ARGV[2], 'h', ARGV[3], 'b', ARGV[4],
  'co', string.format('%.0f', now), 'ex', string.format('%.0f', now + ttl))
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.max(math.ceil(ttl / 1000), 1)))
return 1
