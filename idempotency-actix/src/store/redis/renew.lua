-- Renew a reservation's lease, fenced by the token (one EVALSHA, atomic). Only the key's expiry
-- moves: a reservation's lease ends where its key's remaining life falls to its grace, so a
-- life of lease + grace from now, by Redis's clock, is a lease that ends `lease` from now. As
-- for a late `complete`, an ended lease is renewed until a takeover or until Redis dropped
-- the reservation (lease + grace). No write that may grow memory (PEXPIRE is not `denyoom`),
-- so a full Redis (`OOM`) still renews.
-- Record bytes: record.rs (1-based here: state 1, token 34..69); the value is left as it is.
--
-- KEYS[1] record key
-- ARGV[1] token   ARGV[2] the key's new life in milliseconds (lease + grace, rounded up)
-- Returns 1 (renewed) or 0 (stale: no reservation held by this token; nothing changed).
local v = redis.call('GET', KEYS[1])
if not v or string.sub(v, 1, 1) ~= 'F' or string.sub(v, 34, 69) ~= ARGV[1] then
  return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
