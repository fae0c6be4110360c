//! Configuration of the middleware: [`IdempotencyBuilder`] and its defaults.
//!
//! Every default is chosen for an API that moves money, where the worst outcome is running a
//! request twice, and the second worst is a key that stays stuck:
//!
//! | option | default | why |
//! |---|---|---|
//! | `header_name` | `Idempotency-Key` | the IETF draft's name, what Stripe and most clients send |
//! | `methods` | POST, PATCH | the non-idempotent methods; GET/PUT/DELETE are idempotent by HTTP's definition |
//! | `required` | `false` | adding the middleware must not break clients that do not send keys yet |
//! | `ttl` | 24 h | Stripe's retention: long enough for any sane retry schedule, short enough to purge |
//! | `lock_timeout` | 60 s | the lease: a crashed holder frees its key within a minute; renewed while the handler runs, so a slow handler is not taken over |
//! | `renew_lease_up_to` | 10 min | longer than any payment provider call with its retries, so a live handler keeps its key; short enough that a hung one frees it within minutes |
//! | `max_key_len` | 255 bytes | Stripe's limit; room for a UUID plus a prefix, small enough to index |
//! | `max_body_bytes` | 1 MiB | the body is buffered to fingerprint it; this bounds memory per request |
//! | `max_response_bytes` | 1 MiB | bigger responses are streamed through and not stored (released); at most the store's room for a response ([`IdempotencyStore::max_response_bytes`](crate::store::IdempotencyStore::max_response_bytes): `MemoryStore`'s `response_allowance`, also 1 MiB) |
//! | storage policy | 2xx only | a 4xx/5xx is released so the client can fix the cause and retry with the same key (Stripe) |
//! | `wait_for_in_flight` | off | a 409 with `Retry-After` is cheaper for the server than parking requests |
//! | `fail_open` | `false` | if the store is down, refusing (503) is safer than risking a double charge |
//! | tenant | none (global) | see [`IdempotencyBuilder::tenant`]: **set it** in a multi-tenant API |
//! | missing tenant | 400 `MISSING_TENANT` | once a tenant source is set, a keyed request without one must not share the global scope (C23); opt out with [`IdempotencyBuilder::missing_tenant_uses_global_scope`] |
//!
//! Durations saturate: `Duration::MAX` (or anything past the clock's range) means "as long as
//! the clock can count", never a panic while serving; only bounds that would make the contract
//! meaningless are refused when the middleware is built (`ttl` under [`MIN_TTL`], `lock_timeout`
//! under [`MIN_LOCK_TIMEOUT`], `retry_after` over [`MAX_RETRY_AFTER`], and `max_response_bytes`
//! above the store's room for a response). Header names are checked when the
//! middleware is built: [`IdempotencyBuilder::build`] panics with a message naming the bad value
//! (a configuration bug, found at startup), [`IdempotencyBuilder::try_build`] returns it instead.

use std::borrow::Cow;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::ServiceRequest;
use actix_web::http::header::{HeaderMap, HeaderName};
use actix_web::http::{Method, StatusCode};
use actix_web::HttpResponse;

use crate::outcome::{Hook, OutcomeEvent};
use crate::problem::{Problem, DEFAULT_TYPE_BASE};

/// A response as the storage predicate sees it.
#[derive(Debug)]
pub struct ResponseParts<'a> {
    /// Status of the handler's response.
    pub status: StatusCode,
    /// Its headers.
    pub headers: &'a HeaderMap,
    /// Its whole body (only complete bodies within `max_response_bytes` are offered).
    pub body: &'a [u8],
}

pub(crate) type TenantFn = dyn Fn(&ServiceRequest) -> Option<String> + Send + Sync;
pub(crate) type StatusFn = dyn Fn(StatusCode) -> bool + Send + Sync;
pub(crate) type StorePredicate = dyn Fn(&ResponseParts<'_>) -> bool + Send + Sync;
pub(crate) type ProblemRenderer = dyn Fn(&Problem) -> HttpResponse + Send + Sync;

/// The settled configuration, shared by all workers.
pub(crate) struct Config {
    pub header_name: HeaderName,
    pub methods: Vec<Method>,
    pub required: bool,
    pub ttl: Duration,
    pub lock_timeout: Duration,
    /// How long after the reservation the lease is renewed while the handler runs; zero: never.
    pub lease_renewal_limit: Duration,
    pub max_key_len: usize,
    pub max_body_bytes: usize,
    pub max_response_bytes: usize,
    pub tenant: Option<Arc<TenantFn>>,
    pub missing_tenant_uses_global_scope: bool,
    pub store_status: Arc<StatusFn>,
    pub store_if: Option<Arc<StorePredicate>>,
    pub wait_for_in_flight: Option<Duration>,
    pub fail_open: bool,
    pub deny_headers: Vec<HeaderName>,
    pub retry_after: Duration,
    pub problem_type_base: Cow<'static, str>,
    pub problem_renderer: Option<Arc<ProblemRenderer>>,
    pub on_outcome: Option<Arc<Hook>>,
    /// Transactional mode (C25): the PostgreSQL store and its settings, type-erased out of
    /// the store type so the flow stays generic.
    #[cfg(feature = "postgres")]
    pub transactional: Option<Arc<crate::middleware::TxConfig>>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            header_name: HeaderName::from_static("idempotency-key"),
            methods: vec![Method::POST, Method::PATCH],
            required: false,
            ttl: Duration::from_secs(24 * 60 * 60),
            lock_timeout: Duration::from_secs(60),
            lease_renewal_limit: Duration::from_secs(10 * 60),
            max_key_len: 255,
            max_body_bytes: 1024 * 1024,
            max_response_bytes: 1024 * 1024,
            tenant: None,
            missing_tenant_uses_global_scope: false,
            store_status: Arc::new(|status: StatusCode| status.is_success()),
            store_if: None,
            wait_for_in_flight: None,
            fail_open: false,
            deny_headers: Vec::new(),
            retry_after: Duration::from_secs(1),
            problem_type_base: Cow::Borrowed(DEFAULT_TYPE_BASE),
            problem_renderer: None,
            on_outcome: None,
            #[cfg(feature = "postgres")]
            transactional: None,
        }
    }
}

