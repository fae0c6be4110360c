#!lua flags=allow-oom
-- Store the response, fenced by the reservation token (one EVALSHA, atomic). `allow-oom` (the
-- first line; Redis 7.0+): the request was admitted, its handler ran, so its response is stored
-- even if Redis filled up meanwhile; refused, the reservation would end and the client's retry
-- run the handler again (redis.rs, "Faults"). As in
-- PostgreSQL, the holder's late `complete` (after its lease) still applies until a takeover
-- or until Redis dropped the reservation (lease + grace). Idempotent for its token: a record
-- this token already completed answers 1 again and is left as it is, so a retry after an
-- applied call whose reply was lost, or whose `WAIT` was not acknowledged, is not `Stale`.
-- The token stays in the completed record for that (PostgreSQL keeps it too).
-- Record bytes: record.rs (1-based here: state 1, token 34..69, and 2..85 are kept).
--
-- KEYS[1] record key
-- ARGV[1] token   ARGV[2] TTL, microseconds   ARGV[3] status, headers and body (response_tail)
-- Returns 1 (applied, now or before) or 0 (stale: no reservation held by this token).
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 34, 69) ~= ARGV[1] then
  return 0
end
local st = string.sub(v, 1, 1)
if st == 'C' then
  return 1
end
if st ~= 'F' then
  return 0
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[2])
redis.call('SET', KEYS[1],
  'C' .. string.sub(v, 2, 85) .. string.format('%016.0f%016.0f', now, now + ttl) .. ARGV[3],
  'PX', string.format('%.0f', math.max(math.floor(ttl / 1000), 1)))
return 1
