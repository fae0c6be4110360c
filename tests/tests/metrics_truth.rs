//! Are the metrics and the outcome hook truthful? Each scenario counts what really happened
//! from outside (statuses seen by real HTTP clients over loopback, handler executions counted
//! by the handler) and compares it with the deltas of an in-process global recorder (one that
//! never resets what it holds) and with the events the `on_outcome` hook received.
//!
//! The recorder is global (actix workers run on their own threads), so this is a test binary
//! of its own (no other test's requests reach the recorder) and its tests run one at a time
//! (a mutex). From a review of the metrics (2026-12-05), which found the Redis store labelled
//! `store="custom"` (`redis_down_is_counted_as_store_unavailable`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use actix_web::{web, App, HttpRequest, HttpResponse, HttpServer};
use bytes::Bytes;
use idempotency_actix::store::{CachedStore, MemoryStore, PostgresStore, RedisStore};
use idempotency_actix::{Idempotency, IdempotencyBuilder, Outcome, OutcomeEvent};
use idempotency_e2e::proxy::PgProxy;
use idempotency_e2e::raw_http::{send_once, Conn, Request, Response};
use idempotency_e2e::redis_server::RedisServer;
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::TestDb;
use metrics::{
    Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder,
    SharedString, Unit,
};

const TIMEOUT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------------
// The recorder.

#[derive(Default)]
struct Cell {
    counter: AtomicU64,
    /// Gauge value (f64 bits under a mutex), histogram observation count and values.
    gauge: Mutex<f64>,
    observations: Mutex<Vec<f64>>,
}

impl CounterFn for Cell {
    fn increment(&self, value: u64) {
        self.counter.fetch_add(value, Ordering::SeqCst);
    }
    fn absolute(&self, value: u64) {
        self.counter.fetch_max(value, Ordering::SeqCst);
    }
}

impl GaugeFn for Cell {
    fn increment(&self, value: f64) {
        *self.gauge.lock().unwrap() += value;
    }
    fn decrement(&self, value: f64) {
        *self.gauge.lock().unwrap() -= value;
    }
    fn set(&self, value: f64) {
        *self.gauge.lock().unwrap() = value;
    }
}

impl HistogramFn for Cell {
    fn record(&self, value: f64) {
        self.observations.lock().unwrap().push(value);
    }
}

/// A series: its name, its labels (sorted), and its kind (`c`ounter, `g`auge, `h`istogram).
type Series = (String, Vec<(String, String)>, char);

#[derive(Default)]
struct Rec {
    cells: Mutex<BTreeMap<Series, Arc<Cell>>>,
}

impl Rec {
    fn cell(&self, key: &Key, kind: char) -> Arc<Cell> {
        let mut labels: Vec<(String, String)> = key
            .labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect();
        labels.sort();
        let id = (key.name().to_owned(), labels, kind);
        Arc::clone(self.cells.lock().unwrap().entry(id).or_default())
    }
}

impl Recorder for &'static Rec {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key, 'c'))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key, 'g'))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(self.cell(key, 'h'))
    }
}

fn recorder() -> &'static Rec {
    static REC: OnceLock<&'static Rec> = OnceLock::new();
    REC.get_or_init(|| {
        let rec: &'static Rec = Box::leak(Box::default());
        metrics::set_global_recorder(rec).expect("no other global recorder in this binary");
        rec
    })
}

/// Everything recorded so far: `name{k=v,...}` (sorted labels) -> counter value, gauge value,
/// or histogram observation count.
#[derive(Clone, Debug, Default)]
struct Snap(BTreeMap<String, f64>);

fn snap() -> Snap {
    let rec = recorder();
    let cells = rec.cells.lock().unwrap();
    let mut out = BTreeMap::new();
    for ((name, labels, kind), cell) in cells.iter() {
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let id = format!("{name}{{{}}}", labels.join(","));
        let value = match kind {
            'c' => cell.counter.load(Ordering::SeqCst) as f64,
            'g' => *cell.gauge.lock().unwrap(),
            _ => cell.observations.lock().unwrap().len() as f64,
        };
        out.insert(id, value);
    }
    Snap(out)
}

impl Snap {
    /// Sum of the metrics named `name` whose labels include every one of `labels`.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(id, _)| id.starts_with(&format!("{name}{{")))
            .filter(|(id, _)| {
                let inner = &id[name.len() + 1..id.len() - 1];
                let have: Vec<&str> = inner.split(',').collect();
                labels
                    .iter()
                    .all(|(k, v)| have.contains(&format!("{k}={v}").as_str()))
            })
            .map(|(_, v)| *v)
            .sum()
    }

    /// The change of every metric since `before` (only the ones that changed).
    fn since(&self, before: &Snap) -> BTreeMap<String, f64> {
        self.0
            .iter()
            .filter_map(|(id, v)| {
                let d = v - before.0.get(id).copied().unwrap_or(0.0);
                (d != 0.0).then(|| (id.clone(), d))
            })
            .collect()
    }
}

fn delta(before: &Snap, after: &Snap, name: &str, labels: &[(&str, &str)]) -> f64 {
    after.sum(name, labels) - before.sum(name, labels)
}

const REQ: &str = "idempotency_requests_total";
const CALLS: &str = "idempotency_store_call_seconds";
const HELD: &str = "idempotency_reservations_held";
const RETRIES: &str = "idempotency_complete_retries_total";
const RELEASE_RETRIES: &str = "idempotency_release_retries_total";
const RENEW: &str = "idempotency_lease_renewals_total";

/// One test at a time: the recorder is global.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    recorder();
    guard
}

// ---------------------------------------------------------------------------------------------
// The app: a handler that counts its runs, and a hook that keeps every event.

#[derive(Clone, Debug)]
struct Seen {
    outcome: Outcome,
    status: u16,
    key: Option<String>,
    elapsed: Duration,
}

#[derive(Clone, Default)]
struct Probe {
    runs: Arc<AtomicU64>,
    runs_by_key: Arc<Mutex<HashMap<String, u64>>>,
    finished: Arc<AtomicU64>,
    events: Arc<Mutex<Vec<Seen>>>,
}

impl Probe {
    fn runs(&self) -> u64 {
        self.runs.load(Ordering::SeqCst)
    }
    fn events(&self) -> Vec<Seen> {
        self.events.lock().unwrap().clone()
    }
    fn hook(&self) -> impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static {
        let events = Arc::clone(&self.events);
        move |event: &OutcomeEvent<'_>| {
            events.lock().unwrap().push(Seen {
                outcome: event.outcome,
                status: event.status.as_u16(),
                key: event.scope.map(|s| s.key.clone()),
                elapsed: event.elapsed,
            });
        }
    }
    /// The statuses the hook saw, in the order it saw them.
    fn statuses(&self) -> Vec<u16> {
        self.events().iter().map(|e| e.status).collect()
    }
    fn count_events(&self, outcome: Outcome) -> usize {
        self.events()
            .iter()
            .filter(|e| e.outcome == outcome)
            .count()
    }
}

fn query(req: &HttpRequest, name: &str) -> Option<String> {
    req.query_string().split('&').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k == name).then(|| v.to_owned())
    })
}

/// `/{prefix}/pay/{id}`: counts its run; `delay_ms`, `status`, `size` (body bytes), `stream=1`
/// (a streamed body in 3 chunks), `stream=fail` (a stream failing after its first chunk).
async fn handler(req: HttpRequest, probe: web::Data<Probe>) -> HttpResponse {
    probe.runs.fetch_add(1, Ordering::SeqCst);
    let mut nth = 0;
    if let Some(key) = req.headers().get("idempotency-key") {
        let key = String::from_utf8_lossy(key.as_bytes()).into_owned();
        let mut runs = probe.runs_by_key.lock().unwrap();
        let n = runs.entry(key).or_default();
        *n += 1;
        nth = *n;
    }
    if let Some(ms) = query(&req, "delay_ms").and_then(|v| v.parse().ok()) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    probe.finished.fetch_add(1, Ordering::SeqCst);
    if query(&req, "panic").is_some() {
        panic!("the handler panics (metrics_truth)");
    }
    let mut status = query(&req, "status")
        .and_then(|v| v.parse().ok())
        .unwrap_or(201u16);
    if nth == 1 && query(&req, "fail_first").is_some() {
        status = 502;
    }
    let mut builder = HttpResponse::build(actix_web::http::StatusCode::from_u16(status).unwrap());
    match query(&req, "stream").as_deref() {
        Some("1") => {
            let chunks =
                (0..3).map(|i| Ok::<_, actix_web::Error>(Bytes::from(format!("chunk{i};"))));
            return builder.streaming(futures_util::stream::iter(chunks));
        }
        Some("slow") => {
            let chunks = futures_util::stream::unfold(0u32, |i| async move {
                if i == 8 {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(150)).await;
                Some((
                    Ok::<_, actix_web::Error>(Bytes::from(format!("slow{i};"))),
                    i + 1,
                ))
            });
            return builder.streaming(chunks);
        }
        Some("fail") => {
            let chunks: Vec<Result<Bytes, actix_web::Error>> = vec![
                Ok(Bytes::from_static(b"first;")),
                Err(actix_web::error::ErrorInternalServerError("stream broke")),
            ];
            return builder.streaming(futures_util::stream::iter(chunks));
        }
        _ => {}
    }
    let size: usize = query(&req, "size")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if size > 0 {
        return builder.body(vec![b'x'; size]);
    }
    builder.body(format!("paid {}", probe.runs()))
}