impl Config {
    /// What a request whose handler panicked leaves in the store, for the log line.
    pub(crate) fn what_a_panic_leaves(&self) -> &'static str {
        #[cfg(feature = "postgres")]
        if self.transactional.is_some() {
            return "its transaction (the handler's writes and the reservation) was rolled back";
        }
        if self.fail_open {
            // The line cannot tell which: a request fail_open let through with the store down
            // had no reservation (review, 2026-12-06: the line said it had one).
            return "its reservation, if the store gave it one, is left to its lease (the \
                    handler's effects may exist; with the store down, fail_open ran it without \
                    one)";
        }
        "its reservation is left to its lease (the handler's effects may exist)"
    }

    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    /// Whether a response with `status` is stored (`store_statuses`).
    pub(crate) fn stores_status(&self, status: StatusCode) -> bool {
        self.keeps("store_statuses", || (self.store_status)(status))
    }

    /// Whether `store_if` (if set) keeps this response.
    pub(crate) fn store_if_keeps(&self, parts: &ResponseParts<'_>) -> bool {
        match &self.store_if {
            Some(keep) => self.keeps("store_if", || keep(parts)),
            None => true,
        }
    }

    /// A user predicate on a finished handler's response. One that panics is the user's bug,
    /// caught like a panicking hook: the handler has run (a payment may have been made), so the
    /// response is kept, stored and replayed. Not storing it would release the key (or, in
    /// transactional mode, roll the handler's writes back while the client is told of a 500)
    /// and invite a second run.
    fn keeps(&self, setting: &'static str, predicate: impl FnOnce() -> bool) -> bool {
        catch_unwind(AssertUnwindSafe(predicate)).unwrap_or_else(|_| {
            tracing::error!(target: "idempotency_actix", setting, "a response predicate panicked after the handler ran; the response is stored");
            true
        })
    }

    /// The configured tenant source's answer for `req`, not yet checked for `""` (`Ok(None)`
    /// without a source). `Err(())` when the source panicked: the app's bug (an `unwrap` on a
    /// header the client left out), caught so that the client gets an answer rather than a
    /// reset connection; a keyed request is then refused, never given the global scope. At
    /// `warn`, as one line per request like the other refusals a client can cause.
    pub(crate) fn tenant_of(&self, req: &ServiceRequest) -> Result<Option<String>, ()> {
        let Some(source) = &self.tenant else {
            return Ok(None);
        };
        catch_unwind(AssertUnwindSafe(|| source(req))).map_err(|_| {
            tracing::warn!(target: "idempotency_actix", outcome = "missing_tenant", path = %crate::log_text::LogText(req.path()), "the tenant source panicked; taken as no tenant (a keyed request is refused)");
        })
    }

    pub(crate) fn problem(&self, mut problem: Problem) -> HttpResponse {
        problem.type_base = self.problem_type_base.clone();
        match &self.problem_renderer {
            Some(render) => {
                // A panicking renderer is the user's bug, like a panicking hook: caught, so the
                // client still gets the status, `Retry-After` and a problem document (the
                // default rendering), and the request is not taken for a handler panic.
                match catch_unwind(AssertUnwindSafe(|| render(&problem))) {
                    Ok(mut response) => {
                        problem.enforce_on(&mut response);
                        response
                    }
                    Err(_) => {
                        tracing::error!(target: "idempotency_actix", code = problem.code.as_str(), "the problem renderer panicked; answered with the default rendering");
                        problem.to_response()
                    }
                }
            }
            None => problem.to_response(),
        }
    }
}

/// `now + duration`, or the furthest instant the clock can represent: a configured "forever"
/// (`Duration::MAX`) must never panic while serving.
pub(crate) fn saturating_deadline(now: Instant, duration: Duration) -> Instant {
    now.checked_add(duration).unwrap_or_else(|| {
        // About 100 years; `Instant` ranges are platform-defined, so step down until it fits.
        let mut step = Duration::from_secs(100 * 365 * 24 * 3600);
        loop {
            if let Some(deadline) = now.checked_add(step) {
                return deadline;
            }
            step /= 2;
        }
    })
}

/// The shortest [`IdempotencyBuilder::lock_timeout`] accepted: the lease is renewed every
/// third of it while the handler runs, which needs a few milliseconds of store round trip and
/// timer slack to come before the lease ends.
pub const MIN_LOCK_TIMEOUT: Duration = Duration::from_millis(100);

/// The shortest [`IdempotencyBuilder::ttl`] accepted: 1 s. A zero TTL stores a response that
/// is expired as it is written, so a sequential retry runs the handler again; below a second
/// the stores round it differently (PostgreSQL to microseconds, Redis up to a millisecond), so
/// one store would replay what another runs again.
pub const MIN_TTL: Duration = Duration::from_secs(1);

/// The longest [`IdempotencyBuilder::retry_after`] accepted: one day. `Retry-After` tells a
/// client when to try again; a client that honours `Duration::MAX` (584 billion years) never
/// retries, and one that parses it into 32 bits fails.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);

/// A configuration value that cannot be used, found by [`IdempotencyBuilder::try_build`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    setting: &'static str,
    message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid Idempotency setting `{}`: {}",
            self.setting, self.message
        )
    }
}

impl std::error::Error for ConfigError {}

impl ConfigError {
    /// `max_response_bytes` above what the store is sure to have room for
    /// ([`IdempotencyStore::max_response_bytes`](crate::store::IdempotencyStore::max_response_bytes)).
    pub(crate) fn response_room(max: usize, room: usize) -> Self {
        ConfigError {
            setting: "max_response_bytes",
            message: format!(
                "{max} bytes is more than the store is sure to have room for ({room} bytes, its \
                 max_response_bytes; MemoryStore's response_allowance): a larger response could \
                 fail to be stored after its handler ran, and a retry after the lease would run \
                 it again; set .max_response_bytes({room}) or raise the store's room"
            ),
        }
    }
}

/// Builds an [`Idempotency`](crate::Idempotency) middleware; start with
/// [`Idempotency::builder`](crate::Idempotency::builder). `build()` is defined next to the
/// middleware ([`crate::middleware`]), so this module does not depend on it.
///
/// ```
/// use std::time::Duration;
/// use idempotency_actix::{store::MemoryStore, Idempotency};
///
/// let middleware = Idempotency::builder(MemoryStore::new())
///     .required(true)
///     .tenant_header("x-tenant-id")
///     .ttl(Duration::from_secs(7 * 24 * 3600))
///     .wait_for_in_flight(Duration::from_secs(5))
///     .build();
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct IdempotencyBuilder<S> {
    pub(crate) store: S,
    pub(crate) config: Config,
    pub(crate) errors: Vec<ConfigError>,
    #[cfg(feature = "postgres")]
    pub(crate) tx: Option<crate::middleware::TxConfig>,
}

impl<S> IdempotencyBuilder<S> {
    pub(crate) fn new(store: S) -> Self {
        Self {
            store,
            config: Config::default(),
            errors: Vec::new(),
            #[cfg(feature = "postgres")]
            tx: None,
        }
    }

    /// Parse a header name as people write it (`"Idempotency-Key"`, `"x-account-id"`, or a
    /// [`HeaderName`]); a bad one is remembered and reported by `build`/`try_build`.
    fn header(&mut self, setting: &'static str, name: impl IntoHeaderName) -> Option<HeaderName> {
        match name.into_header_name() {
            Ok(name) => Some(name),
            Err(message) => {
                self.errors.push(ConfigError { setting, message });
                None
            }
        }
    }

    /// The request header carrying the key. Default `Idempotency-Key`. Takes a `&str` in any
    /// case (`"Idempotency-Key"`) or a [`HeaderName`].
    pub fn header_name(mut self, name: impl IntoHeaderName) -> Self {
        if let Some(name) = self.header("header_name", name) {
            self.config.header_name = name;
        }
        self
    }

