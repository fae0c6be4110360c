-- Replay path: round-robin over a fixed set of keys ("r-1" .. "r-N", N = 1000, or args[1] when
-- it is a number).
-- The first pass (the warm-up) stores them; every later request is a replay.
package.path = package.path .. ";bench/?.lua"
local common = require("common")

setup = common.setup_threads()
local keys = 1000
local counter = 0

function init(args)
  common.init("replay")
  keys = tonumber(args[1] or "") or 1000
  counter = (tid or 1) * 7919 -- threads start at different keys
end

function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = "r-" .. (counter % keys + 1)
  return wrk.format()
end

done = common.done