/// A server with `store`, the middleware configured by `tweak` (the hook is added here), the
/// route `/{prefix}/pay/{id}` for POST, PATCH and GET.
fn serve<S, F>(store: S, prefix: &'static str, probe: &Probe, tweak: F) -> ThreadServer
where
    S: idempotency_actix::store::IdempotencyStore + Clone + Send + 'static,
    F: Fn(IdempotencyBuilder<S>) -> IdempotencyBuilder<S> + Clone + Send + 'static,
{
    serve_with(store, prefix, probe, tweak, false)
}

/// [`serve`], HTTP/1.1 and (with `h2c`) HTTP/2 prior knowledge on the same port.
fn serve_with<S, F>(
    store: S,
    prefix: &'static str,
    probe: &Probe,
    tweak: F,
    h2c: bool,
) -> ThreadServer
where
    S: idempotency_actix::store::IdempotencyStore + Clone + Send + 'static,
    F: Fn(IdempotencyBuilder<S>) -> IdempotencyBuilder<S> + Clone + Send + 'static,
{
    let probe = probe.clone();
    ThreadServer::start(move || async move {
        let server = HttpServer::new(move || {
            let mw = tweak(Idempotency::builder(store.clone()).on_outcome(probe.hook())).build();
            App::new()
                .app_data(web::Data::new(probe.clone()))
                .wrap(mw)
                .route(&format!("/{prefix}/pay/{{id}}"), web::post().to(handler))
                .route(&format!("/{prefix}/pay/{{id}}"), web::patch().to(handler))
                .route(&format!("/{prefix}/pay/{{id}}"), web::get().to(handler))
                .route(&format!("/{prefix}/pay/{{id}}"), web::head().to(handler))
        })
        .workers(2)
        .disable_signals();
        let server = if h2c {
            server.bind_auto_h2c(("127.0.0.1", 0))
        } else {
            server.bind(("127.0.0.1", 0))
        }
        .expect("bind");
        (server.addrs()[0], server.run())
    })
}

fn pay(target: &str, key: &str, body: &str) -> Request {
    Request::post(target)
        .key(key)
        .header("x-tenant", "tenant_secret_acme")
        .json(body)
}

/// Send `n` copies of `request` at once from `n` threads; the responses.
fn burst(addr: &str, request: &Request, n: usize) -> Vec<Response> {
    let barrier = Arc::new(std::sync::Barrier::new(n));
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let addr = addr.to_owned();
            let request = request.clone();
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                let mut conn = Conn::connect(addr.as_str(), TIMEOUT).expect("connect");
                barrier.wait();
                conn.send(&request).expect("response")
            })
        })
        .collect();
    threads
        .into_iter()
        .map(|t| t.join().expect("client"))
        .collect()
}

#[derive(Debug, Default, PartialEq)]
struct Tally {
    fresh: usize,
    replay: usize,
    conflict: usize,
    other: Vec<u16>,
}

fn tally(responses: &[Response]) -> Tally {
    let mut t = Tally::default();
    for r in responses {
        if r.status == 409 {
            t.conflict += 1;
        } else if r.is_replay() {
            t.replay += 1;
        } else if r.status == 201 {
            t.fresh += 1;
        } else {
            t.other.push(r.status);
        }
    }
    t
}