    /// The methods the middleware covers; others pass through untouched. Default POST, PATCH.
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.config.methods = methods.into_iter().collect();
        self
    }

    /// Answer 400 `MISSING_KEY` to covered requests without a key. Default `false`: they pass
    /// through, so the middleware can be added before every client sends keys.
    pub fn required(mut self, required: bool) -> Self {
        self.config.required = required;
        self
    }

    /// How long a completed response is replayed. Default 24 hours. After it, the key is free.
    /// `Duration::MAX` means as long as the store can keep it (each store caps it: PostgreSQL at
    /// about 100 years). At least [`MIN_TTL`] (1 s); `build` refuses a shorter one.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        if ttl < MIN_TTL {
            self.errors.push(ConfigError {
                setting: "ttl",
                message: format!(
                    "{ttl:?} is shorter than {MIN_TTL:?}: a response kept that briefly is not \
                     replayed, and a retry would run the handler again"
                ),
            });
            return self;
        }
        self.config.ttl = ttl;
        self
    }

    /// The lease of a reservation. Default 60 s. When it ends without a renewal (the process
    /// crashed, or the handler outlived [`renew_lease_up_to`](Self::renew_lease_up_to)), a
    /// retry of the same request takes the key over and runs the handler; the first holder's
    /// completion is then discarded (C9). While the handler runs, the lease is renewed every
    /// third of it, so a slow handler in a live process keeps its key. A shorter lease frees a
    /// crashed holder's key sooner and costs a renewal (one store write) per third of it for
    /// each handler still running.
    ///
    /// At least [`MIN_LOCK_TIMEOUT`] (100 ms); `build` refuses a shorter one: the lease is
    /// renewed every third of it, and below that a renewal cannot come in time, so a
    /// concurrent duplicate would take the key over and run while the first still runs.
    pub fn lock_timeout(mut self, lease: Duration) -> Self {
        if lease < MIN_LOCK_TIMEOUT {
            self.errors.push(ConfigError {
                setting: "lock_timeout",
                message: format!(
                    "{lease:?} is shorter than {MIN_LOCK_TIMEOUT:?}: a lease that short cannot be \
                     renewed while the handler runs, and a concurrent duplicate would run"
                ),
            });
            return self;
        }
        self.config.lock_timeout = lease;
        self
    }

    /// How long a running handler may keep its key by renewing its lease. Default 10 minutes.
    ///
    /// From the reservation on, while the handler runs, the middleware renews the lease
    /// ([`lock_timeout`](Self::lock_timeout)) every third of it, fenced by the reservation's
    /// token, so a retry never takes over a handler that is still running (C9): without it, a
    /// payment handler waiting longer than the lease for its provider would be run a second
    /// time by the client's retry. A renewal that fails is tried again after a tenth of that
    /// interval. A crashed process stops renewing, so its key is free one lease later, as
    /// before. Renewal ends `limit` after the reservation (after its confirmation, for one
    /// answered a third of a lease late: `docs/design.md`; the last lease ends then), so a
    /// handler that hangs frees its key too; a `limit` no longer than `lock_timeout` means no
    /// renewal at all, and `Duration::MAX` lets a hung handler keep its key for as long as its
    /// process lives.
    ///
    /// The handler's run, a streamed body's production and the storing of the response are
    /// covered. The store must answer the renewals: one that is down from just
    /// before a renewal is due for the rest of that lease (about two thirds of a lease) lets a
    /// retry take over, as without renewal (C16's window). A renewal that does not answer
    /// (stuck on one connection) does not hold up the next: it is sent beside it. In transactional
    /// mode the open transaction holds the key and needs no renewal; its idle limit
    /// (`idle_in_transaction_session_timeout`) is this `limit`, or `lock_timeout` if longer.
    /// `Duration::ZERO` turns renewal off (a handler longer than the lease can then be taken
    /// over); so does a store whose
    /// [`renews_leases`](crate::store::IdempotencyStore::renews_leases) is `false`.
    pub fn renew_lease_up_to(mut self, limit: Duration) -> Self {
        self.config.lease_renewal_limit = limit;
        self
    }

    /// Longest accepted key in bytes. Default 255.
    pub fn max_key_len(mut self, max: usize) -> Self {
        self.config.max_key_len = max;
        self
    }

    /// Largest request body buffered for the fingerprint; larger bodies get 413. Default 1 MiB.
    /// In transactional mode (`transactional()`, PostgreSQL) it bounds keyless bodies too:
    /// every body is read whole before its transaction takes a pooled connection.
    pub fn max_body_bytes(mut self, max: usize) -> Self {
        self.config.max_body_bytes = max;
        self
    }

    /// Largest response that is stored; larger ones are passed through unbuffered and the key is
    /// released. Default 1 MiB. `build` refuses a limit above what the store is sure to have
    /// room for (`MemoryStore`'s `response_allowance`, also 1 MiB by default: raise both
    /// together). In transactional mode a storable response over the limit cannot
    /// be sent without being stored: the transaction is rolled back and the client gets 500
    /// `RESPONSE_TOO_LARGE` (`docs/transactional.md`).
    pub fn max_response_bytes(mut self, max: usize) -> Self {
        self.config.max_response_bytes = max;
        self
    }

    /// Take the tenant from a request header (set by your gateway or auth layer, never by the
    /// client itself). Takes a `&str` in any case (`"X-Account-Id"`) or a [`HeaderName`]. A
    /// missing or empty header is no tenant: see [`tenant`](Self::tenant).
    ///
    /// A header sent more than once is no tenant either: a gateway that appends its value
    /// after one the client sent, instead of replacing it, would otherwise let the client
    /// choose the tenant (the first value is the client's) and replay another tenant's records.
    /// Such a request gets 400 `MISSING_TENANT`, unless
    /// [`missing_tenant_uses_global_scope`](Self::missing_tenant_uses_global_scope) is on: then
    /// it is treated like a missing tenant (global scope), which exposes nothing new, since with
    /// that opt-in a client can always omit the header.
    pub fn tenant_header(mut self, name: impl IntoHeaderName) -> Self {
        let Some(name) = self.header("tenant_header", name) else {
            return self;
        };
        self.tenant(move |req: &ServiceRequest| {
            let mut values = req.headers().get_all(&name);
            match (values.next(), values.next()) {
                (Some(value), None) => Some(tenant_from_bytes(value.as_bytes())),
                _ => None,
            }
        })
    }

    /// Derive the tenant of a request, e.g. from an authenticated principal in the request's
    /// extensions. Records are scoped by (tenant, method, path, key).
    ///
    /// The principal must be there when this middleware runs: `.wrap()` your auth middleware
    /// *after* `Idempotency` (actix applies the last `wrap` outermost, so it runs first).
    /// Wrapped inside it, auth has not run yet and every keyed request gets 400
    /// `MISSING_TENANT`.
    ///
    /// **Without a tenant source (this or `tenant_header`), the scope is global**: two
    /// customers who happen to send the same key to the same path share one record, and the
    /// second gets the first one's response (or a 422). Random UUID keys make that unlikely, but
    /// "unlikely" is not a guarantee you want for someone else's payment receipt. Any API with
    /// more than one customer should set this.
    ///
    /// When the source returns `None` or `""` for a keyed request, the request gets 400
    /// `MISSING_TENANT` and the handler does not run (C23); it uses the global scope only with
    /// [`missing_tenant_uses_global_scope(true)`](Self::missing_tenant_uses_global_scope).
    pub fn tenant<F>(mut self, tenant: F) -> Self
    where
        F: Fn(&ServiceRequest) -> Option<String> + Send + Sync + 'static,
    {
        self.config.tenant = Some(Arc::new(tenant));
        self
    }

    /// Let keyed requests without a tenant use the global scope (tenant `""`) instead of
    /// answering 400 `MISSING_TENANT`. Default `false`: every request without a tenant would
    /// share one scope, so two customers could replay each other's responses. Turn it on only
    /// while migrating clients that do not send a tenant yet.
    pub fn missing_tenant_uses_global_scope(mut self, allow: bool) -> Self {
        self.config.missing_tenant_uses_global_scope = allow;
        self
    }

    /// Which statuses are stored; others release the key so the client can retry. Default: 2xx.
    ///
    /// ```
    /// # use idempotency_actix::{store::MemoryStore, Idempotency};
    /// // Also replay 4xx validation errors, as some APIs do; never a 5xx.
    /// let m = Idempotency::builder(MemoryStore::new())
    ///     .store_statuses(|status| status.is_success() || status.is_client_error())
    ///     .build();
    /// ```
    pub fn store_statuses<F>(mut self, filter: F) -> Self
    where
        F: Fn(StatusCode) -> bool + Send + Sync + 'static,
    {
        self.config.store_status = Arc::new(filter);
        self
    }

    /// A further condition over the whole response; both it and the status filter must agree.
    /// A predicate (this one or the status filter) that panics is caught: the handler has run,
    /// so the response is stored, and an error is logged.
    ///
    /// Example: a 200 whose JSON body reports `"status": "partial"` or `"failed"` is not a
    /// final answer, so it is not stored and the client may retry with the same key.
    ///
    /// ```
    /// # use idempotency_actix::{store::MemoryStore, Idempotency};
    /// let m = Idempotency::builder(MemoryStore::new())
    ///     .store_if(|response| {
    ///         let status = serde_json::from_slice::<serde_json::Value>(response.body)
    ///             .ok()
    ///             .and_then(|json| json.get("status")?.as_str().map(str::to_owned));
    ///         !matches!(status.as_deref(), Some("partial" | "failed"))
    ///     })
    ///     .build();
    /// ```
    pub fn store_if<F>(mut self, predicate: F) -> Self
    where
        F: Fn(&ResponseParts<'_>) -> bool + Send + Sync + 'static,
    {
        self.config.store_if = Some(Arc::new(predicate));
        self
    }

    /// Instead of answering 409 at once, wait up to `wait` for the first request to finish and
    /// replay its response (or, if it was released, run this one). Default: off.
    /// `Duration::MAX` waits as long as the first request holds the key (its lease, renewed
    /// up to [`renew_lease_up_to`](Self::renew_lease_up_to), bounds it). A waiting request
    /// whose client disconnects stops waiting and runs nothing.
    ///
    /// **Serve wait mode with `HttpServer::h1_allow_half_closed(false)`.** actix-web only tells
    /// the middleware that a client left when it drops the request, which it does on a reset;
    /// by default it keeps serving a request whose client closed its side normally (a FIN,
    /// what most HTTP clients send when their own timeout fires), so such a waiter keeps
    /// waiting and, once the first request's key is released, runs the handler for nobody:
    /// a second charge if the client retried with a new key meanwhile. With half-closed
    /// connections refused, a FIN ends the request like a reset. Requests that do not wait
    /// are unaffected either way: their work is detached (C21). On HTTP/2 a reset stream
    /// (`RST_STREAM`) or a lost connection is seen through the request's body stream (actix
    /// never drops an HTTP/2 request's future), checked at every turn of the wait and right
    /// after the key is won.
    pub fn wait_for_in_flight(mut self, wait: Duration) -> Self {
        self.config.wait_for_in_flight = Some(wait).filter(|w| !w.is_zero());
        self
    }

    /// When the store is unavailable before the handler runs, run the request anyway (without
    /// idempotency) instead of answering 503. Default `false`: for payments, refusing is safer.
    /// Never for a request the store already said is in flight (a waiting duplicate), nor for
    /// a [`StoreError::Backend`](crate::store::StoreError::Backend) error, which may be about
    /// the request itself (a value a custom store cannot record) and so chosen by a client.
    /// (A scope longer than the store declares it can record never reaches it: 400
    /// `SCOPE_TOO_LONG`, [`IdempotencyStore::max_scope_bytes`](crate::store::IdempotencyStore::max_scope_bytes).)
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.config.fail_open = fail_open;
        self
    }

    /// More response headers never to store or replay, on top of `Set-Cookie`, `Date` and the
    /// hop-by-hop and framing headers that are always dropped.
    pub fn deny_headers<N: IntoHeaderName>(mut self, names: impl IntoIterator<Item = N>) -> Self {
        for name in names {
            if let Some(name) = self.header("deny_headers", name) {
                self.config.deny_headers.push(name);
            }
        }
        self
    }

    /// `Retry-After` of 409 and 503 answers. Default 1 s. Sent in whole seconds, at least 1;
    /// at most [`MAX_RETRY_AFTER`] (one day), `build` refuses a longer one.
    pub fn retry_after(mut self, retry_after: Duration) -> Self {
        if retry_after > MAX_RETRY_AFTER {
            self.errors.push(ConfigError {
                setting: "retry_after",
                message: format!(
                    "{retry_after:?} is longer than {MAX_RETRY_AFTER:?}: a client that honours it \
                     would not retry for that long"
                ),
            });
            return self;
        }
        self.config.retry_after = retry_after;
        self
    }

    /// Base of the problem `type` URIs (the slug is appended), e.g.
    /// `https://api.example.com/problems/`. Default: this crate's docs.
    pub fn problem_type_base(mut self, base: impl Into<Cow<'static, str>>) -> Self {
        self.config.problem_type_base = base.into();
        self
    }

    /// Render problems yourself. The status and `Retry-After` are set again afterwards; a
    /// renderer that panics is caught and the default rendering is used (and an error logged).
    pub fn problem_renderer<F>(mut self, render: F) -> Self
    where
        F: Fn(&Problem) -> HttpResponse + Send + Sync + 'static,
    {
        self.config.problem_renderer = Some(Arc::new(render));
        self
    }

    /// Call `hook` with every outcome (the scope when there is one, the outcome, the status and
    /// the time taken), e.g. to feed an audit log or billing. Called synchronously on the
    /// request's task: keep it cheap and hand real work off (a channel). A panicking hook is
    /// caught and logged and never breaks the request (except under `panic = "abort"`). See
    /// [`crate::outcome`] for the metrics recorded without any hook.
    pub fn on_outcome<F>(mut self, hook: F) -> Self
    where
        F: Fn(&OutcomeEvent<'_>) + Send + Sync + 'static,
    {
        self.config.on_outcome = Some(Arc::new(hook));
        self
    }
}

