-- Miss path: a new Idempotency-Key on every request. Args: <run id> (makes keys unique across
-- runs against the same server and database).
package.path = package.path .. ";bench/?.lua"
local common = require("common")

setup = common.setup_threads()
local prefix
local counter = 0

function init(args)
  common.init("miss")
  prefix = "m-" .. (args[1] or tostring(os.time())) .. "-" .. tostring(tid) .. "-"
end

function request()
  counter = counter + 1
  wrk.headers["Idempotency-Key"] = prefix .. counter
  return wrk.format()
end

done = common.done