/// Wait until the hook saw `n` events (outcomes of streamed or detached requests come late).
fn wait_events(probe: &Probe, n: usize) {
    let deadline = Instant::now() + TIMEOUT;
    while probe.events().len() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn route(prefix: &str) -> String {
    format!("/{prefix}/pay/{{id}}")
}

/// Wait until the handler has started `n` runs.
fn wait_runs(probe: &Probe, n: u64) {
    let deadline = Instant::now() + TIMEOUT;
    while probe.runs() < n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Wait (at most `timeout`, looking every `poll`) until `name` (the series with `labels`) has
/// grown by 1 since `before`.
fn wait_delta(
    before: &Snap,
    name: &str,
    labels: &[(&str, &str)],
    timeout: Duration,
    poll: Duration,
) {
    let deadline = Instant::now() + timeout;
    while delta(before, &snap(), name, labels) < 1.0 && Instant::now() < deadline {
        std::thread::sleep(poll);
    }
}

/// A server over `store` (see [`serve`]) with a new probe: the probe, the server (keep it: it
/// stops when dropped) and its address.
fn start<S, F>(store: S, prefix: &'static str, tweak: F) -> (Probe, ThreadServer, String)
where
    S: idempotency_actix::store::IdempotencyStore + Clone + Send + 'static,
    F: Fn(IdempotencyBuilder<S>) -> IdempotencyBuilder<S> + Clone + Send + 'static,
{
    let probe = Probe::default();
    let server = serve(store, prefix, &probe, tweak);
    let addr = server.addr.to_string();
    (probe, server, addr)
}

/// [`start`] over a new memory store in wait mode (duplicates wait up to 10 s for the first).
fn start_waiting(prefix: &'static str) -> (Probe, ThreadServer, String) {
    start(MemoryStore::new(), prefix, |b| {
        b.wait_for_in_flight(Duration::from_secs(10))
    })
}

/// `request` sent on a connection of its own, waiting at most [`TIMEOUT`]: the response.
fn send(addr: &str, request: &Request) -> Response {
    send_once(addr, request, TIMEOUT).unwrap()
}

/// `request` written on a new connection, its response not read yet.
fn open(addr: &str, request: &Request) -> Conn {
    let mut conn = Conn::connect(addr, TIMEOUT).unwrap();
    conn.send_raw(&request.to_bytes()).unwrap();
    conn
}

/// One request that runs and is stored (`/{prefix}/pay/0` with `key`), before the store is cut.
fn warm_up(addr: &str, prefix: &str, key: &str) {
    let warm = send(addr, &pay(&format!("/{prefix}/pay/0"), key, "{}"));
    assert_eq!(warm.status, 201, "{}", warm.describe());
}

/// `/{prefix}/pay/{i}` with key `{key}-{i}` for each `i` of `ids`, one after the other, each
/// waiting at most 60 s (the store is down): the statuses.
fn statuses_of(addr: &str, prefix: &str, key: &str, ids: std::ops::Range<u32>) -> Vec<u16> {
    ids.map(|i| {
        let request = pay(&format!("/{prefix}/pay/{i}"), &format!("{key}-{i}"), "{}");
        send_once(addr, &request, Duration::from_secs(60))
            .unwrap()
            .status
    })
    .collect()
}

/// Wait until the hook saw `n` events, snapshot: the snapshot and the report of `what` from
/// `before` to it.
fn settle(probe: &Probe, n: usize, before: &Snap, what: &str) -> (Snap, String) {
    settle_after(probe, n, Duration::ZERO, before, what)
}

/// [`settle`], sleeping `pause` (if not zero) between the events and the snapshot.
fn settle_after(
    probe: &Probe,
    n: usize,
    pause: Duration,
    before: &Snap,
    what: &str,
) -> (Snap, String) {
    wait_events(probe, n);
    if !pause.is_zero() {
        std::thread::sleep(pause);
    }
    let after = snap();
    let report = report_of(what, probe, before, &after);
    (after, report)
}

/// [`warm_up`], then wait for its outcome: the snapshot taken after it.
fn warmed_up(addr: &str, probe: &Probe, prefix: &str, key: &str) -> Snap {
    warm_up(addr, prefix, key);
    wait_events(probe, 1);
    snap()
}

/// `request` sent, PostgreSQL cut once the handler has started its `runs`-th run: the response.
fn cut_mid_handler(addr: &str, probe: &Probe, pg: &Pg, request: &Request, runs: u64) -> Response {
    let mut conn = open(addr, request);
    wait_runs(probe, runs);
    pg.stop();
    conn.read_response("POST").unwrap()
}

/// `request` retried once the store is back: the snapshot after the retry and the report.
/// Asserts that `first` was a 201, the retry a replay, and the handler ran twice (the warm-up
/// and `first`).
fn retry_replays(
    addr: &str,
    probe: &Probe,
    request: &Request,
    first: &Response,
    before: &Snap,
) -> (Snap, String) {
    let retry = send(addr, request);
    let after = snap();
    let what = format!("first {}, retry {}", first.status, retry.describe());
    let report = report_of(&what, probe, before, &after);
    assert_eq!(first.status, 201, "{report}");
    assert!(retry.is_replay(), "{report}");
    assert_eq!(probe.runs(), 2, "{report}");
    (after, report)
}

/// The first request of a burst of duplicates (`seen`) ran once and was the one fresh answer.
fn assert_one_ran(probe: &Probe, seen: &Tally, report: &str) {
    assert_eq!(probe.runs(), 1, "{report}");
    assert_eq!(seen.fresh, 1, "{report}");
}

/// A retry after a reset is answered coherently with the first request's `outcome`: a replay
/// only if it was counted stored.
fn assert_retry_agrees(retry: &Response, outcome: Outcome, report: &str) {
    if retry.is_replay() {
        assert_eq!(outcome, Outcome::Stored, "{report}");
    } else {
        assert_ne!(
            outcome,
            Outcome::Stored,
            "counted stored but the retry ran again: {report}"
        );
    }
}

/// A Postgres test database, the runtime it was made on and (for the scenarios that cut the
/// database) a proxy in front of it. The fields drop in the order of the locals they stand for:
/// proxy, database, runtime.
struct Pg {
    proxy: Option<PgProxy>,
    _db: TestDb,
    rt: tokio::runtime::Runtime,
}

impl Pg {
    /// A new database, and a store connected to it (`through_proxy`: through a [`PgProxy`]).
    fn start(through_proxy: bool) -> (Pg, PostgresStore) {
        let rt = tokio::runtime::Runtime::new().unwrap();
        let db = rt.block_on(TestDb::new());
        let proxy = through_proxy.then(|| rt.block_on(PgProxy::for_url(&db.url)).unwrap());
        let url = match &proxy {
            Some(proxy) => proxy.url_through(&db.url),
            None => db.url.clone(),
        };
        let store = rt.block_on(PostgresStore::connect(&url)).expect("connect");
        (Pg { proxy, _db: db, rt }, store)
    }

    fn proxy(&self) -> &PgProxy {
        self.proxy.as_ref().expect("a database behind a proxy")
    }

    /// The database down for the store: [`PgProxy::stop`].
    fn stop(&self) {
        self.proxy().stop();
    }

    /// The database back: [`PgProxy::resume`].
    fn resume(&self) {
        self.rt.block_on(self.proxy().resume()).unwrap();
    }
}

/// What a scenario saw, for the failure messages: `what` (the clients' answers), the handler
/// runs, every metric that changed from `before` to `after`, and the hook's events.
fn report_of(what: &str, probe: &Probe, before: &Snap, after: &Snap) -> String {
    let what = if what.is_empty() {
        String::new()
    } else {
        format!("{what}, ")
    };
    format!(
        "{what}runs {}, deltas {:#?}, events {:?}",
        probe.runs(),
        after.since(before),
        probe.events()
    )
}

/// What the change of a metric must be: exactly a value, or at least one.
#[derive(Clone, Copy, Debug)]
enum Want {
    Is(f64),
    AtLeast(f64),
}
use Want::{AtLeast, Is};

/// An expectation on the change of a metric: the sum of the series named `name` whose labels
/// include every one of `labels` (as [`delta`]).
#[derive(Clone)]
struct Expect {
    name: &'static str,
    labels: Vec<(&'static str, String)>,
    want: Want,
}

fn metric(name: &'static str, labels: &[(&'static str, &str)], want: Want) -> Expect {
    Expect {
        name,
        labels: labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect(),
        want,
    }
}

/// Keyed requests counted on `route`, whatever their outcome.
fn requests(route: &str, want: Want) -> Expect {
    metric(REQ, &[("route", route)], want)
}

/// Keyed requests counted on `route` with `outcome`.
fn counted(route: &str, outcome: &str, want: Want) -> Expect {
    metric(REQ, &[("outcome", outcome), ("route", route)], want)
}

/// Calls `op` of `store` timed (observations of the store call histogram).
fn calls(op: &str, store: &str, want: Want) -> Expect {
    metric(CALLS, &[("op", op), ("store", store)], want)
}

/// Complete retries with `result`.
fn retries(result: &str, want: Want) -> Expect {
    metric(RETRIES, &[("result", result)], want)
}

/// The reservations held in `store` back where they were (the gauge changed by 0).
fn held_back(store: &str) -> Expect {
    metric(HELD, &[("store", store)], Is(0.0))
}

/// The checks of one scenario on the change of its metrics from `before` to `after`.
struct Deltas<'a> {
    before: &'a Snap,
    after: &'a Snap,
    report: &'a str,
}

impl<'a> Deltas<'a> {
    fn new(before: &'a Snap, after: &'a Snap, report: &'a str) -> Self {
        Deltas {
            before,
            after,
            report,
        }
    }

    /// Check every expectation; if any fails, panic with all that failed and the report.
    fn expect(&self, expectations: &[Expect]) {
        self.noted("", expectations);
    }

    /// [`Deltas::expect`] of what a burst of duplicates on `route` must count (`stored` once,
    /// `conflict` and `replay` as the clients `seen` them, plus `later_replays` replays), then
    /// of `more`.
    fn expect_burst(&self, route: &str, seen: &Tally, later_replays: usize, more: &[Expect]) {
        let mut all = vec![
            counted(route, "stored", Is(1.0)),
            counted(route, "conflict", Is(seen.conflict as f64)),
            counted(route, "replay", Is((seen.replay + later_replays) as f64)),
        ];
        all.extend_from_slice(more);
        self.expect(&all);
    }

    /// [`Deltas::expect`], the failure message starting with `note`.
    fn noted(&self, note: &str, expectations: &[Expect]) {
        let failed: Vec<String> = expectations
            .iter()
            .filter_map(|e| {
                let labels: Vec<(&str, &str)> =
                    e.labels.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let got = delta(self.before, self.after, e.name, &labels);
                let ok = match e.want {
                    Is(want) => got == want,
                    AtLeast(want) => got >= want,
                };
                (!ok).then(|| {
                    format!(
                        "{} {labels:?} changed by {got}, want {:?} (from {} to {})",
                        e.name,
                        e.want,
                        self.before.sum(e.name, &labels),
                        self.after.sum(e.name, &labels)
                    )
                })
            })
            .collect();
        assert!(
            failed.is_empty(),
            "{note}{}{} of {} metric expectations failed:\n  {}\n{}",
            if note.is_empty() { "" } else { ": " },
            failed.len(),
            expectations.len(),
            failed.join("\n  "),
            self.report
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Scenarios.

/// 12 concurrent duplicates of a slow request (memory store): one runs; each other one is a
/// 409 or a replay. Metric deltas and hook events must match the statuses the clients saw;
/// the reserve histogram has one observation per request, complete one; nothing stays held.
#[test]
fn concurrent_duplicates_are_counted_as_the_clients_saw_them() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_dup", |b| b);
    let before = snap();
    let request = pay("/mt_dup/pay/1?delay_ms=700", "dup-1", r#"{"a":1}"#);
    let seen = tally(&burst(&addr, &request, 12));
    // Afterwards: 3 replays and 2 mismatches.
    for _ in 0..3 {
        let r = send(&addr, &request);
        assert!(r.is_replay(), "{}", r.describe());
    }
    for _ in 0..2 {
        let r = send(
            &addr,
            &pay("/mt_dup/pay/1?delay_ms=700", "dup-1", r#"{"a":2}"#),
        );
        assert_eq!(r.status, 422, "{}", r.describe());
    }
    let (after, report) = settle(&probe, 17, &before, &format!("clients {seen:?}"));
    let r = route("mt_dup");
    assert_one_ran(&probe, &seen, &report);
    assert!(seen.other.is_empty(), "{report}");
    Deltas::new(&before, &after, &report).expect_burst(
        &r,
        &seen,
        3,
        &[
            counted(&r, "mismatch", Is(2.0)),
            requests(&r, Is(17.0)),
            calls("reserve", "memory", Is(17.0)),
            calls("complete", "memory", Is(1.0)),
            held_back("memory"),
        ],
    );
    let events = |outcome| probe.count_events(outcome);
    assert_eq!(events(Outcome::Stored), 1, "{report}");
    assert_eq!(events(Outcome::Conflict), seen.conflict, "{report}");
    assert_eq!(events(Outcome::Replay), seen.replay + 3, "{report}");
    assert_eq!(events(Outcome::Mismatch), 2, "{report}");
    assert_eq!(probe.events().len(), 17, "{report}");
    // Hook statuses are the ones sent.
    for e in probe.events() {
        let want = match e.outcome {
            Outcome::Conflict => 409,
            Outcome::Mismatch => 422,
            _ => 201,
        };
        assert_eq!(e.status, want, "{e:?} {report}");
        assert_eq!(e.key.as_deref(), Some("dup-1"), "{report}");
    }
}

/// Wait mode: 10 concurrent duplicates wait for the first; the first is `stored`, the others
/// `replay`; no conflict is counted and no handler runs twice.
#[test]
fn wait_mode_duplicates_are_counted_as_replays() {
    let _serial = serial();
    let (probe, _server, addr) = start_waiting("mt_wait");
    let before = snap();
    let request = pay("/mt_wait/pay/1?delay_ms=600", "wait-1", r#"{"a":1}"#);
    let seen = tally(&burst(&addr, &request, 10));
    let (after, report) = settle(&probe, 10, &before, &format!("clients {seen:?}"));
    let r = route("mt_wait");
    assert_eq!(probe.runs(), 1, "{report}");
    let want = Tally {
        fresh: 1,
        replay: 9,
        conflict: 0,
        other: vec![],
    };
    assert_eq!(seen, want, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        counted(&r, "stored", Is(1.0)),
        counted(&r, "replay", Is(9.0)),
        requests(&r, Is(10.0)),
    ]);
    assert_eq!(probe.events().len(), 10, "{report}");
}

/// Label cardinality: many raw paths, keys, tenants and odd methods give only route patterns
/// (`/mt_card/pay/{id}` or `unmatched`) and a bounded method set; no key, tenant or raw path
/// ever becomes a label value. Keyless requests (key not required) and methods that are passed
/// through are not counted as keyed outcomes, and the hook does not see them.
#[test]
fn labels_stay_bounded_and_passed_through_requests_are_not_counted() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_card", |b| b);
    let before = snap();
    for i in 0..30 {
        let key = format!("cardkey-{i}-secretish");
        let r = send(
            &addr,
            &pay(&format!("/mt_card/pay/raw{i}?x={i}"), &key, r#"{"a":1}"#),
        );
        assert_eq!(r.status, 201, "{}", r.describe());
        let r = send(
            &addr,
            &pay(&format!("/mt_card_nope/raw{i}"), &key, r#"{"a":1}"#),
        );
        assert_eq!(r.status, 404, "{}", r.describe());
        let r = send(
            &addr,
            &Request::new("PURGE", &format!("/mt_card/raw/{i}")).key(&key),
        );
        assert!(r.status >= 400, "{}", r.describe());
    }
    let keyed_events = probe.events().len();
    // Keyless POST, keyed GET and HEAD: passed through.
    let runs_before = probe.runs();
    let r = send(&addr, &Request::post("/mt_card/pay/k").json(r#"{"a":1}"#));
    assert_eq!(r.status, 201);
    let r = send(&addr, &Request::get("/mt_card/pay/g").key("get-key"));
    assert_eq!(r.status, 201);
    assert_eq!(probe.runs(), runs_before + 2);
    let after = snap();
    let report = format!("deltas {:#?}", after.since(&before));
    let mut routes = std::collections::BTreeSet::new();
    let mut methods = std::collections::BTreeSet::new();
    for id in after.since(&before).keys() {
        assert!(
            !id.contains("cardkey") && !id.contains("tenant_secret") && !id.contains("raw"),
            "a client-chosen value became a label: {id}"
        );
        if let Some(rest) = id.strip_prefix(&format!("{REQ}{{")) {
            for kv in rest.trim_end_matches('}').split(',') {
                if let Some(v) = kv.strip_prefix("route=") {
                    routes.insert(v.to_owned());
                }
                if let Some(v) = kv.strip_prefix("method=") {
                    methods.insert(v.to_owned());
                }
            }
        }
    }
    assert!(
        routes
            .iter()
            .all(|r| r == "/mt_card/pay/{id}" || r == "unmatched"),
        "{routes:?} {report}"
    );
    assert!(
        methods
            .iter()
            .all(|m| ["POST", "PATCH", "PUT", "DELETE", "GET", "other"].contains(&m.as_str())),
        "{methods:?} {report}"
    );
    // Keyed requests: 30 stored + 30 unmatched (404, not stored) = 60 counted; the passed
    // through keyless POST and keyed GET add nothing.
    let counted_total = delta(&before, &after, REQ, &[]);
    assert_eq!(
        counted_total,
        keyed_events as f64,
        "metric total vs hook events; {report} events {:?}",
        probe.events()
    );
    Deltas::new(&before, &after, &report).expect(&[counted(
        "/mt_card/pay/{id}",
        "stored",
        Is(30.0),
    )]);
    assert_eq!(
        probe.events().len(),
        keyed_events,
        "passed-through requests reached the hook: {:?}",
        &probe.events()[keyed_events..]
    );
}

/// A response over `max_response_bytes` is sent but not stored: `not_stored`, the key
/// released (release histogram), a retry runs again and is counted again.
#[test]
fn too_large_responses_are_counted_not_stored() {
    let _serial = serial();
    let (probe, _server, addr) =
        start(MemoryStore::new(), "mt_big", |b| b.max_response_bytes(1024));
    let before = snap();
    for _ in 0..2 {
        let r = send(&addr, &pay("/mt_big/pay/1?size=5000", "big-1", "{}"));
        assert_eq!(r.status, 201, "{}", r.describe());
        assert_eq!(r.body.len(), 5000);
    }
    let (after, report) = settle(&probe, 2, &before, "");
    let r = route("mt_big");
    assert_eq!(probe.runs(), 2, "{report}");
    assert_eq!(probe.count_events(Outcome::NotStored), 2, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        counted(&r, "not_stored", Is(2.0)),
        requests(&r, Is(2.0)),
        calls("release", "memory", Is(2.0)),
        calls("complete", "memory", Is(0.0)),
    ]);
}

/// A streamed response is counted once, when it ends (stored); a stream that fails after its
/// head is counted once as `body_error`.
#[test]
fn streamed_responses_are_counted_once() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_stream", |b| b);
    let before = snap();
    let request = pay("/mt_stream/pay/1?stream=1", "s-1", "{}");
    let r = send(&addr, &request);
    assert_eq!(r.status, 201, "{}", r.describe());
    let replay = send(&addr, &request);
    assert!(replay.is_replay(), "{}", replay.describe());
    assert_eq!(replay.body, r.body);
    // The failing stream: the client sees a head then a cut.
    let _ = send_once(
        &addr,
        &pay("/mt_stream/pay/2?stream=fail", "s-2", "{}"),
        TIMEOUT,
    );
    let (after, report) = settle_after(&probe, 3, Duration::from_millis(300), &before, "");
    let r = route("mt_stream");
    assert_eq!(probe.runs(), 2, "{report}");
    assert_eq!(probe.events().len(), 3, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        counted(&r, "stored", Is(1.0)),
        counted(&r, "replay", Is(1.0)),
        counted(&r, "body_error", Is(1.0)),
        requests(&r, Is(3.0)),
        held_back("memory"),
    ]);
}

/// A client that resets its connection while the handler runs: the handler runs once, the
/// request is counted exactly once (and as an outcome that ran the handler), the gauge goes
/// back, and a retry is a replay (stored) or runs (released): whichever, the counts agree.
#[test]
fn a_client_reset_mid_handler_is_counted_once() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_reset", |b| b);
    let before = snap();
    let request = pay("/mt_reset/pay/1?delay_ms=800", "reset-1", "{}");
    let conn = open(&addr, &request);
    wait_runs(&probe, 1);
    conn.reset().unwrap();
    // Let the handler finish (or be cut) and the outcome be reported.
    std::thread::sleep(Duration::from_millis(1500));
    wait_events(&probe, 1);
    let mid = snap();
    let r = route("mt_reset");
    let finished = format!("finished {}", probe.finished.load(Ordering::SeqCst));
    let report = report_of(&finished, &probe, &before, &mid);
    assert_eq!(probe.runs(), 1, "{report}");
    let d = Deltas::new(&before, &mid, &report);
    d.noted(
        "the reset request must be counted exactly once",
        &[requests(&r, Is(1.0))],
    );
    assert_eq!(probe.events().len(), 1, "{report}");
    let outcome = probe.events()[0].outcome;
    assert!(
        outcome.ran_handler(),
        "the handler ran but the outcome says it did not: {report}"
    );
    d.noted("gauge", &[held_back("memory")]);
    let retry = send(&addr, &request);
    let (after, report) = settle(&probe, 2, &before, &format!("retry {}", retry.describe()));
    let finished = probe.finished.load(Ordering::SeqCst);
    assert_retry_agrees(&retry, outcome, &report);
    if retry.is_replay() {
        assert_eq!(finished, 1, "{report}");
    }
    Deltas::new(&before, &after, &report).expect(&[requests(&r, Is(2.0))]);
}

/// HTTP/1: a handler that panics after its client reset (its work already on a task of its
/// own, the request's future dropped by actix) is counted once, as `handler_panic`. Review,
/// 2026-12-06: the panic was reported only by the request's future, which was gone, so it was
/// counted nowhere: no counter, no hook, no log line.
#[test]
fn a_handler_panicking_after_its_client_reset_is_counted_once() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_rstpanic", |b| b);
    let before = snap();
    let conn = open(
        &addr,
        &pay("/mt_rstpanic/pay/1?delay_ms=500&panic=1", "rp-1", "{}"),
    );
    wait_runs(&probe, 1);
    conn.reset().unwrap();
    let (after, report) = settle_after(
        &probe,
        1,
        Duration::from_millis(800),
        &before,
        "reset, then the handler panics",
    );
    let r = route("mt_rstpanic");
    assert_eq!(probe.count_events(Outcome::HandlerPanic), 1, "{report}");
    assert_eq!(probe.events().len(), 1, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        requests(&r, Is(1.0)),
        counted(&r, "handler_panic", Is(1.0)),
        held_back("memory"),
    ]);
}

/// The PostgreSQL store down before the handler: every request a 503, counted as
/// `store_unavailable` (the documented alert), the handler never runs, each failed reserve
/// timed. Then with `fail_open`: every request runs, counted `fail_open`.
#[test]
fn postgres_down_is_counted_as_store_unavailable_and_fail_open() {
    let _serial = serial();
    let (pg, store) = Pg::start(true);
    for (prefix, fail_open) in [("mt_pgdown", false), ("mt_pgopen", true)] {
        let (probe, server, addr) = start(store.clone(), prefix, move |b| b.fail_open(fail_open));
        warm_up(&addr, prefix, &format!("{prefix}-warm"));
        pg.stop();
        let before = snap();
        let statuses = statuses_of(&addr, prefix, prefix, 0..5);
        let what = format!("{prefix}: statuses {statuses:?}");
        let (after, report) = settle(&probe, 6, &before, &what);
        let r = route(prefix);
        let d = Deltas::new(&before, &after, &report);
        if fail_open {
            assert_eq!(statuses, vec![201; 5], "{report}");
            assert_eq!(probe.runs(), 6, "{report}");
            d.expect(&[counted(&r, "fail_open", Is(5.0))]);
        } else {
            assert_eq!(statuses, vec![503; 5], "{report}");
            assert_eq!(probe.runs(), 1, "{report}");
            d.expect(&[counted(&r, "store_unavailable", Is(5.0))]);
        }
        d.expect(&[
            requests(&r, Is(5.0)),
            calls("reserve", "postgres", AtLeast(5.0)),
            held_back("postgres"),
        ]);
        drop(server);
        pg.resume();
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The Redis store down (server killed): 503s counted as `store_unavailable` with store label
/// `redis`, the handler never runs.
#[test]
fn redis_down_is_counted_as_store_unavailable() {
    let _serial = serial();
    let mut redis = RedisServer::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = rt
        .block_on(RedisStore::builder().connect(&redis.url()))
        .expect("connect");
    let (probe, _server, addr) = start(store, "mt_rdown", |b| b);
    warm_up(&addr, "mt_rdown", "r-warm");
    redis.kill();
    let before = snap();
    let statuses = statuses_of(&addr, "mt_rdown", "r", 0..4);
    let (after, report) = settle(&probe, 5, &before, &format!("statuses {statuses:?}"));
    let r = route("mt_rdown");
    assert_eq!(statuses, vec![503; 4], "{report}");
    assert_eq!(probe.runs(), 1, "{report}");
    let d = Deltas::new(&before, &after, &report);
    d.expect(&[
        counted(&r, "store_unavailable", Is(4.0)),
        calls("reserve", "redis", AtLeast(4.0)),
    ]);
    // The alert of docs/operations.md filters nothing by store, but a dashboard per store
    // (`store` label, "a short, fixed name": memory, postgres, cached) must see `redis`.
    let unavailable = [
        ("outcome", "store_unavailable"),
        ("route", r.as_str()),
        ("store", "redis"),
    ];
    d.noted(
        &format!(
            "the Redis store is labelled {:?}",
            after.since(&before).keys().next()
        ),
        &[metric(REQ, &unavailable, Is(4.0))],
    );
}

/// The store fails after the handler ran (PostgreSQL cut while the handler sleeps) and comes
/// back within the lease: the request is `complete_failed` once, the retries `started` once
/// and `succeeded` once, a later retry is a replay. Then a second key whose store stays down
/// past the lease: `given_up` once (the documented "responses lost" alert).
#[test]
fn a_store_failing_after_the_handler_counts_complete_retries_truthfully() {
    let _serial = serial();
    let (pg, store) = Pg::start(true);
    let (probe, _server, addr) = start(store, "mt_after", |b| {
        b.lock_timeout(Duration::from_secs(4))
    });
    let r = route("mt_after");

    // 1. Down during the handler, back 1 s later.
    let before = warmed_up(&addr, &probe, "mt_after", "after-warm");
    let request = pay("/mt_after/pay/1?delay_ms=600", "after-1", "{}");
    let first = cut_mid_handler(&addr, &probe, &pg, &request, 2);
    std::thread::sleep(Duration::from_millis(600));
    pg.resume();
    // Wait for the retry to land.
    let succeeded = [("result", "succeeded"), ("store", "postgres")];
    let (ten_s, poll) = (Duration::from_secs(10), Duration::from_millis(50));
    wait_delta(&before, RETRIES, &succeeded, ten_s, poll);
    let (after, report) = retry_replays(&addr, &probe, &request, &first, &before);
    let d = Deltas::new(&before, &after, &report);
    d.expect(&[
        counted(&r, "complete_failed", Is(1.0)),
        counted(&r, "replay", Is(1.0)),
        requests(&r, Is(2.0)),
        retries("started", Is(1.0)),
        retries("succeeded", Is(1.0)),
        retries("given_up", Is(0.0)),
        retries("stale", Is(0.0)),
    ]);
    d.noted("held after the retry succeeded", &[held_back("postgres")]);

    // 2. Down past the lease: given up once.
    let before = snap();
    let request = pay("/mt_after/pay/2?delay_ms=600", "after-2", "{}");
    let first = cut_mid_handler(&addr, &probe, &pg, &request, 3);
    let given_up = [("result", "given_up"), ("store", "postgres")];
    let (fifteen_s, poll) = (Duration::from_secs(15), Duration::from_millis(100));
    wait_delta(&before, RETRIES, &given_up, fifteen_s, poll);
    std::thread::sleep(Duration::from_millis(500));
    let after = snap();
    let report = report_of(&format!("first {}", first.status), &probe, &before, &after);
    pg.resume();
    assert_eq!(first.status, 201, "{report}");
    let d = Deltas::new(&before, &after, &report);
    d.expect(&[
        counted(&r, "complete_failed", Is(1.0)),
        retries("started", Is(1.0)),
        retries("given_up", Is(1.0)),
        retries("succeeded", Is(0.0)),
        // A failed complete is timed too.
        calls("complete", "postgres", AtLeast(1.0)),
    ]);
    d.noted("held after giving up", &[held_back("postgres")]);
}

/// The release of a response that is not stored (a 500) fails with the store down mid-handler
/// and is retried in the background until the store is back: counted `started` and then
/// `succeeded` (review, 2026-12-06: the release retry had no metric at all), and the key is
/// free again.
#[test]
fn a_failed_release_is_retried_and_counted() {
    let _serial = serial();
    let (pg, store) = Pg::start(true);
    let (probe, _server, addr) = start(store, "mt_relretry", |b| {
        b.lock_timeout(Duration::from_secs(4))
    });
    let before = warmed_up(&addr, &probe, "mt_relretry", "relretry-warm");
    let request = pay(
        "/mt_relretry/pay/1?delay_ms=600&status=500",
        "relretry-1",
        "{}",
    );
    let first = cut_mid_handler(&addr, &probe, &pg, &request, 2);
    std::thread::sleep(Duration::from_millis(600));
    pg.resume();
    let succeeded = [("result", "succeeded"), ("store", "postgres")];
    let (ten_s, poll) = (Duration::from_secs(10), Duration::from_millis(50));
    wait_delta(&before, RELEASE_RETRIES, &succeeded, ten_s, poll);
    let after = snap();
    let report = report_of(&format!("first {}", first.status), &probe, &before, &after);
    assert_eq!(first.status, 500, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        metric(RELEASE_RETRIES, &[("result", "started")], Is(1.0)),
        metric(RELEASE_RETRIES, &[("result", "succeeded")], Is(1.0)),
        metric(RELEASE_RETRIES, &[("result", "given_up")], Is(0.0)),
        held_back("postgres"),
    ]);
    // The key is free: the corrected retry runs.
    let retry = send(
        &addr,
        &pay("/mt_relretry/pay/1?delay_ms=0", "relretry-1", "{}"),
    );
    assert_eq!(retry.status, 201, "{}", retry.describe());
}

/// CachedStore over PostgreSQL: one miss and 5 replays (served from the cache after the
/// first): exactly 1 `stored` and 5 `replay`, store label of the cache, no double count.
#[test]
fn cached_store_replays_are_counted_once() {
    let _serial = serial();
    let (_pg, inner) = Pg::start(false);
    let (probe, _server, addr) = start(CachedStore::new(inner), "mt_cache", |b| b);
    let before = snap();
    let request = pay("/mt_cache/pay/1", "cache-1", "{}");
    assert_eq!(send(&addr, &request).status, 201);
    for _ in 0..5 {
        let r = send(&addr, &request);
        assert!(r.is_replay(), "{}", r.describe());
    }
    let (after, report) = settle(&probe, 6, &before, "");
    let r = route("mt_cache");
    assert_eq!(probe.runs(), 1, "{report}");
    assert_eq!(probe.events().len(), 6, "{report}");
    let d = Deltas::new(&before, &after, &report);
    d.expect(&[
        counted(&r, "stored", Is(1.0)),
        counted(&r, "replay", Is(5.0)),
        metric(REQ, &[], Is(6.0)),
    ]);
    d.noted(
        "one reserve observation per request",
        &[metric(CALLS, &[("op", "reserve")], Is(6.0))],
    );
}

/// Transactional mode: a 500 is `rolled_back` (ran the handler), a 201 `stored`, a replay
/// `replay`; a response over `max_response_bytes` is `rolled_back` with the 5xx the client got.
#[test]
fn transactional_outcomes_match_what_the_client_got() {
    let _serial = serial();
    let (_pg, store) = Pg::start(false);
    let (probe, _server, addr) = start(store, "mt_tx", |b| {
        b.max_response_bytes(1024).transactional()
    });
    let before = snap();
    let failed = send(&addr, &pay("/mt_tx/pay/1?status=500", "tx-1", "{}"));
    let ok = send(&addr, &pay("/mt_tx/pay/1", "tx-1", "{}"));
    let replay = send(&addr, &pay("/mt_tx/pay/1", "tx-1", "{}"));
    let big = send(&addr, &pay("/mt_tx/pay/2?size=5000", "tx-2", "{}"));
    let statuses = [failed.status, ok.status, replay.status, big.status];
    let (after, report) = settle(&probe, 4, &before, &format!("statuses {statuses:?}"));
    let r = route("mt_tx");
    assert_eq!(failed.status, 500, "{report}");
    assert_eq!(ok.status, 201, "{report}");
    assert!(replay.is_replay(), "{report}");
    assert_eq!(probe.runs(), 3, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        counted(&r, "rolled_back", Is(2.0)),
        counted(&r, "stored", Is(1.0)),
        counted(&r, "replay", Is(1.0)),
        requests(&r, Is(4.0)),
        held_back("postgres"),
    ]);
    assert_eq!(
        probe.statuses(),
        statuses,
        "hook statuses vs client statuses: {report}"
    );
}

/// Refused requests: a missing key when one is required, an invalid key, a body over
/// `max_body_bytes`, and a full memory store (503): each counted once with its outcome, the
/// hook sees the status the client got, the handler never runs.
#[test]
fn refused_requests_are_counted_with_the_status_sent() {
    let _serial = serial();
    let store = MemoryStore::builder().max_entries(1).build();
    let (probe, _server, addr) = start(store, "mt_refuse", |b| b.required(true).max_body_bytes(64));
    let before = snap();
    let too_large = format!("{{\"a\":\"{}\"}}", "x".repeat(200));
    // Fill the store with one live reservation... then one more key: full.
    let statuses: Vec<u16> = [
        pay("/mt_refuse/pay/1", "ref-1", "{}"),
        pay("/mt_refuse/pay/2", "ref-2", "{}"),
        Request::post("/mt_refuse/pay/3").json("{}"),
        pay("/mt_refuse/pay/4", &"k".repeat(2000), "{}"),
        pay("/mt_refuse/pay/5", "ref-5", &too_large),
    ]
    .iter()
    .map(|request| send(&addr, request).status)
    .collect();
    let (after, report) = settle(&probe, 5, &before, &format!("statuses {statuses:?}"));
    let r = route("mt_refuse");
    let d = Deltas::new(&before, &after, &report);
    d.expect(&[requests(&r, Is(5.0))]);
    assert_eq!(probe.statuses(), statuses, "{report}");
    for e in probe.events() {
        let outcome = e.outcome.as_str();
        d.noted(
            &format!("{e:?} not counted"),
            &[counted(&r, outcome, AtLeast(1.0))],
        );
        assert_eq!(e.outcome.ran_handler(), e.status == 201, "{e:?}: {report}");
    }
    assert_eq!(
        probe.runs() as usize,
        statuses.iter().filter(|s| **s == 201).count(),
        "{report}"
    );
    d.expect(&[
        counted(&r, "missing_key", Is(1.0)),
        counted(&r, "invalid_key", Is(1.0)),
        counted(&r, "payload_too_large", Is(1.0)),
    ]);
}

/// A panicking handler: 500 to the client, counted once as `handler_panic`, the hook sees 500,
/// the held gauge goes back.
#[test]
fn a_panicking_handler_is_counted_once() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_panic", |b| b);
    let before = snap();
    let r = send_once(
        &addr,
        &pay("/mt_panic/pay/1?panic=1", "panic-1", "{}"),
        TIMEOUT,
    );
    let client = format!("client {:?}", r.as_ref().map(|r| r.status));
    let (after, report) = settle_after(&probe, 1, Duration::from_millis(300), &before, &client);
    let rt = route("mt_panic");
    assert_eq!(probe.runs(), 1, "{report}");
    assert_eq!(probe.events().len(), 1, "{report}");
    if let Ok(r) = &r {
        assert_eq!(probe.events()[0].status, r.status, "{report}");
    }
    Deltas::new(&before, &after, &report).expect(&[
        requests(&rt, Is(1.0)),
        counted(&rt, "handler_panic", Is(1.0)),
        held_back("memory"),
    ]);
}

/// Wait mode: a waiter whose client resets while it waits is counted once as `abandoned`
/// (status 499 in the hook), the first request once as `stored`, the handler ran once.
#[test]
fn an_abandoned_waiter_is_counted_once() {
    let _serial = serial();
    let (probe, _server, addr) = start_waiting("mt_aband");
    let before = snap();
    let request = pay("/mt_aband/pay/1?delay_ms=1000", "ab-1", "{}");
    let mut first = open(&addr, &request);
    wait_runs(&probe, 1);
    let waiter = open(&addr, &request);
    std::thread::sleep(Duration::from_millis(200));
    waiter.reset().unwrap();
    let first = first.read_response("POST").unwrap();
    let what = format!("first {}", first.status);
    let (after, report) = settle_after(&probe, 2, Duration::from_millis(300), &before, &what);
    let r = route("mt_aband");
    assert_eq!(first.status, 201, "{report}");
    assert_eq!(probe.runs(), 1, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        requests(&r, Is(2.0)),
        counted(&r, "stored", Is(1.0)),
        counted(&r, "abandoned", Is(1.0)),
    ]);
    assert!(
        probe
            .events()
            .iter()
            .any(|e| e.outcome == Outcome::Abandoned && e.status == 499),
        "{report}"
    );
}

