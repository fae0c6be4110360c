-- Shared by miss.lua and replay.lua: the request every case sends, and the JSON summary line
-- that bench/load.sh collects. Every case (bare handler included) gets the same bytes: a
-- JSON body, a Content-Type, an Idempotency-Key and an x-bench-case header (which only the
-- raw-SQL anchor reads).
local common = {}

function common.setup_threads()
  local next_id = 0
  return function(thread)
    next_id = next_id + 1
    thread:set("tid", next_id)
  end
end

function common.init(case)
  wrk.method = "POST"
  wrk.path = "/payments"
  wrk.body = '{"amount":1000,"currency":"EUR","customer":"cus_42","description":"load bench"}'
  wrk.headers["Content-Type"] = "application/json"
  wrk.headers["x-bench-case"] = case
end

function common.done(summary, latency, requests)
  local secs = summary.duration / 1e6
  local e = summary.errors
  io.write(string.format(
    'JSON {"requests":%d,"duration_s":%.3f,"rps":%.1f,"p50_ms":%.3f,"p99_ms":%.3f,' ..
    '"p999_ms":%.3f,"p9999_ms":%.3f,"max_ms":%.3f,"errors":%d,"status_errors":%d}\n',
    summary.requests, secs, summary.requests / secs,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    latency:percentile(99.9) / 1000, latency:percentile(99.99) / 1000, latency.max / 1000,
    e.connect + e.read + e.write + e.timeout + e.status, e.status))
end

return common
