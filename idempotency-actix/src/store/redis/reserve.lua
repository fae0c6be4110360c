-- Reserve-or-fetch for RedisStore (one EVALSHA, atomic: Redis runs a script alone).
-- Mirrors idempotency_reserve (migrations/*_reserve_function/up.sql): read first, write only
-- for an absent key, an expired completed record, or an ended reservation of the same
-- fingerprint. Times are the server's (TIME), in microseconds.
--
-- KEYS[1] record key
-- ARGV[1] fingerprint (32 raw bytes)
-- ARGV[2] new reservation token (text)
-- ARGV[3] lease, microseconds (>= 1)
-- ARGV[4] grace after the lease before Redis drops an ended reservation, microseconds
--
-- Returns {'r'} (reserved with ARGV[2]),
--         {'f', fingerprint, lease_remaining_us} (in flight, not taken over), or
--         {'c', fingerprint, remaining_us, status, headers, body} (live completed record).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local r = redis.call('HMGET', KEYS[1], 'st', 'fp', 'ex', 's', 'h', 'b')
local st, fp, ex = r[1], r[2], tonumber(r[3])
if st == 'c' and ex and ex > now then
  return {'c', fp, ex - now, r[4], r[5], r[6]}
end
if st == 'f' and ex and (ex > now or fp ~= ARGV[1]) then
  return {'f', fp, math.max(ex - now, 0)}
end
-- Absent, an expired completed record, or an ended reservation of this same request (its
-- holder crashed or hung): a fresh reservation. DEL drops the old record's fields.
if st then
  redis.call('DEL', KEYS[1])
end
local lease = tonumber(ARGV[3])
local until_us = string.format('%.0f', now + lease)
redis.call('HSET', KEYS[1], 'st', 'f', 'fp', ARGV[1], 'tok', ARGV[2],
  'ca', string.format('%.0f', now), 'ex', until_us)
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.ceil((lease + tonumber(ARGV[4])) / 1000)))
return {'r'}