/// A client that resets mid-upload (Content-Length 1000, 10 bytes sent): nothing runs; the
/// request is counted at most once, as `request_body_error`, never as something that ran.
#[test]
fn a_reset_mid_upload_is_counted_as_a_body_error() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_upload", |b| b);
    let before = snap();
    let mut conn = Conn::connect(addr.as_str(), TIMEOUT).unwrap();
    conn.send_raw(b"POST /mt_upload/pay/1 HTTP/1.1\r\nHost: x\r\nIdempotency-Key: up-1\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"a\":\"xxxx").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    conn.reset().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let after = snap();
    let r = route("mt_upload");
    let report = report_of("", &probe, &before, &after);
    assert_eq!(probe.runs(), 0, "{report}");
    let total = delta(&before, &after, REQ, &[("route", &r)]);
    assert!(total <= 1.0, "{report}");
    let d = Deltas::new(&before, &after, &report);
    d.expect(&[counted(&r, "request_body_error", Is(total))]);
    assert_eq!(probe.events().len() as f64, total, "{report}");
    d.expect(&[held_back("memory")]);
    // A retry with the full body runs once and is stored (nothing was reserved); measured on a
    // snapshot taken after it, so that what the retry does is what is checked.
    let retry = send(&addr, &pay("/mt_upload/pay/1", "up-1", "{}"));
    assert_eq!(retry.status, 201, "{}", retry.describe());
    let what = format!("retry {}", retry.describe());
    let (after_retry, report) = settle(&probe, total as usize + 1, &before, &what);
    assert_eq!(probe.runs(), 1, "{report}");
    Deltas::new(&before, &after_retry, &report)
        .expect(&[counted(&r, "stored", Is(1.0)), held_back("memory")]);
}