/// Transactional mode (C25): only with the PostgreSQL store. See `docs/transactional.md`.
#[cfg(feature = "postgres")]
impl IdempotencyBuilder<crate::store::PostgresStore> {
    /// Run each covered request in one PostgreSQL transaction that holds its idempotency record:
    /// the reservation, the handler's own writes (through the
    /// [`IdempotentTx`](crate::IdempotentTx) extractor) and the stored response commit
    /// together, with one COMMIT, or not at all.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use actix_web::{web, App, HttpResponse};
    /// use idempotency_actix::{store::PostgresStore, Idempotency, IdempotentTx};
    ///
    /// async fn create_payment(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
    ///     let mut conn = tx.conn(); // this request's transaction
    ///     // diesel::insert_into(payments::table)...execute(&mut *conn).await?;
    ///     # let _ = &mut *conn;
    ///     Ok(HttpResponse::Created().finish())
    /// }
    ///
    /// let store = PostgresStore::connect("postgres://app@db/app").await?;
    /// let app = App::new()
    ///     .wrap(Idempotency::builder(store.clone()).tenant_header("x-account-id").transactional().build())
    ///     .route("/payments", web::post().to(create_payment));
    /// # let _ = app; Ok(()) }
    /// ```
    ///
    /// What changes, in short (the details are in `docs/transactional.md`):
    /// - **a response that is not stored rolls back the handler's writes too**: a 4xx (with the
    ///   default status filter), a `store_if` refusal, a handler error. A retry starts clean;
    /// - the response is buffered up to `max_response_bytes` and sent only after COMMIT; a
    ///   storable response over the limit is rolled back and answered with
    ///   `RESPONSE_TOO_LARGE` (500), so raise the limit on routes with large responses;
    /// - a failed COMMIT answers `COMMIT_FAILED` (503, nothing done), a connection lost during
    ///   COMMIT `COMMIT_OUTCOME_UNKNOWN` (503); never the handler's response. Both say a retry
    ///   with the same key is safe;
    /// - a concurrent duplicate gets 409 at once (or waits with `wait_for_in_flight`), never
    ///   blocked behind the open transaction; a different body gets 409 (not 422) until the
    ///   first commits;
    /// - each request holds a pool connection while its handler runs: size the pool for your
    ///   concurrency; an exhausted pool answers 503 within the connection timeout, the handler
    ///   not run. `fail_open` does not apply (the handler needs its transaction);
    /// - with a tenant source, the tenant is set on the transaction
    ///   ([`tenant_setting`](Self::tenant_setting)) for row-level security.
    ///
    /// Effects outside this database (a call to a payment provider) are outside the guarantee:
    /// pass the Idempotency-Key on to the provider.
    pub fn transactional(mut self) -> Self {
        if self.tx.is_none() {
            self.tx = Some(crate::middleware::TxConfig::new(self.store.clone()));
        }
        self
    }

