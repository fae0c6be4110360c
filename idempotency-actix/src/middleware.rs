//! The actix-web middleware: [`Idempotency`] and the request flow of the contract.
//!
//! For a covered request (POST/PATCH by default) carrying a key:
//!
//! 1. parse the key (C2), take the tenant (C3), buffer the body up to `max_body_bytes` (C14) and
//!    fingerprint method, path, query and body (C4);
//! 2. one `reserve` call on the store (C5): it either reserves the key for us, or tells us what
//!    is there: a completed record (replay it, C6, or 422 if the fingerprint differs, C7) or a
//!    running one (409 with `Retry-After`, or wait for it, C8; 422 if the fingerprint differs);
//! 3. run the handler with the buffered body and the [`IdempotencyKey`] in the extensions;
//! 4. if the response is to be stored (C10, C11), buffer it (up to `max_response_bytes`), send
//!    it to the client and `complete` the record with the reservation's token (C9); otherwise
//!    `release` the key so the client can retry.
//!
//! A store failure before the handler runs answers 503 (C15, or passes through with
//! `fail_open`); after the handler ran, the client still gets the response, the failure is
//! logged, and the reservation stays until its lease ends (C16).

use std::future::{ready, Ready};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use actix_service::{Service, Transform};
use actix_web::body::{BodySize, BoxBody, EitherBody, MessageBody};
use actix_web::dev::{Payload, ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderMap, HeaderName, HeaderValue};
use actix_web::{Error, HttpMessage, HttpResponse};
use bytes::{Bytes, BytesMut};
use futures_util::future::LocalBoxFuture;
use futures_util::StreamExt;

use crate::config::{Config, IdempotencyBuilder, ResponseParts};
use crate::fingerprint::{is_json_content_type, Fingerprint};
use crate::key::{parse_key, IdempotencyKey, KeyError};
use crate::problem::{Problem, ProblemCode};
use crate::store::{
    IdempotencyStore, ReservationToken, ReserveOutcome, Scope, StoreError, StoredResponse,
    WriteOutcome,
};

/// The response header added to replays.
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Headers that are never stored or replayed (C11): cookies belong to one response, the rest
/// describe one connection or one message framing.
const NEVER_STORED: [HeaderName; 11] = [
    header::SET_COOKIE,
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TRANSFER_ENCODING,
    header::CONTENT_LENGTH,
    header::TE,
    header::TRAILER,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    REPLAYED_HEADER,
];

/// Longest pause between two looks at a running request in wait mode.
const MAX_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// The Idempotency-Key middleware. `.wrap()` it around an `App` or a scope.
///
/// ```
/// use actix_web::{web, App, HttpResponse};
/// use idempotency_actix::{store::MemoryStore, Idempotency};
///
/// let store = MemoryStore::new(); // clones share the records: create it outside the app factory
/// let app = App::new()
///     .wrap(Idempotency::new(store.clone()))
///     .route("/payments", web::post().to(|| async { HttpResponse::Created().finish() }));
/// ```
pub struct Idempotency<S> {
    store: Arc<S>,
    config: Arc<Config>,
}

impl<S> Clone for Idempotency<S> {
    fn clone(&self) -> Self {
        Self {
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
        }
    }
}

impl<S: IdempotencyStore> Idempotency<S> {
    /// The middleware with the contract's defaults (see [`crate::config`] for each and why).
    pub fn new(store: S) -> Self {
        Self::builder(store).build()
    }

    /// Configure the middleware.
    pub fn builder(store: S) -> IdempotencyBuilder<S> {
        IdempotencyBuilder::new(store)
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn from_parts(store: S, config: Config) -> Self {
        Self {
            store: Arc::new(store),
            config: Arc::new(config),
        }
    }
}

impl<S, Svc, B> Transform<Svc, ServiceRequest> for Idempotency<S>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B, BoxBody>>;
    type Error = Error;
    type Transform = IdempotencyMiddleware<S, Svc>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, ()>>;

    fn new_transform(&self, service: Svc) -> Self::Future {
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
        }))
    }
}

/// The per-worker service created by [`Idempotency`]; not used directly.
pub struct IdempotencyMiddleware<S, Svc> {
    service: Rc<Svc>,
    store: Arc<S>,
    config: Arc<Config>,
}