/// Concurrent duplicates on PostgreSQL (two app workers): conflicts and replays counted as
/// the clients saw them; lease renewals of a handler running past a third of the lease are
/// counted `renewed`, never `lost`.
#[test]
fn postgres_duplicates_and_renewals_are_counted_truthfully() {
    let _serial = serial();
    let (_pg, store) = Pg::start(false);
    let (probe, _server, addr) = start(store, "mt_pgdup", |b| {
        b.lock_timeout(Duration::from_millis(900))
    });
    let before = snap();
    let request = pay("/mt_pgdup/pay/1?delay_ms=1500", "pgdup-1", "{}");
    let seen = tally(&burst(&addr, &request, 8));
    let (after, report) = settle(&probe, 8, &before, &format!("clients {seen:?}"));
    let r = route("mt_pgdup");
    assert_one_ran(&probe, &seen, &report);
    let renewed = [("result", "renewed"), ("store", "postgres")];
    Deltas::new(&before, &after, &report).expect_burst(
        &r,
        &seen,
        0,
        &[
            requests(&r, Is(8.0)),
            metric(RENEW, &renewed, AtLeast(2.0)),
            metric(RENEW, &[("result", "lost")], Is(0.0)),
        ],
    );
    let renew_calls = [("op", "renew_lease"), ("store", "postgres")];
    assert_eq!(
        delta(&before, &after, RENEW, &renewed),
        delta(&before, &after, CALLS, &renew_calls),
        "every renewal timed, every timed renewal counted: {report}"
    );
}