    fn tx_setting(&mut self, setting: &'static str) -> Option<&mut crate::middleware::TxConfig> {
        if self.tx.is_none() {
            self.errors.push(ConfigError {
                setting,
                message: "only applies in transactional mode: call `transactional()` first"
                    .to_owned(),
            });
        }
        self.tx.as_mut()
    }

    /// The transaction-local setting that carries the tenant (`set_config(name, tenant, true)`
    /// before the handler runs), for row-level security policies such as
    /// `USING (tenant_id = current_setting('app.tenant_id'))`. Default `app.tenant_id`. Set only
    /// when a tenant source is configured. A custom setting name needs a dot
    /// (`prefix.name`); others are refused by `build`.
    pub fn tenant_setting(mut self, name: impl Into<String>) -> Self {
        let name = name.into();
        let valid = name.contains('.')
            && !name.starts_with('.')
            && !name.ends_with('.')
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if !valid {
            self.errors.push(ConfigError {
                setting: "tenant_setting",
                message: format!(
                    "{name:?} is not a custom setting name (letters, digits, `_`, with a dot: `app.tenant_id`)"
                ),
            });
            return self;
        }
        if let Some(tx) = self.tx_setting("tenant_setting") {
            tx.tenant_setting = name;
        }
        self
    }

    /// The isolation level of the request's transaction. Default
    /// [`IsolationLevel::DatabaseDefault`](crate::store::postgres::IsolationLevel::DatabaseDefault):
    /// the database's `default_transaction_isolation` (`READ COMMITTED` unless changed).
    pub fn isolation_level(mut self, level: crate::store::postgres::IsolationLevel) -> Self {
        if let Some(tx) = self.tx_setting("isolation_level") {
            tx.isolation = level;
        }
        self
    }

    /// Run a keyed request again, up to `retries` more times, when its transaction fails with a
    /// serialization failure (SQLSTATE 40001, under `REPEATABLE READ` and `SERIALIZABLE`): at
    /// COMMIT, at the response's write, or at one of the handler's own statements that
    /// diesel-async reports on the connection (`execute`, `batch_execute`; not a row-returning
    /// statement's failure, which comes in its row stream and stays the handler's error; seen through
    /// diesel instrumentation on the connection: the store's own connections carry it next to
    /// diesel's default instrumentation; a connection from a pool the app built gets it in
    /// place of that connection's own instrumentation, forwarding to diesel's default one). Default 0: the client gets `COMMIT_FAILED` (or the
    /// handler's own error) and retries itself, which is safe. A keyless request is not run
    /// again: it gets `COMMIT_FAILED` (nothing was done) and its client retries.
    ///
    /// **This re-runs the handler**, inside the middleware, with the same request: its
    /// database writes were rolled back, but any effect outside the database (an HTTP call, an
    /// email, a message on a queue) happens once per run. Turn it on only for handlers whose
    /// only effects are in this database, or that pass an idempotency key downstream.
    ///
    /// A request whose handler keeps a copy of its `HttpRequest` past its return (on a spawned
    /// task) cannot be routed again: it gets `COMMIT_FAILED` instead of a re-run (actix's
    /// panic on the shared request is caught; its message still reaches the panic hook).
    pub fn retry_serialization_failures(mut self, retries: u32) -> Self {
        if let Some(tx) = self.tx_setting("retry_serialization_failures") {
            tx.serialization_retries = retries;
        }
        self
    }
}

/// What the header-name settings accept: a `&str` or `String` in any case, or a [`HeaderName`].
pub trait IntoHeaderName {
    /// The header name, or why it is not one.
    fn into_header_name(self) -> Result<HeaderName, String>;
}

impl IntoHeaderName for HeaderName {
    fn into_header_name(self) -> Result<HeaderName, String> {
        Ok(self)
    }
}

impl IntoHeaderName for &HeaderName {
    fn into_header_name(self) -> Result<HeaderName, String> {
        Ok(self.clone())
    }
}

impl IntoHeaderName for &str {
    fn into_header_name(self) -> Result<HeaderName, String> {
        // `from_bytes` lower-cases, so "X-Account-Id" works (unlike `from_static`, which panics).
        HeaderName::from_bytes(self.as_bytes())
            .map_err(|_| format!("{self:?} is not a valid HTTP header name"))
    }
}

impl IntoHeaderName for String {
    fn into_header_name(self) -> Result<HeaderName, String> {
        self.as_str().into_header_name()
    }
}

