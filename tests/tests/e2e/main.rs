//! The end-to-end tests that share a process: real PostgreSQL, real Redis, real HTTP.
//!
//! One test binary instead of one per file: each binary compiled and linked its own copy of
//! actix-web, diesel, the redis client and the store code (rebuilding these tests took 4m35s
//! of CPU as 13 binaries, 37 s as one; 180 MB of disk each). Cargo runs the tests of one binary on as many threads as there are cores, as it did
//! within each file before. The process-fault tests stay binaries of their own
//! (`fault_processes.rs`, `redis_faults.rs`, `transactional_faults.rs`, `redis_cluster.rs`):
//! they kill and restart servers and are CPU-hungry, so they run with nothing else beside them.
//!
//! Run one file's tests by its module name: `cargo test -p idempotency-e2e --test e2e postgres_store::`.

mod claims_audit;
mod config_extremes;
mod connection_cuts;
mod exhaustion;
mod fix_review;
mod fleet_cache;
mod half_schema;
mod hostile_input;
mod http2;
mod http_streaming;
mod metrics_scrape;
mod postgres_builder;
mod postgres_harness;
mod postgres_middleware;
mod postgres_round_trips;
mod postgres_store;
mod postgres_tls;
mod redis_degraded;
mod redis_hostile_state;
mod redis_options;
mod redis_script_cache;
mod redis_store;
mod redis_tls;
mod release_faults;
mod renewal_faults;
mod rotated_layout;
mod small_table_statistics;
mod tls_certs;
mod transactional_bodies;
mod transactional_middleware;
mod transactional_misuse;
mod transactional_scale;
mod wait_mode_clients;
mod wire_clients;
mod wire_framing;