/// A handler that outlives `renew_lease_up_to`: a retry takes the key over and runs again. The
/// first is counted `stale` (the docs' "completes going stale" alert), the renewals `limit`,
/// the retry `stored`; two runs, two outcomes that ran the handler.
#[test]
fn a_handler_past_the_renewal_limit_is_counted_stale() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_stale", |b| {
        b.lock_timeout(Duration::from_millis(300))
            .renew_lease_up_to(Duration::from_millis(600))
    });
    let before = snap();
    let request = pay("/mt_stale/pay/1?delay_ms=2000", "stale-1", "{}");
    let mut first = open(&addr, &request);
    std::thread::sleep(Duration::from_millis(1200));
    let second = send(&addr, &request);
    let first = first.read_response("POST").unwrap();
    let what = format!("first {} second {}", first.status, second.status);
    let (after, report) = settle_after(&probe, 2, Duration::from_millis(300), &before, &what);
    let r = route("mt_stale");
    assert_eq!(probe.runs(), 2, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        requests(&r, Is(2.0)),
        counted(&r, "stale", Is(1.0)),
        counted(&r, "stored", Is(1.0)),
        metric(RENEW, &[("result", "limit")], AtLeast(1.0)),
        held_back("memory"),
    ]);
    eprintln!("stale scenario: {report}");
    assert!(
        probe.events().iter().all(|e| e.outcome.ran_handler()),
        "{report}"
    );
    // Both clients got their handler's answer: the first's was not stored (stale), the
    // second's (the takeover's) was, and a retry replays it without a third run.
    assert_eq!((first.status, second.status), (201, 201), "{report}");
    let retry = send(&addr, &request);
    assert_eq!(retry.status, 201, "retry {}; {report}", retry.describe());
    assert_eq!(
        retry.body,
        second.body,
        "retry {}; {report}",
        retry.describe()
    );
    assert_eq!(probe.runs(), 2, "the retry ran the handler: {report}");
}

/// A client that resets while a slow streamed response is being sent: one outcome, once,
/// one that ran the handler; the held gauge back; a retry is answered coherently with it.
#[test]
fn a_client_reset_mid_stream_is_counted_once() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_midstream", |b| b);
    let before = snap();
    let request = pay("/mt_midstream/pay/1?stream=slow", "ms-1", "{}");
    let mut conn = open(&addr, &request);
    let head = conn.read_head().unwrap();
    std::thread::sleep(Duration::from_millis(200));
    conn.reset().unwrap();
    std::thread::sleep(Duration::from_millis(2000));
    let (mid, report) = settle(&probe, 1, &before, &format!("head {:?}", head.0));
    let r = route("mt_midstream");
    assert_eq!(probe.runs(), 1, "{report}");
    assert_eq!(probe.events().len(), 1, "{report}");
    assert!(probe.events()[0].outcome.ran_handler(), "{report}");
    Deltas::new(&before, &mid, &report).expect(&[requests(&r, Is(1.0)), held_back("memory")]);
    let retry = send(&addr, &request);
    wait_events(&probe, 2);
    let outcome = probe.events()[0].outcome;
    let report = format!(
        "retry {}, {report}, events {:?}",
        retry.describe(),
        probe.events()
    );
    assert_retry_agrees(&retry, outcome, &report);
}

