-- Reserve-or-fetch, the slow path of RedisStore::reserve (one EVALSHA, atomic: Redis runs a
-- script alone). The store calls it when its native `SET ... NX GET` found a reservation:
-- only a script can take a reservation over, because only it can read the record, check the
-- lease on Redis's clock and write in one step. Mirrors idempotency_reserve
-- (migrations/*_reserve_function/up.sql): read first; write only for an absent key or an
-- ended reservation of the same fingerprint. Record bytes: record.rs (1-based here: state 1,
-- fingerprint 2..33, lease as reserved 86..101, grace or expiry 102..117).
--
-- KEYS[1] record key
-- ARGV[1] fingerprint (32 raw bytes)
-- ARGV[2] the new reservation (record.rs, in_flight)
-- ARGV[3] its key's life in milliseconds (lease + grace, rounded up)
--
-- Returns {'r'} (reserved: ARGV[2] is stored, now or by an earlier send of this same call),
--         {'f', fingerprint, lease_remaining_us} (in flight, not taken over), or
--         {'c', record, remaining_us} (a live completed record).
local v = redis.call('GET', KEYS[1])
if v then
  local st = string.sub(v, 1, 1)
  if st == 'C' then
    local t = redis.call('TIME')
    local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    return {'c', v, math.max(tonumber(string.sub(v, 102, 117)) - now, 0)}
  end
  if st ~= 'F' then
    return redis.error_reply('ERR not an idempotency record')
  end
  -- Our own reservation (this call's token): the cluster client sent the script again after
  -- an I/O error that came after Redis had run it.
  if string.sub(v, 34, 69) == string.sub(ARGV[2], 34, 69) then
    return {'r'}
  end
  -- The lease ends where the key's life less the grace does: Redis's clock, to the ms. A key
  -- with no expiry (PTTL -1: a PERSIST, a RESTORE with TTL 0) says nothing about the lease: it
  -- is read as not ended (its lease as reserved left), so nothing takes over a handler that may
  -- still run; the holder's next renewal puts an expiry back.
  local fp = string.sub(v, 2, 33)
  local pttl = redis.call('PTTL', KEYS[1])
  local remaining
  if pttl < 0 then
    remaining = tonumber(string.sub(v, 86, 101))
  else
    remaining = pttl * 1000 - tonumber(string.sub(v, 102, 117))
  end
  if remaining > 0 or fp ~= ARGV[1] then
    return {'f', fp, math.max(remaining, 0)}
  end
end
-- Absent (expired since the caller looked), or an ended reservation of this same request (its
-- holder crashed or hung): a fresh reservation.
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return {'r'}