/// A tenant header value as a string. Non-UTF-8 values are hex-encoded behind a control
/// character that a valid header value can never contain, so no two values share a tenant.
pub(crate) fn tenant_from_bytes(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.to_owned(),
        Err(_) => {
            let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
            format!("\u{1}{hex}")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use actix_web::http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
    use actix_web::test::{call_service, init_service, read_body, TestRequest};
    use actix_web::{web, App};

    use super::*;

    /// The panic line never claims a reservation a fail_open request did not have.
    #[test]
    fn what_a_panic_leaves_allows_for_fail_open() {
        let strict = Config::default();
        assert!(!strict.what_a_panic_leaves().contains("fail_open"));
        let open = Config {
            fail_open: true,
            ..Config::default()
        };
        assert!(open
            .what_a_panic_leaves()
            .contains("if the store gave it one"));
    }
    use crate::problem::ProblemCode;
    use crate::store::MemoryStore;
    use crate::Idempotency;

    fn builder() -> IdempotencyBuilder<MemoryStore> {
        Idempotency::builder(MemoryStore::new())
    }

    fn error_of(builder: IdempotencyBuilder<MemoryStore>) -> ConfigError {
        match builder.try_build() {
            Ok(_) => panic!("an invalid setting was accepted"),
            Err(error) => error,
        }
    }

    /// A lease too short to be renewed while the handler runs is refused, not accepted
    /// silently (a review found `lock_timeout(1 ms)` letting a concurrent duplicate run while
    /// the first still ran: renewal is skipped for such leases).
    #[test]
    fn a_lease_too_short_to_renew_is_refused() {
        for lease in [
            Duration::ZERO,
            Duration::from_millis(1),
            Duration::from_millis(99),
        ] {
            let error = error_of(builder().lock_timeout(lease));
            assert!(error.to_string().contains("`lock_timeout`"), "{error}");
        }
        assert!(builder().lock_timeout(MIN_LOCK_TIMEOUT).try_build().is_ok());
    }

    /// A response the store may have no room for is found only after its handler ran: the key
    /// then stays reserved until the lease ends and a retry runs the handler again. So a
    /// `max_response_bytes` above the memory store's response allowance (also through a
    /// `CachedStore`) is refused when the app is built.
    #[test]
    fn a_response_limit_above_the_stores_room_is_refused() {
        let error = error_of(builder().max_response_bytes(1024 * 1024 + 1));
        assert!(
            error.to_string().contains("`max_response_bytes`"),
            "{error}"
        );
        assert!(error.to_string().contains("1048576 bytes"), "{error}");
        assert!(builder()
            .max_response_bytes(1024 * 1024)
            .try_build()
            .is_ok());
        let small = || MemoryStore::builder().response_allowance(4096).build();
        let over = Idempotency::builder(small()).max_response_bytes(4097);
        assert!(error_of(over).to_string().contains("4096 bytes"));
    }

    #[cfg(feature = "cached")]
    #[test]
    fn a_caching_store_declares_its_stores_room() {
        let small = || MemoryStore::builder().response_allowance(4096).build();
        let cached = crate::store::CachedStore::new(small());
        let over = Idempotency::builder(cached.clone()).max_response_bytes(4097);
        assert!(
            over.try_build().is_err(),
            "the cache hides its store's room"
        );
        assert!(Idempotency::builder(cached)
            .max_response_bytes(4096)
            .try_build()
            .is_ok());
    }

    #[test]
    fn a_ttl_too_short_to_replay_and_an_endless_retry_after_are_refused() {
        for ttl in [
            Duration::ZERO,
            Duration::from_nanos(1),
            MIN_TTL - Duration::from_nanos(1),
        ] {
            let error = builder().ttl(ttl).try_build().err().expect("refused");
            assert!(error.to_string().contains("`ttl`"), "{error}");
        }
        assert!(builder().ttl(MIN_TTL).try_build().is_ok());
        let error = builder()
            .retry_after(Duration::MAX)
            .try_build()
            .err()
            .expect("refused");
        assert!(error.to_string().contains("`retry_after`"), "{error}");
        assert!(builder().retry_after(MAX_RETRY_AFTER).try_build().is_ok());
    }

    fn tenant_of(config: &Config, req: &ServiceRequest) -> Option<String> {
        config.tenant.as_ref().and_then(|tenant| tenant(req))
    }

    #[test]
    fn the_defaults_are_the_documented_ones() {
        let config = builder().config;
        assert_eq!(config.header_name, "idempotency-key");
        assert_eq!(config.methods, vec![Method::POST, Method::PATCH]);
        assert!(!config.required);
        assert_eq!(config.ttl, Duration::from_secs(24 * 3600));
        assert_eq!(config.lock_timeout, Duration::from_secs(60));
        assert_eq!(config.lease_renewal_limit, Duration::from_secs(600));
        assert_eq!(config.max_key_len, 255);
        assert_eq!(config.max_body_bytes, 1024 * 1024);
        assert_eq!(config.max_response_bytes, 1024 * 1024);
        assert!(config.tenant.is_none());
        assert!(!config.missing_tenant_uses_global_scope);
        for (status, stored) in [
            (200, true),
            (201, true),
            (204, true),
            (299, true),
            (301, false),
            (400, false),
            (409, false),
            (500, false),
            (503, false),
        ] {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::IM_A_TEAPOT);
            assert_eq!((config.store_status)(status), stored, "{status}");
        }
        assert!(config.store_if.is_none());
        assert_eq!(config.wait_for_in_flight, None);
        assert!(!config.fail_open);
        assert!(config.deny_headers.is_empty());
        assert_eq!(config.retry_after, Duration::from_secs(1));
        assert_eq!(config.problem_type_base, DEFAULT_TYPE_BASE);
        assert!(config.problem_renderer.is_none());
        assert!(config.on_outcome.is_none());
        #[cfg(feature = "postgres")]
        assert!(config.transactional.is_none());
        assert!(config.covers(&Method::POST) && config.covers(&Method::PATCH));
        for method in [Method::GET, Method::PUT, Method::DELETE, Method::HEAD] {
            assert!(!config.covers(&method), "{method}");
        }
        assert!(builder().try_build().is_ok());
    }

    #[test]
    fn every_setter_sets_its_value() {
        let hooked = Arc::new(AtomicUsize::new(0));
        let hook_count = Arc::clone(&hooked);
        let b = builder()
            .header_name("X-Request-Key")
            .methods([Method::PUT, Method::DELETE])
            .required(true)
            .ttl(Duration::from_secs(7))
            .lock_timeout(Duration::from_secs(8))
            .max_key_len(9)
            .max_body_bytes(10)
            .max_response_bytes(11)
            .missing_tenant_uses_global_scope(true)
            .store_statuses(|status| status.is_client_error())
            .store_if(|response| response.body == b"keep")
            .wait_for_in_flight(Duration::from_secs(12))
            .fail_open(true)
            .deny_headers(["X-Internal", "x-trace"])
            .retry_after(Duration::from_secs(13))
            .problem_type_base("https://api.example.com/problems/")
            .problem_renderer(|problem| HttpResponse::Ok().body(problem.detail.clone()))
            .on_outcome(move |_| {
                hook_count.fetch_add(1, Ordering::SeqCst);
            });
        assert!(b.errors.is_empty(), "{:?}", b.errors);
        let config = &b.config;
        assert_eq!(config.header_name, "x-request-key", "names are lower-cased");
        assert_eq!(config.methods, vec![Method::PUT, Method::DELETE]);
        assert!(config.covers(&Method::PUT) && !config.covers(&Method::POST));
        assert!(config.required);
        assert_eq!(config.ttl, Duration::from_secs(7));
        assert_eq!(config.lock_timeout, Duration::from_secs(8));
        assert_eq!(config.max_key_len, 9);
        assert_eq!(config.max_body_bytes, 10);
        assert_eq!(config.max_response_bytes, 11);
        assert!(config.missing_tenant_uses_global_scope);
        assert!((config.store_status)(StatusCode::NOT_FOUND));
        assert!(!(config.store_status)(StatusCode::OK));
        let headers = HeaderMap::new();
        let parts = |body: &'static [u8]| ResponseParts {
            status: StatusCode::OK,
            headers: &headers,
            body,
        };
        let store_if = config.store_if.as_ref().map(Arc::clone);
        assert_eq!(store_if.as_ref().map(|f| f(&parts(b"keep"))), Some(true));
        assert_eq!(store_if.as_ref().map(|f| f(&parts(b"drop"))), Some(false));
        assert_eq!(config.wait_for_in_flight, Some(Duration::from_secs(12)));
        assert!(config.fail_open);
        assert_eq!(config.deny_headers, vec!["x-internal", "x-trace"]);
        assert_eq!(config.retry_after, Duration::from_secs(13));
        assert_eq!(
            config.problem_type_base,
            "https://api.example.com/problems/"
        );
        assert!(config.problem_renderer.is_some());
        let event = OutcomeEvent {
            scope: None,
            outcome: crate::Outcome::Replay,
            status: StatusCode::OK,
            elapsed: Duration::ZERO,
        };
        if let Some(hook) = &config.on_outcome {
            hook(&event);
        }
        assert_eq!(
            hooked.load(Ordering::SeqCst),
            1,
            "the hook is the one given"
        );
        let debug = format!("{:?}", parts(b"x"));
        assert!(
            debug.contains("ResponseParts") && debug.contains("200"),
            "{debug}"
        );
    }

    #[test]
    fn header_names_are_taken_in_every_form() {
        let name = HeaderName::from_static("x-key");
        for b in [
            builder().header_name("X-Key"),
            builder().header_name(String::from("x-KEY")),
            builder().header_name(name.clone()),
            builder().header_name(&name),
        ] {
            assert!(b.errors.is_empty());
            assert_eq!(b.config.header_name, name);
        }
        assert_eq!("X-Key".into_header_name(), Ok(name.clone()));
        assert_eq!(
            "bad name".into_header_name(),
            Err("\"bad name\" is not a valid HTTP header name".to_owned())
        );
        assert_eq!(
            String::new().into_header_name(),
            Err("\"\" is not a valid HTTP header name".to_owned())
        );
    }

    #[test]
    fn a_bad_header_name_is_reported_by_try_build_naming_setting_and_value() {
        let b = builder().header_name("X-Good").header_name("not a header");
        // The bad value does not replace the last good one.
        assert_eq!(b.config.header_name, "x-good");
        let error = error_of(b);
        assert_eq!(
            error.to_string(),
            "invalid Idempotency setting `header_name`: \"not a header\" is not a valid HTTP header name"
        );
        let as_error: &dyn std::error::Error = &error;
        assert!(as_error.source().is_none());
        assert_eq!(error.clone(), error);

        let error = error_of(builder().tenant_header("x tenant"));
        assert_eq!(
            error.to_string(),
            "invalid Idempotency setting `tenant_header`: \"x tenant\" is not a valid HTTP header name"
        );
        let b = builder().tenant_header("x\ntenant");
        assert!(
            b.config.tenant.is_none(),
            "no tenant source from a bad name"
        );

        // deny_headers keeps the good names and reports the bad one.
        let b = builder().deny_headers(["x-a", "b@d", "X-C"]);
        assert_eq!(b.config.deny_headers, vec!["x-a", "x-c"]);
        assert_eq!(
            error_of(b).to_string(),
            "invalid Idempotency setting `deny_headers`: \"b@d\" is not a valid HTTP header name"
        );
    }

    #[test]
    fn the_first_bad_setting_is_the_one_reported() {
        let error = error_of(
            builder()
                .tenant_header("first bad")
                .header_name("second bad")
                .deny_headers(["third bad"]),
        );
        assert!(error.to_string().contains("`tenant_header`"), "{error}");
        assert!(error.to_string().contains("first bad"), "{error}");
    }

    #[test]
    #[should_panic(
        expected = "invalid Idempotency setting `header_name`: \"bad key\" is not a valid HTTP header name"
    )]
    fn build_panics_with_the_message_of_try_build() {
        let _ = builder().header_name("bad key").build();
    }

    #[test]
    fn the_tenant_header_is_read_as_given_and_non_utf8_is_kept_apart() {
        let config = builder().tenant_header("X-Account-Id").config;
        let req = TestRequest::default()
            .insert_header(("x-account-id", "acct_1"))
            .to_srv_request();
        assert_eq!(tenant_of(&config, &req), Some("acct_1".to_owned()));
        let req = TestRequest::default().to_srv_request();
        assert_eq!(
            tenant_of(&config, &req),
            None,
            "a missing header is no tenant"
        );
        let req = TestRequest::default()
            .insert_header(("x-account-id", ""))
            .to_srv_request();
        assert_eq!(tenant_of(&config, &req), Some(String::new()));
        let raw = HeaderValue::from_bytes(b"caf\xe9").unwrap_or(HeaderValue::from_static("x"));
        let req = TestRequest::default()
            .insert_header(("x-account-id", raw))
            .to_srv_request();
        assert_eq!(tenant_of(&config, &req), Some("\u{1}636166e9".to_owned()));

        // A closure source is used as given.
        let config = builder()
            .tenant(|req: &ServiceRequest| Some(req.path().to_owned()))
            .config;
        let req = TestRequest::default().uri("/t/1").to_srv_request();
        assert_eq!(tenant_of(&config, &req), Some("/t/1".to_owned()));
    }

    #[test]
    fn tenant_bytes_never_collide() {
        assert_eq!(tenant_from_bytes(b"acct_1"), "acct_1");
        assert_eq!(tenant_from_bytes(b""), "");
        assert_eq!(tenant_from_bytes(b"\xff\x00"), "\u{1}ff00");
        // The hex form of one value is not the text of another header value: its marker is
        // a control character, which no valid header value contains.
        assert_ne!(tenant_from_bytes(b"\xff"), tenant_from_bytes(b"ff"));
        assert!(HeaderValue::from_bytes(b"\x01ff").is_err());
        assert!(HeaderValue::from_bytes(b"\xff").is_ok());
    }

    #[test]
    fn a_zero_wait_is_no_wait_and_durations_may_be_unbounded() {
        let config = builder().wait_for_in_flight(Duration::ZERO).config;
        assert_eq!(config.wait_for_in_flight, None);
        let config = builder()
            .wait_for_in_flight(Duration::from_secs(5))
            .wait_for_in_flight(Duration::ZERO)
            .config;
        assert_eq!(
            config.wait_for_in_flight, None,
            "zero turns a wait off again"
        );
        let config = builder()
            .wait_for_in_flight(Duration::MAX)
            .ttl(Duration::MAX)
            .lock_timeout(Duration::MAX)
            .retry_after(MAX_RETRY_AFTER)
            .config;
        assert_eq!(config.wait_for_in_flight, Some(Duration::MAX));
        assert_eq!(config.ttl, Duration::MAX);
        assert_eq!(config.lock_timeout, Duration::MAX);
    }

    #[test]
    fn deadlines_saturate_instead_of_panicking() {
        let now = Instant::now();
        assert_eq!(
            saturating_deadline(now, Duration::from_secs(5)),
            now + Duration::from_secs(5)
        );
        assert_eq!(saturating_deadline(now, Duration::ZERO), now);
        for huge in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            let deadline = saturating_deadline(now, huge);
            // "As long as the clock can count": decades at least.
            assert!(
                deadline.duration_since(now) >= Duration::from_secs(50 * 365 * 24 * 3600),
                "{:?}",
                deadline.duration_since(now)
            );
        }
    }

    #[actix_web::test]
    async fn problems_use_the_type_base_and_a_renderer_cannot_lose_the_status() {
        let config = builder().problem_type_base("https://x.test/p/").config;
        let response = config.problem(Problem::new(ProblemCode::MissingKey, "none"));
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let body = actix_web::body::to_bytes(response.into_body())
            .await
            .unwrap_or_default();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(json["type"], "https://x.test/p/missing-key");

        let config = builder()
            .problem_type_base("https://x.test/p/")
            .problem_renderer(|problem| {
                HttpResponse::Ok()
                    .insert_header((CONTENT_TYPE, "text/plain"))
                    .body(format!("{} at {}", problem.code, problem.type_uri()))
            })
            .config;
        let response = config.problem(
            Problem::new(ProblemCode::Conflict, "busy").with_retry_after(Duration::from_secs(4)),
        );
        assert_eq!(response.status(), StatusCode::CONFLICT, "status re-applied");
        assert_eq!(
            response
                .headers()
                .get(RETRY_AFTER)
                .map(HeaderValue::as_bytes),
            Some(&b"4"[..]),
            "Retry-After re-applied"
        );
        let body = actix_web::body::to_bytes(response.into_body())
            .await
            .unwrap_or_default();
        assert_eq!(body, "CONFLICT at https://x.test/p/conflict");
    }

    /// No value of any numeric setting panics while serving: the extremes, through the
    /// middleware on the memory store.
    #[actix_web::test]
    async fn extreme_values_serve_requests_without_panicking() {
        let runs = web::Data::new(AtomicUsize::new(0));
        let handler = |runs: web::Data<AtomicUsize>| async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            HttpResponse::Created().body(format!("run {n}"))
        };

        // Everything as large as it goes.
        let app = init_service(
            App::new()
                .app_data(runs.clone())
                .wrap(
                    Idempotency::builder(
                        // The store's response allowance bounds `max_response_bytes`.
                        MemoryStore::builder()
                            .max_bytes(usize::MAX)
                            .response_allowance(usize::MAX / 2)
                            .build(),
                    )
                    .ttl(Duration::MAX)
                    .lock_timeout(Duration::MAX)
                    .wait_for_in_flight(Duration::MAX)
                    .retry_after(MAX_RETRY_AFTER)
                    .max_key_len(usize::MAX)
                    .max_body_bytes(usize::MAX)
                    .max_response_bytes(usize::MAX / 2)
                    .build(),
                )
                .route("/", web::post().to(handler)),
        )
        .await;
        for _ in 0..2 {
            let req = TestRequest::post()
                .uri("/")
                .insert_header(("idempotency-key", "big"))
                .set_payload("body")
                .to_request();
            let response = call_service(&app, req).await;
            assert_eq!(response.status(), StatusCode::CREATED);
            assert_eq!(
                read_body(response).await,
                "run 1",
                "replayed, not run again"
            );
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);

        // Everything as small as it goes.
        let app = init_service(
            App::new()
                .app_data(runs.clone())
                .wrap(
                    builder()
                        .ttl(MIN_TTL)
                        .lock_timeout(MIN_LOCK_TIMEOUT)
                        .wait_for_in_flight(Duration::ZERO)
                        .retry_after(Duration::ZERO)
                        .max_key_len(0)
                        .max_body_bytes(0)
                        .max_response_bytes(0)
                        .build(),
                )
                .route("/", web::post().to(handler)),
        )
        .await;
        let req = TestRequest::post()
            .uri("/")
            .insert_header(("idempotency-key", "k"))
            .to_request();
        let response = call_service(&app, req).await;
        assert_eq!(
            response.status(),
            StatusCode::BAD_REQUEST,
            "every key is too long"
        );
        let body = read_body(response).await;
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
        assert_eq!(json["code"], "KEY_TOO_LONG");
        // Without a key the request passes through, whatever the limits.
        let req = TestRequest::post()
            .uri("/")
            .set_payload("body")
            .to_request();
        let response = call_service(&app, req).await;
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(runs.load(Ordering::SeqCst), 2);
    }

    #[actix_web::test]
    async fn a_zero_body_limit_refuses_any_keyed_body() {
        let app = init_service(App::new().wrap(builder().max_body_bytes(0).build()).route(
            "/",
            web::post().to(|| async { HttpResponse::Created().finish() }),
        ))
        .await;
        let req = TestRequest::post()
            .uri("/")
            .insert_header(("idempotency-key", "k"))
            .set_payload("x")
            .to_request();
        let response = call_service(&app, req).await;
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let req = TestRequest::post()
            .uri("/")
            .insert_header(("idempotency-key", "k2"))
            .to_request();
        let response = call_service(&app, req).await;
        assert_eq!(response.status(), StatusCode::CREATED, "an empty body fits");
    }

    #[cfg(feature = "postgres")]
    mod transactional {
        use super::*;
        use crate::store::postgres::IsolationLevel;
        use crate::store::PostgresStore;

        /// A store whose pool never connects (nothing listens on port 1): building the
        /// middleware needs no database.
        async fn store() -> PostgresStore {
            match PostgresStore::builder("postgres://app@127.0.0.1:1/app")
                .build()
                .await
            {
                Ok(store) => store,
                Err(e) => panic!("{e}"),
            }
        }

        fn error_of(builder: IdempotencyBuilder<PostgresStore>) -> ConfigError {
            match builder.try_build() {
                Ok(_) => panic!("an invalid setting was accepted"),
                Err(error) => error,
            }
        }

        #[tokio::test]
        async fn transactional_settings_are_applied() {
            let b = Idempotency::builder(store().await)
                .transactional()
                .tenant_setting("app.tenant_id2")
                .isolation_level(IsolationLevel::Serializable)
                .retry_serialization_failures(3)
                // A second call keeps the settings made so far.
                .transactional();
            assert!(b.errors.is_empty(), "{:?}", b.errors);
            let tx = b.tx.as_ref().map(|tx| {
                (
                    tx.tenant_setting.clone(),
                    tx.isolation,
                    tx.serialization_retries,
                )
            });
            assert_eq!(
                tx,
                Some(("app.tenant_id2".to_owned(), IsolationLevel::Serializable, 3))
            );
            assert!(b.try_build().is_ok());

            let b = Idempotency::builder(store().await).transactional();
            let tx = b.tx.as_ref().map(|tx| {
                (
                    tx.tenant_setting.clone(),
                    tx.isolation,
                    tx.serialization_retries,
                )
            });
            assert_eq!(
                tx,
                Some((
                    "app.tenant_id".to_owned(),
                    IsolationLevel::DatabaseDefault,
                    0
                ))
            );
            assert!(Idempotency::builder(store().await).tx.is_none());
        }

        #[tokio::test]
        async fn transactional_settings_need_transactional_mode() {
            for (b, setting) in [
                (
                    Idempotency::builder(store().await).tenant_setting("app.t"),
                    "tenant_setting",
                ),
                (
                    Idempotency::builder(store().await)
                        .isolation_level(IsolationLevel::RepeatableRead),
                    "isolation_level",
                ),
                (
                    Idempotency::builder(store().await).retry_serialization_failures(1),
                    "retry_serialization_failures",
                ),
            ] {
                assert_eq!(
                    error_of(b).to_string(),
                    format!(
                        "invalid Idempotency setting `{setting}`: only applies in \
                         transactional mode: call `transactional()` first"
                    )
                );
            }
        }

        #[tokio::test]
        async fn a_tenant_setting_must_be_a_custom_setting_name() {
            for bad in [
                "tenant_id",
                ".tenant",
                "app.",
                "",
                "app.tenant-id",
                "app.t id",
                "app.t;drop",
            ] {
                let b = Idempotency::builder(store().await)
                    .transactional()
                    .tenant_setting(bad);
                assert_eq!(
                    b.tx.as_ref().map(|tx| tx.tenant_setting.as_str()),
                    Some("app.tenant_id"),
                    "{bad:?} was applied"
                );
                assert_eq!(
                    error_of(b).to_string(),
                    format!(
                        "invalid Idempotency setting `tenant_setting`: {bad:?} is not a custom \
                         setting name (letters, digits, `_`, with a dot: `app.tenant_id`)"
                    )
                );
            }
            for good in ["a.b", "app.tenant_id", "my_app.v2.tenant"] {
                let b = Idempotency::builder(store().await)
                    .transactional()
                    .tenant_setting(good);
                assert!(b.errors.is_empty(), "{good:?} refused");
                assert_eq!(
                    b.tx.as_ref().map(|tx| tx.tenant_setting.as_str()),
                    Some(good)
                );
            }
        }
    }
}