/// The hook's `elapsed` of a streamed response runs "to the end of the stream" (OutcomeEvent
/// docs): a stream of 8 chunks 150 ms apart is at least 1.1 s.
#[test]
fn a_streamed_responses_elapsed_covers_the_stream() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_elapsed", |b| b);
    let started = Instant::now();
    let r = send(&addr, &pay("/mt_elapsed/pay/1?stream=slow", "el-1", "{}"));
    let took = started.elapsed();
    wait_events(&probe, 1);
    let events = probe.events();
    assert_eq!(r.status, 201);
    assert_eq!(events.len(), 1, "{events:?}");
    assert!(
        events[0].elapsed >= Duration::from_millis(1100)
            && events[0].elapsed <= took + Duration::from_millis(200),
        "client took {took:?}, hook says {events:?}"
    );
}

/// Transactional mode, PostgreSQL cut while the handler runs: the client gets a 5xx
/// (COMMIT_FAILED or COMMIT_OUTCOME_UNKNOWN); it is counted once, as the outcome matching the
/// code it got, with the status it got; a retry after the database is back is answered
/// coherently (replay only if committed).
#[test]
fn transactional_commit_failure_is_counted_as_the_client_was_told() {
    let _serial = serial();
    let (pg, store) = Pg::start(true);
    let (probe, _server, addr) = start(store, "mt_txcut", |b| b.transactional());
    let before = warmed_up(&addr, &probe, "mt_txcut", "txc-warm");
    let request = pay("/mt_txcut/pay/1?delay_ms=700", "txc-1", "{}");
    let first = cut_mid_handler(&addr, &probe, &pg, &request, 2);
    let what = format!("client {}", first.describe());
    let (mid, report) = settle_after(&probe, 2, Duration::from_millis(300), &before, &what);
    let r = route("mt_txcut");
    Deltas::new(&before, &mid, &report).expect(&[requests(&r, Is(1.0)), held_back("postgres")]);
    let event = probe.events()[1].clone();
    assert_eq!(event.status, first.status, "{report}");
    let want = match first.problem_code().as_deref() {
        Some("COMMIT_FAILED") => Outcome::CommitFailed,
        Some("COMMIT_OUTCOME_UNKNOWN") => Outcome::CommitUnknown,
        Some("STORAGE_UNAVAILABLE") => Outcome::StoreUnavailable,
        _ => Outcome::RolledBack,
    };
    assert_eq!(event.outcome, want, "{report}");
    assert!(event.outcome.ran_handler(), "{report}");
    pg.resume();
    std::thread::sleep(Duration::from_millis(300));
    let retry = send(&addr, &request);
    let report = format!("retry {}, {report}", retry.describe());
    assert!(
        !retry.is_replay(),
        "a commit reported failed was replayed: {report}"
    );
}

/// CachedStore over PostgreSQL that is down: 503s counted `store_unavailable` once each, no
/// handler run, labelled with the store the app uses.
#[test]
fn cached_store_over_a_dead_database_counts_store_unavailable_once() {
    let _serial = serial();
    let (pg, inner) = Pg::start(true);
    let (probe, _server, addr) = start(CachedStore::new(inner), "mt_cdown", |b| b);
    warm_up(&addr, "mt_cdown", "cd-warm");
    // The first replay caches the record (CachedStore caches what `reserve` returns completed).
    let warm = pay("/mt_cdown/pay/0", "cd-warm", "{}");
    let cached = send(&addr, &warm);
    assert!(cached.is_replay(), "{}", cached.describe());
    wait_events(&probe, 2);
    pg.stop();
    let before = snap();
    let statuses = statuses_of(&addr, "mt_cdown", "cd", 1..4);
    // The cached record still replays.
    let replay = send_once(&addr, &warm, Duration::from_secs(60)).unwrap();
    let what = format!("statuses {statuses:?} replay {}", replay.status);
    let (after, report) = settle(&probe, 6, &before, &what);
    let r = route("mt_cdown");
    assert_eq!(statuses, vec![503; 3], "{report}");
    assert_eq!(probe.runs(), 1, "{report}");
    assert!(
        replay.is_replay(),
        "a cached record is replayed while the database is down: {report}"
    );
    Deltas::new(&before, &after, &report).expect(&[
        counted(&r, "store_unavailable", Is(3.0)),
        requests(&r, Is(4.0)),
        counted(&r, "replay", Is(1.0)),
    ]);
    pg.resume();
}

/// Transactional mode, concurrent duplicates: one runs and commits; the others are 409 or
/// replays, counted as such.
#[test]
fn transactional_duplicates_are_counted_as_the_clients_saw_them() {
    let _serial = serial();
    let (_pg, store) = Pg::start(false);
    let (probe, _server, addr) = start(store, "mt_txdup", |b| b.transactional());
    let before = snap();
    let request = pay("/mt_txdup/pay/1?delay_ms=700", "txd-1", "{}");
    let seen = tally(&burst(&addr, &request, 8));
    let (after, report) = settle(&probe, 8, &before, &format!("clients {seen:?}"));
    let r = route("mt_txdup");
    assert_one_ran(&probe, &seen, &report);
    assert!(seen.other.is_empty(), "{report}");
    Deltas::new(&before, &after, &report).expect_burst(&r, &seen, 0, &[]);
    assert_eq!(probe.events().len(), 8, "{report}");
}

/// HTTP/2 (h2c): 8 concurrent streams with one key on one connection, and a stream reset while
/// its handler runs (another key): counts match the answers; the reset request counted once.
#[test]
fn http2_duplicates_and_a_reset_stream_are_counted_truthfully() {
    let _serial = serial();
    let probe = Probe::default();
    let server = serve_with(MemoryStore::new(), "mt_h2", &probe, |b| b, true);
    let addr = server.addr;
    let before = snap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let answers: Vec<(u16, bool)> = rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let request = |key: &str, target: &str| {
            http02::Request::builder()
                .method("POST")
                .uri(format!("http://localhost{target}"))
                .header("content-type", "application/json")
                .header("idempotency-key", key)
                .body(())
                .unwrap()
        };
        // The reset one first.
        let mut c = client.clone().ready().await.expect("ready");
        let (resp, mut stream) = c
            .send_request(request("h2-reset", "/mt_h2/pay/9?delay_ms=800"), false)
            .expect("send");
        stream
            .send_data(Bytes::from_static(b"{}"), true)
            .expect("data");
        tokio::time::sleep(Duration::from_millis(200)).await;
        stream.send_reset(h2::Reason::CANCEL);
        drop(resp);
        let mut tasks = Vec::new();
        for _ in 0..8 {
            let client = client.clone();
            let req = request("h2-dup", "/mt_h2/pay/1?delay_ms=700");
            tasks.push(tokio::spawn(async move {
                let mut c = client.ready().await.expect("ready");
                let (resp, mut stream) = c.send_request(req, false).expect("send");
                stream
                    .send_data(Bytes::from_static(b"{}"), true)
                    .expect("data");
                let resp = tokio::time::timeout(TIMEOUT, resp)
                    .await
                    .expect("in time")
                    .expect("answer");
                let replayed = resp
                    .headers()
                    .get("idempotent-replayed")
                    .is_some_and(|v| v == "true");
                let status = resp.status().as_u16();
                let mut body = resp.into_body();
                while let Some(chunk) = body.data().await {
                    let chunk = chunk.expect("body");
                    let _ = body.flow_control().release_capacity(chunk.len());
                }
                (status, replayed)
            }));
        }
        let mut answers = Vec::new();
        for t in tasks {
            answers.push(t.await.expect("task"));
        }
        tokio::time::sleep(Duration::from_millis(1000)).await;
        answers
    });
    wait_events(&probe, 9);
    let after = snap();
    let r = route("mt_h2");
    let fresh = answers.iter().filter(|(s, rep)| *s == 201 && !rep).count();
    let replays = answers.iter().filter(|(_, rep)| *rep).count();
    let conflicts = answers.iter().filter(|(s, _)| *s == 409).count();
    let what = format!(
        "answers {answers:?}, runs by key {:?}",
        probe.runs_by_key.lock().unwrap()
    );
    let report = report_of(&what, &probe, &before, &after);
    assert_eq!(
        probe.runs_by_key.lock().unwrap().get("h2-dup"),
        Some(&1),
        "{report}"
    );
    assert_eq!(fresh, 1, "{report}");
    assert_eq!(fresh + replays + conflicts, 8, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        requests(&r, Is(9.0)),
        counted(&r, "conflict", Is(conflicts as f64)),
        counted(&r, "replay", Is(replays as f64)),
        held_back("memory"),
    ]);
    let reset_events: Vec<_> = probe
        .events()
        .into_iter()
        .filter(|e| e.key.as_deref() == Some("h2-reset"))
        .collect();
    assert_eq!(reset_events.len(), 1, "{report}");
    assert!(reset_events[0].outcome.ran_handler(), "{report}");
}