impl<S, Svc, B> Service<ServiceRequest> for IdempotencyMiddleware<S, Svc>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<EitherBody<B, BoxBody>>;
    type Error = Error;
    type Future = LocalBoxFuture<'static, Result<Self::Response, Error>>;

    actix_service::forward_ready!(service);

    fn call(&self, req: ServiceRequest) -> Self::Future {
        let service = Rc::clone(&self.service);
        if !self.config.covers(req.method()) {
            return Box::pin(pass_through(service, req));
        }
        let flow = Flow {
            service,
            store: Arc::clone(&self.store),
            config: Arc::clone(&self.config),
        };
        Box::pin(flow.run(req))
    }
}

async fn pass_through<Svc, B>(
    service: Rc<Svc>,
    req: ServiceRequest,
) -> Result<ServiceResponse<EitherBody<B, BoxBody>>, Error>
where
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error>,
{
    Ok(service.call(req).await?.map_into_left_body())
}

/// One covered request on its way through the contract.
struct Flow<S, Svc> {
    service: Rc<Svc>,
    store: Arc<S>,
    config: Arc<Config>,
}

type FlowResult<B> = Result<ServiceResponse<EitherBody<B, BoxBody>>, Error>;

impl<S, Svc, B> Flow<S, Svc>
where
    S: IdempotencyStore,
    Svc: Service<ServiceRequest, Response = ServiceResponse<B>, Error = Error> + 'static,
    B: MessageBody + 'static,
{
    async fn run(self, mut req: ServiceRequest) -> FlowResult<B> {
        let key = match self.key_of(&req) {
            Ok(Some(key)) => key,
            Ok(None) => return pass_through(self.service, req).await,
            Err(problem) => return Ok(self.problem(req, problem)),
        };
        let body = match read_body(&mut req, self.config.max_body_bytes).await? {
            Ok(body) => body,
            Err(problem) => return Ok(self.problem(req, problem)),
        };
        let scope = Scope {
            tenant: self
                .config
                .tenant
                .as_ref()
                .and_then(|t| t(&req))
                .unwrap_or_default(),
            method: req.method().as_str().to_owned(),
            // The path as the router sees it (percent-encoded unreserved characters decoded),
            // so `/%70ayments` and `/payments`, one route, are one record, not two executions.
            path: req.match_info().as_str().to_owned(),
            key,
        };
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(is_json_content_type);
        // The fingerprint takes the path as sent: only the same bytes replay (another spelling
        // of the same route gets 422, never another request's response).
        let fingerprint =
            Fingerprint::of_request(&scope.method, req.path(), req.query_string(), json, &body);
        req.set_payload(Payload::from(body));

        let token = match self.reserve(&scope, &fingerprint).await {
            Ok(token) => token,
            Err(Decision::Respond(response)) => {
                return Ok(req.into_response(response).map_into_right_body())
            }
            Err(Decision::PassThrough) => return pass_through(self.service, req).await,
        };
        req.extensions_mut()
            .insert(IdempotencyKey(scope.key.clone()));
        let result = self.service.call(req).await;
        self.finish(&scope, token, result).await
    }

    /// The key of the request, `None` if it has none and none is required.
    fn key_of(&self, req: &ServiceRequest) -> Result<Option<String>, Problem> {
        let mut values = req.headers().get_all(&self.config.header_name);
        let Some(value) = values.next() else {
            return if self.config.required {
                Err(Problem::new(
                    ProblemCode::MissingKey,
                    format!(
                        "send a unique {} header with this request",
                        self.config.header_name
                    ),
                ))
            } else {
                Ok(None)
            };
        };
        let parsed = if values.next().is_some() {
            Err(KeyError::Repeated)
        } else {
            parse_key(value.as_bytes(), self.config.max_key_len)
        };
        parsed
            .map(Some)
            .map_err(|e| Problem::new(e.code(), format!("{}: {e}", self.config.header_name)))
    }

    /// Reserve the key, or decide the response without running the handler.
    async fn reserve(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
    ) -> Result<ReservationToken, Decision> {
        let config = &self.config;
        let wait_until = config.wait_for_in_flight.map(|wait| Instant::now() + wait);
        let mut pause = Duration::from_millis(10);
        loop {
            let outcome = self
                .store
                .reserve(scope, fingerprint, config.lock_timeout)
                .await;
            match outcome {
                Ok(ReserveOutcome::Reserved { token }) => {
                    tracing::debug!(target: "idempotency_actix", outcome = "miss", key = %scope.key, tenant = %scope.tenant, path = %scope.path, "reserved; running the handler");
                    return Ok(token);
                }
                Ok(ReserveOutcome::Completed {
                    fingerprint: stored,
                    ..
                })
                | Ok(ReserveOutcome::InFlight {
                    fingerprint: stored,
                    ..
                }) if stored != *fingerprint => {
                    tracing::info!(target: "idempotency_actix", outcome = "mismatch", key = %scope.key, tenant = %scope.tenant, path = %scope.path, "key reused for a different request");
                    return Err(self.respond(Problem::new(
                        ProblemCode::FingerprintMismatch,
                        "this key was used for a request with another method, path, query or body; use a new key for a new request",
                    )));
                }
                Ok(ReserveOutcome::Completed { response, .. }) => {
                    tracing::debug!(target: "idempotency_actix", outcome = "replay", key = %scope.key, tenant = %scope.tenant, path = %scope.path, status = response.status, "replaying the stored response");
                    return Err(Decision::Respond(replay(response)));
                }
                Ok(ReserveOutcome::InFlight { .. }) => {
                    let now = Instant::now();
                    if let Some(until) = wait_until.filter(|until| *until > now) {
                        tokio::time::sleep(pause.min(until - now)).await;
                        pause = (pause * 2).min(MAX_POLL_INTERVAL);
                        continue;
                    }
                    tracing::info!(target: "idempotency_actix", outcome = "conflict", key = %scope.key, tenant = %scope.tenant, path = %scope.path, "the first request with this key is still running");
                    return Err(self.respond(
                        Problem::new(
                            ProblemCode::Conflict,
                            "the first request with this key is still being processed; retry after it finishes",
                        )
                        .with_retry_after(config.retry_after),
                    ));
                }
                Err(error) => {
                    tracing::error!(target: "idempotency_actix", outcome = "store_error", key = %scope.key, tenant = %scope.tenant, path = %scope.path, fail_open = config.fail_open, %error, "could not reserve the key");
                    if config.fail_open {
                        return Err(Decision::PassThrough);
                    }
                    return Err(self.respond(
                        Problem::new(ProblemCode::StorageUnavailable, unavailable_detail(&error))
                            .with_retry_after(config.retry_after),
                    ));
                }
            }
        }
    }

    /// After the handler: store or release, and hand the response on.
    async fn finish(
        &self,
        scope: &Scope,
        token: ReservationToken,
        result: Result<ServiceResponse<B>, Error>,
    ) -> FlowResult<B> {
        let config = &self.config;
        let response = match result {
            Ok(response) if (config.store_status)(response.status()) => response,
            Ok(response) => {
                let status = response.status();
                self.release(scope, &token, status.as_str()).await;
                return Ok(response.map_into_left_body());
            }
            Err(error) => {
                self.release(scope, &token, "handler error").await;
                return Err(error);
            }
        };
        let (request, response) = response.into_parts();
        let (head, body) = response.into_parts();
        let body = match buffer_body(body, config.max_response_bytes).await {
            Buffered::Complete(bytes) => bytes,
            Buffered::TooLarge(body) => {
                tracing::warn!(target: "idempotency_actix", outcome = "not_stored", key = %scope.key, tenant = %scope.tenant, path = %scope.path, max_response_bytes = config.max_response_bytes, "response too large to store; key released");
                self.release(scope, &token, "response too large").await;
                let response = head.set_body(body);
                return Ok(ServiceResponse::new(request, response).map_into_right_body());
            }
            Buffered::Failed(error) => {
                // The handler ran, so its effects may exist: keep the reservation until its
                // lease ends rather than invite a second execution (C16).
                tracing::error!(target: "idempotency_actix", outcome = "store_error", key = %scope.key, tenant = %scope.tenant, path = %scope.path, %error, "response body failed; reservation left to its lease");
                return Err(actix_web::error::ErrorInternalServerError(error));
            }
        };
        let parts = ResponseParts {
            status: head.status(),
            headers: head.headers(),
            body: &body,
        };
        if config.store_if.as_ref().is_some_and(|keep| !keep(&parts)) {
            self.release(scope, &token, "rejected by store_if").await;
        } else {
            let stored = StoredResponse {
                status: head.status().as_u16(),
                headers: storable_headers(head.headers(), &config.deny_headers),
                body: body.clone(),
            };
            self.complete(scope, &token, &stored).await;
        }
        let response = head.set_body(BoxBody::new(body));
        Ok(ServiceResponse::new(request, response).map_into_right_body())
    }

    async fn complete(&self, scope: &Scope, token: &ReservationToken, stored: &StoredResponse) {
        match self
            .store
            .complete(scope, token, stored, self.config.ttl)
            .await
        {
            Ok(WriteOutcome::Applied) => {
                tracing::debug!(target: "idempotency_actix", outcome = "stored", key = %scope.key, tenant = %scope.tenant, path = %scope.path, status = stored.status, "response stored");
            }
            Ok(WriteOutcome::Stale) => {
                tracing::warn!(target: "idempotency_actix", outcome = "stale", key = %scope.key, tenant = %scope.tenant, path = %scope.path, "the lease ended and another request took the key over; this response was not stored");
            }
            Err(error) => {
                tracing::error!(target: "idempotency_actix", outcome = "store_error", key = %scope.key, tenant = %scope.tenant, path = %scope.path, %error, "could not store the response; retrying until the lease ends, the reservation stays meanwhile");
                self.retry_complete(scope.clone(), *token, stored.clone());
            }
        }
    }

    /// After a failed `complete` (C16): keep trying in the background until the lease ends,
    /// so a store that comes back in time still records the response the client got, and a
    /// retry replays it instead of running the handler again. Fenced by the token: once the
    /// key was taken over the write is stale and changes nothing.
    fn retry_complete(&self, scope: Scope, token: ReservationToken, stored: StoredResponse) {
        let store = Arc::clone(&self.store);
        let ttl = self.config.ttl;
        let until = Instant::now() + self.config.lock_timeout;
        tokio::spawn(async move {
            let mut pause = Duration::from_millis(100);
            while Instant::now() + pause < until {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
                match store.complete(&scope, &token, &stored, ttl).await {
                    Ok(WriteOutcome::Applied) => {
                        tracing::info!(target: "idempotency_actix", outcome = "stored", key = %scope.key, tenant = %scope.tenant, path = %scope.path, status = stored.status, "response stored after the store recovered");
                        return;
                    }
                    Ok(WriteOutcome::Stale) => return,
                    Err(_) => {}
                }
            }
            tracing::error!(target: "idempotency_actix", outcome = "store_error", key = %scope.key, tenant = %scope.tenant, path = %scope.path, "gave up storing the response: the lease ended; a retry will run the handler again");
        });
    }

    async fn release(&self, scope: &Scope, token: &ReservationToken, reason: &str) {
        tracing::info!(target: "idempotency_actix", outcome = "not_stored", key = %scope.key, tenant = %scope.tenant, path = %scope.path, reason, "response not stored; key released");
        match self.store.release(scope, token).await {
            Ok(WriteOutcome::Applied) => {}
            Ok(WriteOutcome::Stale) => {
                tracing::warn!(target: "idempotency_actix", outcome = "stale", key = %scope.key, tenant = %scope.tenant, path = %scope.path, "the reservation was taken over before it could be released");
            }
            Err(error) => {
                tracing::error!(target: "idempotency_actix", outcome = "store_error", key = %scope.key, tenant = %scope.tenant, path = %scope.path, %error, "could not release the key; it stays reserved until its lease ends");
            }
        }
    }

    fn respond(&self, problem: Problem) -> Decision {
        Decision::Respond(self.config.problem(problem))
    }

    fn problem(
        &self,
        req: ServiceRequest,
        problem: Problem,
    ) -> ServiceResponse<EitherBody<B, BoxBody>> {
        req.into_response(self.config.problem(problem))
            .map_into_right_body()
    }
}

/// What to do instead of running the handler.
enum Decision {
    Respond(HttpResponse),
    PassThrough,
}

fn unavailable_detail(error: &StoreError) -> String {
    match error {
        StoreError::NotProvisioned { hint } => {
            format!(
                "the idempotency store is not provisioned ({hint}); the request was not processed"
            )
        }
        _ => "the idempotency store is unavailable; the request was not processed, retry later"
            .to_owned(),
    }
}

/// Buffer the request body, or answer 413 (C14): checked against Content-Length first, then
/// against the bytes actually read, so a missing or lying Content-Length changes nothing.
async fn read_body(req: &mut ServiceRequest, max: usize) -> Result<Result<Bytes, Problem>, Error> {
    let too_large = || {
        Problem::new(
            ProblemCode::PayloadTooLarge,
            format!("the body is larger than {max} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Ok(Err(too_large()));
    }
    let mut payload = req.take_payload();
    let mut body = BytesMut::with_capacity(declared.map_or(0, |len| len as usize));
    while let Some(chunk) = payload.next().await {
        let chunk = chunk?;
        if body.len() + chunk.len() > max {
            return Ok(Err(too_large()));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Ok(body.freeze()))
}

enum Buffered {
    Complete(Bytes),
    /// Over the limit: the body to send instead (what was read, then the rest).
    TooLarge(BoxBody),
    Failed(Box<dyn std::error::Error>),
}

/// Read a response body up to `max` bytes without ever holding more than that.
async fn buffer_body<B: MessageBody + 'static>(body: B, max: usize) -> Buffered {
    if let BodySize::Sized(len) = body.size() {
        if len > max as u64 {
            return Buffered::TooLarge(BoxBody::new(body));
        }
    }
    let body = match body.try_into_bytes() {
        Ok(bytes) => return Buffered::Complete(bytes),
        Err(body) => body,
    };
    let size = body.size();
    let mut body = Box::pin(body);
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut read = 0usize;
    loop {
        match std::future::poll_fn(|cx| body.as_mut().poll_next(cx)).await {
            None => break,
            Some(Ok(chunk)) => {
                read += chunk.len();
                chunks.push(chunk);
                if read > max {
                    return Buffered::TooLarge(BoxBody::new(Prefixed {
                        prefix: chunks,
                        rest: body,
                        size,
                    }));
                }
            }
            Some(Err(error)) => return Buffered::Failed(error.into()),
        }
    }
    Buffered::Complete(match chunks.len() {
        0 => Bytes::new(),
        1 => chunks.swap_remove(0),
        _ => {
            let mut all = BytesMut::with_capacity(read);
            chunks.iter().for_each(|c| all.extend_from_slice(c));
            all.freeze()
        }
    })
}

/// A body whose first chunks were already read: those, then the rest of the original.
struct Prefixed<B> {
    prefix: Vec<Bytes>,
    rest: Pin<Box<B>>,
    size: BodySize,
}

impl<B: MessageBody> MessageBody for Prefixed<B> {
    type Error = B::Error;

    fn size(&self) -> BodySize {
        self.size
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Bytes, Self::Error>>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            return Poll::Ready(Some(Ok(this.prefix.remove(0))));
        }
        this.rest.as_mut().poll_next(cx)
    }
}

/// The headers of a response that may be stored and replayed (C11).
fn storable_headers(headers: &HeaderMap, deny: &[HeaderName]) -> Vec<(String, Bytes)> {
    headers
        .iter()
        .filter(|(name, _)| !NEVER_STORED.contains(name) && !deny.contains(name))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// The stored response, byte for byte, marked as a replay (C6).
fn replay(stored: StoredResponse) -> HttpResponse {
    let status = actix_web::http::StatusCode::from_u16(stored.status)
        .unwrap_or(actix_web::http::StatusCode::OK);
    let mut response = HttpResponse::with_body(status, BoxBody::new(stored.body));
    let headers = response.headers_mut();
    for (name, value) in stored.headers {
        // A record written by this crate always decodes; skip anything a foreign writer made
        // unrepresentable rather than fail the replay.
        if let (Ok(name), Ok(value)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::from_maybe_shared(value),
        ) {
            if !NEVER_STORED.contains(&name) {
                headers.append(name, value);
            }
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}

impl<S, Svc> std::fmt::Debug for IdempotencyMiddleware<S, Svc> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyMiddleware")
            .finish_non_exhaustive()
    }
}