/// Over HTTP/2 (h2c, one connection): the first request with `key` on `target` (the handler
/// told to take 1 s), then a waiter with the same key, reset 200 ms after it was sent while the
/// connection stays open; the first request's status. Actix never drops an HTTP/2 request's
/// future, so the waiter's future is still polled after its work reported `abandoned`.
fn abandon_an_http2_waiter(
    addr: std::net::SocketAddr,
    probe: &Probe,
    target: &str,
    key: &str,
) -> u16 {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (client, conn) = h2::client::handshake(tcp).await.expect("h2 handshake");
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let request = || {
            http02::Request::builder()
                .method("POST")
                .uri(format!("http://localhost{target}"))
                .header("content-type", "application/json")
                .header("x-tenant", "tenant_secret_acme")
                .header("idempotency-key", key)
                .body(())
                .unwrap()
        };
        let mut c = client.clone().ready().await.expect("ready");
        let (first, mut stream) = c.send_request(request(), false).expect("send");
        stream
            .send_data(Bytes::from_static(b"{}"), true)
            .expect("data");
        let deadline = Instant::now() + TIMEOUT;
        while probe.runs() < 1 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut c = client.clone().ready().await.expect("ready");
        let (waiter, mut stream) = c.send_request(request(), false).expect("send");
        stream
            .send_data(Bytes::from_static(b"{}"), true)
            .expect("data");
        tokio::time::sleep(Duration::from_millis(200)).await;
        stream.send_reset(h2::Reason::CANCEL);
        drop(waiter);
        let first = tokio::time::timeout(TIMEOUT, first)
            .await
            .expect("in time")
            .expect("answer");
        // The connection stays open while the waiter's future learns that it was abandoned.
        tokio::time::sleep(Duration::from_millis(800)).await;
        first.status().as_u16()
    })
}

/// Wait mode over HTTP/2: a waiter whose client resets its stream is counted once, as
/// `abandoned`, and nothing else: not also as a handler panic (review, 2026-12-06: the waiter's
/// work ended without an answer, which the request's future, never dropped on HTTP/2, took for
/// a panic: a second outcome, an ERROR log line and a false `handler_panic` count).
#[test]
fn an_abandoned_http2_waiter_is_counted_once() {
    let _serial = serial();
    abandoned_http2_waiter_is_counted_once(MemoryStore::new(), "mt_h2ab", |b| {
        b.wait_for_in_flight(Duration::from_secs(10))
    });
}

/// [`an_abandoned_http2_waiter_is_counted_once`] in transactional mode, whose waiter loop is its
/// own.
#[test]
fn an_abandoned_http2_transactional_waiter_is_counted_once() {
    let _serial = serial();
    let (_pg, store) = Pg::start(false);
    abandoned_http2_waiter_is_counted_once(store, "mt_h2txab", |b| {
        b.transactional()
            .wait_for_in_flight(Duration::from_secs(10))
    });
}

/// The two tests above: over h2c, with `store` and the middleware `tweak` sets up in wait mode,
/// a waiter reset by its client ([`abandon_an_http2_waiter`]) is counted once, as `abandoned`.
fn abandoned_http2_waiter_is_counted_once<S, F>(store: S, prefix: &'static str, tweak: F)
where
    S: idempotency_actix::store::IdempotencyStore + Clone + Send + 'static,
    F: Fn(IdempotencyBuilder<S>) -> IdempotencyBuilder<S> + Clone + Send + 'static,
{
    let probe = Probe::default();
    let server = serve_with(store, prefix, &probe, tweak, true);
    let before = snap();
    let target = format!("/{prefix}/pay/1?delay_ms=1000");
    let first = abandon_an_http2_waiter(server.addr, &probe, &target, "h2ab-1");
    let (after, report) = settle_after(
        &probe,
        2,
        Duration::from_millis(300),
        &before,
        &format!("first {first}"),
    );
    let r = route(prefix);
    assert_eq!(first, 201, "{report}");
    assert_eq!(probe.runs(), 1, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        requests(&r, Is(2.0)),
        counted(&r, "stored", Is(1.0)),
        counted(&r, "abandoned", Is(1.0)),
        counted(&r, "handler_panic", Is(0.0)),
    ]);
    let mut outcomes: Vec<_> = probe
        .events()
        .iter()
        .map(|e| (e.outcome, e.status))
        .collect();
    outcomes.sort_by_key(|(_, status)| *status);
    assert_eq!(
        outcomes,
        [(Outcome::Stored, 201), (Outcome::Abandoned, 499)],
        "{report}"
    );
}

/// Wait mode, the first request fails (502, not stored, key released) while 6 duplicates wait:
/// one waiter takes the key and runs; the others replay its response (or get what it got).
/// Every client's answer is counted as what it was; runs = outcomes that ran the handler.
#[test]
fn wait_mode_after_a_failed_first_request_counts_truthfully() {
    let _serial = serial();
    let (probe, _server, addr) = start_waiting("mt_waitfail");
    let before = snap();
    let request = pay("/mt_waitfail/pay/1?delay_ms=500&fail_first=1", "wf-1", "{}");
    let responses = burst(&addr, &request, 7);
    let statuses: Vec<(u16, bool)> = responses
        .iter()
        .map(|r| (r.status, r.is_replay()))
        .collect();
    let (after, report) = settle(&probe, 7, &before, &format!("answers {statuses:?}"));
    let r = route("mt_waitfail");
    let ran: usize = probe
        .events()
        .iter()
        .filter(|e| e.outcome.ran_handler())
        .count();
    assert_eq!(ran as u64, probe.runs(), "{report}");
    assert_eq!(probe.runs(), 2, "{report}");
    let failed = statuses.iter().filter(|(s, _)| *s == 502).count();
    let replays = statuses.iter().filter(|(_, rep)| *rep).count();
    Deltas::new(&before, &after, &report).expect(&[
        requests(&r, Is(7.0)),
        counted(&r, "not_stored", Is(failed as f64)),
        counted(&r, "replay", Is(replays as f64)),
        counted(&r, "stored", Is(1.0)),
    ]);
    let mut hook = probe.statuses();
    let mut got: Vec<u16> = statuses.iter().map(|(s, _)| *s).collect();
    hook.sort_unstable();
    got.sort_unstable();
    assert_eq!(hook, got, "{report}");
}

/// PostgreSQL down for ~0.5 s while a 2.5 s handler renews a 900 ms lease: renewals `failed`
/// then `renewed`, none `lost`; every renewal call is in the histogram (failures included) and
/// counted; the response is stored and replayed.
#[test]
fn renewals_through_a_short_outage_are_counted_truthfully() {
    let _serial = serial();
    let (pg, store) = Pg::start(true);
    let (probe, _server, addr) = start(store, "mt_renew", |b| {
        b.lock_timeout(Duration::from_millis(900))
    });
    let before = warmed_up(&addr, &probe, "mt_renew", "rn-warm");
    let request = pay("/mt_renew/pay/1?delay_ms=2500", "rn-1", "{}");
    let mut conn = open(&addr, &request);
    std::thread::sleep(Duration::from_millis(250));
    pg.stop();
    std::thread::sleep(Duration::from_millis(450));
    pg.resume();
    let first = conn.read_response("POST").unwrap();
    wait_events(&probe, 2);
    std::thread::sleep(Duration::from_millis(300));
    let (after, report) = retry_replays(&addr, &probe, &request, &first, &before);
    Deltas::new(&before, &after, &report).expect(&[
        // The outage is not always seen as `failed`: the store's own reconnect can hold a call
        // until the database is back, and the call then counts as `renewed`.
        metric(RENEW, &[("result", "renewed")], AtLeast(1.0)),
        metric(RENEW, &[("result", "lost")], Is(0.0)),
        counted(&route("mt_renew"), "stored", Is(1.0)),
    ]);
    // Every call is timed; the counter counts the answers the heartbeat acted on. A call still
    // in flight when the handler ended (at most three run at once) is timed by its own task and
    // not counted: it failed here once in CI with 10 calls against 9 renewals.
    let renewals = |result| delta(&before, &after, RENEW, &[("result", result)]);
    let counted = renewals("renewed") + renewals("failed") + renewals("lost");
    let calls = delta(
        &before,
        &after,
        CALLS,
        &[("op", "renew_lease"), ("store", "postgres")],
    );
    assert!(
        calls >= counted && calls <= counted + 3.0,
        "renewal calls timed {calls} against {counted} counted: {report}"
    );
}

/// A tenant source is set: a keyed request without a tenant is `missing_tenant` (400, hook
/// scope none); tenants (client-chosen) never become labels; two tenants with one key are two
/// `stored` outcomes, each run once.
#[test]
fn tenants_are_counted_but_never_labelled() {
    let _serial = serial();
    let (probe, _server, addr) = start(MemoryStore::new(), "mt_tenant", |b| {
        b.tenant_header("x-tenant")
    });
    let before = snap();
    let no_tenant = send(
        &addr,
        &Request::post("/mt_tenant/pay/1").key("t-1").json("{}"),
    );
    let a = send(&addr, &pay("/mt_tenant/pay/1", "t-1", "{}"));
    let other = Request::post("/mt_tenant/pay/1")
        .key("t-1")
        .header("x-tenant", "tenant_other_zzz")
        .json("{}");
    let b = send(&addr, &other);
    let statuses = (no_tenant.status, a.status, b.status);
    let (after, report) = settle(&probe, 3, &before, &format!("{statuses:?}"));
    let r = route("mt_tenant");
    assert_eq!(statuses, (400, 201, 201), "{report}");
    assert_eq!(probe.runs(), 2, "{report}");
    Deltas::new(&before, &after, &report).expect(&[
        counted(&r, "missing_tenant", Is(1.0)),
        counted(&r, "stored", Is(2.0)),
    ]);
    assert!(probe.events()[0].key.is_none(), "{report}");
    for id in after.since(&before).keys() {
        assert!(!id.contains("tenant_"), "{id}");
    }
}
