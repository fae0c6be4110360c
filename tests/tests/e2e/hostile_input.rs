//! Hostile input through real HTTP (issue 6): malformed keys, bodies that lie about their size,
//! chunked and invalid bodies, JSON built to hurt a parser, tenants crafted to collide, and
//! responses that are binary, huge or over the storage limit. Sent with the raw client over
//! TCP to an actix server on the PostgreSQL store.
//!
//! After every case: the answer has the contract's status and problem code, a normal request
//! still succeeds (the process is healthy), and `idempotency_keys` holds no partially written
//! record (no reservation left in flight, and exactly the completed rows the case should
//! store). A `COUNTS` table is printed for `docs/reliability.md`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix_web::http::header::HeaderName;
use actix_web::{web, App, HttpResponse, HttpServer};
use bytes::Bytes;
use idempotency_actix::store::postgres::PostgresStore;
use idempotency_actix::store::StoredResponse;
use idempotency_actix::Idempotency;
use idempotency_e2e::raw_http::{Body, Conn, Request, Response};
use idempotency_e2e::records::{count_in_state, records, records_for_key, State};
use idempotency_e2e::server::ThreadServer;
use idempotency_e2e::{block_on_fresh_thread, TestDb};

const TIMEOUT: Duration = Duration::from_secs(20);
const MIB: usize = 1024 * 1024;

struct Server {
    addr: SocketAddr,
    _server: ThreadServer,
    executions: Arc<AtomicU64>,
}

type Counter = web::Data<AtomicU64>;

fn next(n: &Counter) -> u64 {
    n.fetch_add(1, Ordering::SeqCst) + 1
}

async fn echo(n: Counter, body: Bytes) -> HttpResponse {
    let run = next(&n);
    HttpResponse::Created()
        .content_type("application/json")
        .body(format!(r#"{{"run":{run},"len":{}}}"#, body.len()))
}

async fn binary(n: Counter) -> HttpResponse {
    next(&n);
    let body: Vec<u8> = (0..4).flat_map(|_| 0..=255u8).collect();
    HttpResponse::Created()
        .content_type("application/octet-stream")
        .body(body)
}

async fn cookie(n: Counter) -> HttpResponse {
    let run = next(&n);
    HttpResponse::Created()
        .insert_header(("set-cookie", "session=secret; HttpOnly"))
        .insert_header(("x-internal-token", "tok-secret"))
        .insert_header(("x-visible", "yes"))
        .body(format!("run {run}"))
}

async fn huge_headers(n: Counter) -> HttpResponse {
    let run = next(&n);
    let mut response = HttpResponse::Created();
    response.insert_header(("x-big", "b".repeat(32 * 1024)));
    for i in 0..50 {
        response.append_header((format!("x-h-{i}"), format!("value-{i}")));
    }
    response.body(format!("run {run}"))
}

async fn big_response(n: Counter) -> HttpResponse {
    let run = next(&n);
    let mut body = vec![b'x'; 2 * MIB];
    body[..8].copy_from_slice(format!("{run:08}").as_bytes());
    HttpResponse::Ok().body(body)
}

fn start_server(url: &str) -> Server {
    let executions = Arc::new(AtomicU64::new(0));
    let url = url.to_owned();
    let counter = Arc::clone(&executions);
    let server = ThreadServer::start(move || async move {
        let store = PostgresStore::connect(&url).await.expect("store");
        let counter = web::Data::from(counter);
        let server = HttpServer::new(move || {
            let middleware = |max_body: usize| {
                Idempotency::builder(store.clone())
                    .tenant_header("x-tenant")
                    // These cases send most requests without a tenant; refusing those (C23) is
                    // tested in idempotency-actix/tests/middleware.rs and http_streaming.rs.
                    .missing_tenant_uses_global_scope(true)
                    .deny_headers([HeaderName::from_static("x-internal-token")])
                    .max_body_bytes(max_body)
                    .build()
            };
            App::new()
                .app_data(counter.clone())
                .app_data(web::PayloadConfig::new(32 * MIB))
                .service(
                    web::scope("/api")
                        .wrap(middleware(MIB))
                        .route("/echo", web::post().to(echo))
                        .route("/echo/{tail:.*}", web::post().to(echo))
                        .route("/binary", web::post().to(binary))
                        .route("/cookie", web::post().to(cookie))
                        .route("/huge-headers", web::post().to(huge_headers))
                        .route("/big-response", web::post().to(big_response)),
                )
                .service(
                    web::scope("/bulk")
                        .wrap(middleware(16 * MIB))
                        .route("/echo", web::post().to(echo)),
                )
        })
        .workers(2)
        .disable_signals()
        .bind(("127.0.0.1", 0))
        .expect("bind");
        (server.addrs()[0], server.run())
    });
    Server {
        addr: server.addr,
        _server: server,
        executions,
    }
}

/// Send on a fresh connection. Write errors are tolerated (the server may answer 413 and close
/// before reading a large body); the answer is whatever can be read afterwards.
fn send(addr: SocketAddr, request: &Request) -> std::io::Result<Response> {
    let mut conn = Conn::connect(addr, TIMEOUT)?;
    let _ = conn.send_raw(&request.to_bytes());
    conn.read_response(&request.method)
}

fn echo_json(key: impl AsRef<[u8]>, body: impl AsRef<[u8]>) -> Request {
    Request::post("/api/echo").key(key).json(body)
}

/// One row of the printed table.
struct Row {
    case: &'static str,
    requests: usize,
    executions: u64,
    statuses: String,
    stored: i64,
}

struct Harness {
    server: Server,
    db: TestDb,
    rows: Vec<Row>,
    health: u64,
}

impl Harness {
    fn executions(&self) -> u64 {
        self.server.executions.load(Ordering::SeqCst)
    }

    fn completed(&self) -> i64 {
        count_in_state(&self.db.url, State::Completed) as i64
    }

    /// Run `body` (which sends requests and asserts on the answers), then the checks every case
    /// shares: exactly `stored` new completed rows, nothing in flight, a normal request works.
    fn case(
        &mut self,
        case: &'static str,
        stored: i64,
        body: impl FnOnce(SocketAddr, &str) -> Vec<Response>,
    ) {
        let (before_rows, before_runs) = (self.completed(), self.executions());
        let responses = body(self.server.addr, &self.db.url);
        let executions = self.executions() - before_runs;
        let new_rows = self.completed() - before_rows;
        assert_eq!(new_rows, stored, "{case}: completed rows written");
        let in_flight = count_in_state(&self.db.url, State::InFlight) as i64;
        assert_eq!(in_flight, 0, "{case}: a reservation was left behind");
        // The process is healthy: a normal keyed request succeeds on a new connection.
        self.health += 1;
        let health_key = format!("health-{}", self.health);
        let ok = send(self.server.addr, &echo_json(&health_key, r#"{"ok":true}"#))
            .unwrap_or_else(|e| panic!("{case}: health request failed: {e}"));
        assert_eq!(ok.status, 201, "{case}: health: {}", ok.describe());
        let mut statuses: Vec<String> = responses
            .iter()
            .map(|r| match r.problem_code() {
                Some(code) => format!("{} {code}", r.status),
                None if r.is_replay() => format!("{} replay", r.status),
                None => r.status.to_string(),
            })
            .collect();
        statuses.dedup();
        self.rows.push(Row {
            case,
            requests: responses.len(),
            executions,
            statuses: statuses.join(", "),
            stored,
        });
    }
}

fn assert_problem(response: &Response, status: u16, code: &str) {
    assert_eq!(response.status, status, "{}", response.describe());
    assert_eq!(
        response.problem_code().as_deref(),
        Some(code),
        "{}",
        response.describe()
    );
}

fn run(n: &Response) -> u64 {
    let json: serde_json::Value = serde_json::from_slice(&n.body).expect("echo JSON");
    json["run"].as_u64().expect("run")
}

#[test]
fn hostile_input_gets_the_contract_answer_and_leaves_nothing_behind() {
    let db = block_on_fresh_thread(TestDb::new()).expect("test database");
    let server = start_server(&db.url);
    let mut h = Harness {
        server,
        db,
        rows: Vec::new(),
        health: 0,
    };
    let body = r#"{"amount":1}"#;

    // ---- keys ------------------------------------------------------------------------------
    h.case("key: empty", 0, |addr, _| {
        let a = send(addr, &echo_json("", body)).unwrap();
        assert_problem(&a, 400, "INVALID_KEY");
        let b = send(addr, &echo_json("\"\"", body)).unwrap();
        assert_problem(&b, 400, "INVALID_KEY");
        vec![a, b]
    });
    h.case("key: 256 bytes (255 accepted)", 1, |addr, url| {
        let a = send(addr, &echo_json("a".repeat(256), body)).unwrap();
        assert_problem(&a, 400, "KEY_TOO_LONG");
        let b = send(addr, &echo_json(format!("\"{}\"", "q".repeat(300)), body)).unwrap();
        assert_problem(&b, 400, "KEY_TOO_LONG");
        let c = send(addr, &echo_json("m".repeat(255), body)).unwrap();
        assert_eq!(c.status, 201, "{}", c.describe());
        assert_eq!(records_for_key(url, &"m".repeat(255)).len(), 1);
        vec![a, b, c]
    });
    h.case("key: multi-byte UTF-8 over the byte limit", 0, |addr, _| {
        let a = send(addr, &echo_json("é".repeat(200), body)).unwrap();
        assert_problem(&a, 400, "KEY_TOO_LONG");
        let b = send(addr, &echo_json("ключ", body)).unwrap();
        assert_problem(&b, 400, "INVALID_KEY");
        vec![a, b]
    });
    h.case("key: control characters", 0, |addr, _| {
        // A tab passes the HTTP parser and reaches the key parser.
        let a = send(addr, &echo_json("a\tb", body)).unwrap();
        assert_problem(&a, 400, "INVALID_KEY");
        let b = send(addr, &echo_json("\"a\tb\"", body)).unwrap();
        assert_problem(&b, 400, "INVALID_KEY");
        // Other control bytes are refused by actix's HTTP parser before any middleware: a bare
        // 400 (no problem body), the connection closed.
        let mut out = vec![a, b];
        for raw in [&b"a\x01b"[..], b"a\x7fb", b"a\x00b"] {
            let r = send(addr, &echo_json(raw, body)).unwrap();
            assert_eq!(r.status, 400, "{}", r.describe());
            assert!(
                matches!(r.problem_code().as_deref(), None | Some("INVALID_KEY")),
                "{}",
                r.describe()
            );
            out.push(r);
        }
        out
    });
    h.case("key: header sent twice", 0, |addr, _| {
        let a = send(addr, &echo_json("dup-1", body).key("dup-1")).unwrap();
        assert_problem(&a, 400, "INVALID_KEY");
        let b = send(addr, &echo_json("dup-2", body).key("dup-3")).unwrap();
        assert_problem(&b, 400, "INVALID_KEY");
        vec![a, b]
    });
    h.case("key: malformed sf-strings", 0, |addr, _| {
        let mut out = Vec::new();
        for raw in [r#""abc"#, r#""a\q""#, r#""abc"x"#, r#""a\""#, "\"\\"] {
            let r = send(addr, &echo_json(raw, body)).unwrap();
            assert_problem(&r, 400, "INVALID_KEY");
            out.push(r);
        }
        out
    });
    h.case("key: full of delimiters (valid)", 2, |addr, url| {
        let bare = r#",;=(){}<>@:\/[]?*&%$#!~|^`'+"#;
        let a = send(addr, &echo_json(bare, body)).unwrap();
        assert_eq!(a.status, 201, "{}", a.describe());
        let again = send(addr, &echo_json(bare, body)).unwrap();
        assert!(again.is_replay(), "{}", again.describe());
        assert_eq!(
            records_for_key(url, bare).len(),
            1,
            "stored under the exact key"
        );
        let quoted = r#""a,b;c=\"d\"\\ e""#;
        let b = send(addr, &echo_json(quoted, body)).unwrap();
        assert_eq!(b.status, 201, "{}", b.describe());
        assert_eq!(records_for_key(url, r#"a,b;c="d"\ e"#).len(), 1);
        vec![a, again, b]
    });

    // ---- bodies ----------------------------------------------------------------------------
    h.case(
        "body: over the limit with Content-Length",
        0,
        |addr, url| {
            let big = vec![b' '; MIB + 1];
            let a = send(addr, &echo_json("big-cl", &big)).unwrap();
            assert_problem(&a, 413, "PAYLOAD_TOO_LARGE");
            assert!(records_for_key(url, "big-cl").is_empty());
            vec![a]
        },
    );
    h.case(
        "body: over the limit, chunked (no Content-Length)",
        0,
        |addr, url| {
            let request = Request::post("/api/echo")
                .key("big-chunked")
                .header("Content-Type", "application/json")
                .body(Body::Chunked(vec![b' '; MIB + 1], 64 * 1024));
            let a = send(addr, &request).unwrap();
            assert_problem(&a, 413, "PAYLOAD_TOO_LARGE");
            assert!(records_for_key(url, "big-chunked").is_empty());
            vec![a]
        },
    );
    h.case("body: Content-Length claims 1 TB", 0, |addr, url| {
        let request = Request::post("/api/echo")
            .key("liar-huge")
            .header("Content-Type", "application/json")
            .header("Content-Length", "1000000000000")
            .body(Body::Raw(body.as_bytes().to_vec()));
        let a = send(addr, &request).unwrap();
        assert_problem(&a, 413, "PAYLOAD_TOO_LARGE");
        assert!(records_for_key(url, "liar-huge").is_empty());
        vec![a]
    });
    h.case(
        "body: Content-Length longer than the body, then EOF",
        0,
        |addr, url| {
            let mut conn = Conn::connect(addr, TIMEOUT).unwrap();
            let request = Request::post("/api/echo")
                .key("liar-short")
                .header("Content-Type", "application/json")
                .header("Content-Length", "100")
                .body(Body::Raw(body.as_bytes().to_vec()));
            conn.send_raw(&request.to_bytes()).unwrap();
            conn.shutdown_write().unwrap();
            // The body never completes: no handler, no record; any answer is an error.
            let answer = conn.read_response("POST");
            if let Ok(r) = &answer {
                assert!(r.status >= 400, "{}", r.describe());
            }
            assert!(records_for_key(url, "liar-short").is_empty());
            answer.into_iter().collect()
        },
    );
    h.case(
        "body: Content-Length shorter than the body",
        1,
        |addr, url| {
            // The server takes the declared 12 bytes as the body; the rest is a malformed next
            // request on the same connection, which the HTTP parser rejects.
            let mut conn = Conn::connect(addr, TIMEOUT).unwrap();
            let request = Request::post("/api/echo")
                .key("liar-long")
                .header("Content-Type", "application/json")
                .header("Content-Length", "12")
                .body(Body::Raw(
                    br#"{"amount":1}GARBAGE / HTTP/9.9 garbage"#.to_vec(),
                ));
            conn.send_raw(&request.to_bytes()).unwrap();
            let first = conn.read_response("POST").unwrap();
            assert_eq!(first.status, 201, "{}", first.describe());
            assert!(first.text().contains(r#""len":12"#), "{}", first.describe());
            let mut out = vec![first];
            // Closed without an answer is also fine.
            if let Ok(second) = conn.read_response("POST") {
                assert_eq!(second.status, 400, "{}", second.describe());
                out.push(second);
            }
            assert_eq!(records_for_key(url, "liar-long").len(), 1);
            out
        },
    );
    h.case(
        "body: Content-Length and chunked together",
        0,
        |addr, url| {
            let request = Request::post("/api/echo")
                .key("smuggle")
                .header("Content-Type", "application/json")
                .header("Content-Length", "4")
                .header("Transfer-Encoding", "chunked")
                .body(Body::Raw(b"c\r\n{\"amount\":1}\r\n0\r\n\r\n".to_vec()));
            let a = send(addr, &request).unwrap();
            assert_eq!(a.status, 400, "{}", a.describe());
            assert!(records_for_key(url, "smuggle").is_empty());
            vec![a]
        },
    );
    h.case(
        "body: chunked = same request as Content-Length",
        1,
        |addr, _| {
            let json = r#"{"amount": 5, "currency": "EUR"}"#;
            let chunked = Request::post("/api/echo")
                .key("chunky")
                .header("Content-Type", "application/json")
                .body(Body::Chunked(json.as_bytes().to_vec(), 3));
            let a = send(addr, &chunked).unwrap();
            assert_eq!(a.status, 201, "{}", a.describe());
            let b = send(addr, &echo_json("chunky", json)).unwrap();
            assert!(b.is_replay(), "{}", b.describe());
            assert_eq!(a.body, b.body);
            vec![a, b]
        },
    );
    h.case("body: invalid UTF-8 declared as JSON", 1, |addr, _| {
        let bad = b"{\"name\":\"\xff\xfe\xc3\"}";
        let a = send(addr, &echo_json("utf8", bad)).unwrap();
        assert_eq!(a.status, 201, "{}", a.describe());
        let b = send(addr, &echo_json("utf8", bad)).unwrap();
        assert!(b.is_replay(), "{}", b.describe());
        let c = send(addr, &echo_json("utf8", b"{\"name\":\"\xff\xfe\xc4\"}")).unwrap();
        assert_problem(&c, 422, "FINGERPRINT_MISMATCH");
        vec![a, b, c]
    });
    h.case("body: invalid JSON", 1, |addr, _| {
        let a = send(addr, &echo_json("badjson", r#"{"a": [1, 2"#)).unwrap();
        assert_eq!(a.status, 201, "{}", a.describe());
        let b = send(addr, &echo_json("badjson", r#"{"a": [1, 2"#)).unwrap();
        assert!(b.is_replay(), "{}", b.describe());
        // Raw bytes are compared exactly: other whitespace is another request.
        let c = send(addr, &echo_json("badjson", r#"{"a": [1,2"#)).unwrap();
        assert_problem(&c, 422, "FINGERPRINT_MISMATCH");
        vec![a, b, c]
    });
    h.case("body: JSON nested 100,000 deep", 1, |addr, _| {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let a = send(addr, &echo_json("deep", &deep)).unwrap();
        assert_eq!(a.status, 201, "{}", a.describe());
        let b = send(addr, &echo_json("deep", &deep)).unwrap();
        assert!(b.is_replay(), "{}", b.describe());
        let objects = "{\"a\":".repeat(100_000) + "1" + &"}".repeat(100_000);
        let c = send(addr, &echo_json("deep", objects)).unwrap();
        assert_problem(&c, 422, "FINGERPRINT_MISMATCH");
        vec![a, b, c]
    });
    h.case("body: 10 MB JSON number", 1, |addr, _| {
        let number = format!("[1{}]", "0".repeat(10_000_000));
        let a = send(addr, &echo_json("number", &number)).unwrap();
        assert_problem(&a, 413, "PAYLOAD_TOO_LARGE");
        let bulk = Request::post("/bulk/echo").key("number").json(&number);
        let b = send(addr, &bulk).unwrap();
        assert_eq!(b.status, 201, "{}", b.describe());
        let spaced = format!("[ 1{} ]", "0".repeat(10_000_000));
        let c = send(
            addr,
            &Request::post("/bulk/echo").key("number").json(spaced),
        )
        .unwrap();
        assert!(
            c.is_replay(),
            "same JSON, other whitespace: {}",
            c.describe()
        );
        let other = format!("[1{}1]", "0".repeat(9_999_999));
        let d = send(addr, &Request::post("/bulk/echo").key("number").json(other)).unwrap();
        assert_problem(&d, 422, "FINGERPRINT_MISMATCH");
        vec![a, b, c, d]
    });
    h.case("body: duplicate JSON object keys", 1, |addr, _| {
        let a = send(addr, &echo_json("dupkeys", r#"{"a":1,"a":2}"#)).unwrap();
        assert_eq!(a.status, 201, "{}", a.describe());
        let b = send(addr, &echo_json("dupkeys", r#"{ "a" : 1 , "a" : 2 }"#)).unwrap();
        assert!(b.is_replay(), "{}", b.describe());
        // Which duplicate wins is parser-dependent: the other order is another request.
        let c = send(addr, &echo_json("dupkeys", r#"{"a":2,"a":1}"#)).unwrap();
        assert_problem(&c, 422, "FINGERPRINT_MISMATCH");
        vec![a, b, c]
    });

    // ---- tenants ---------------------------------------------------------------------------
    h.case("tenant: values crafted to collide", 6, |addr, url| {
        let mut out = Vec::new();
        let mut runs = Vec::new();
        // (tenant, key) pairs that a naive "tenant:key" join would make equal, and raw bytes
        // that a naive lossy decoding would make equal.
        let pairs: [(&[u8], &str); 6] = [
            (b"a", "b:c"),
            (b"a:b", "c"),
            (b"acme", "k"),
            (b"ACME", "k"),
            ("é".as_bytes(), "k"),
            (b"\xe9", "k"),
        ];
        for (tenant, key) in pairs {
            let r = send(addr, &echo_json(key, body).header("X-Tenant", tenant)).unwrap();
            assert_eq!(r.status, 201, "{}", r.describe());
            assert!(
                !r.is_replay(),
                "tenant {tenant:?} got another tenant's record"
            );
            runs.push(run(&r));
            out.push(r);
        }
        runs.dedup();
        assert_eq!(runs.len(), 6, "every tenant ran its own request");
        let tenants: Vec<String> = records(url)
            .into_iter()
            .filter(|r| !r.tenant.is_empty())
            .map(|r| r.record.tenant)
            .collect();
        for expected in ["a", "a:b", "acme", "ACME", "é", "\u{1}e9"] {
            assert!(
                tenants.iter().any(|t| t == expected),
                "{expected:?} in {tenants:?}"
            );
        }
        out
    });

    h.case(
        "scope: the same path spelled with percent-encoding",
        1,
        |addr, url| {
            // actix-web routes `/api/%65cho` to `/api/echo`: one resource, so one record. A second
            // spelling must never run the handler again; since its bytes differ it gets 422 rather
            // than a replay (only identical requests are replayed).
            let a = send(addr, &echo_json("spelling", body)).unwrap();
            assert_eq!(a.status, 201, "{}", a.describe());
            let mut b_request = echo_json("spelling", body);
            b_request.target = "/api/%65cho".to_owned();
            let b = send(addr, &b_request).unwrap();
            assert!(
                b.status != 201 || b.is_replay(),
                "the handler ran twice for one request: {}",
                b.describe()
            );
            assert_problem(&b, 422, "FINGERPRINT_MISMATCH");
            let rows = records_for_key(url, "spelling");
            assert_eq!(rows.len(), 1);
            assert_eq!(rows[0].path, "/api/echo");
            let c = send(addr, &echo_json("spelling", body)).unwrap();
            assert!(c.is_replay(), "{}", c.describe());
            vec![a, b, c]
        },
    );

    h.case(
        "scope: path and tenant longer than the primary-key index allows",
        1,
        |addr, url| {
            // The key is bounded (255 bytes) but the path and the tenant are not, and a B-tree
            // entry must fit in a third of a page (2704 bytes): the store declares the longest
            // scope it can record (tenant + method + path + key), and the middleware refuses a
            // longer one with a final 400 before the store is called, never a 503 that every
            // retry would meet again. Random letters: PostgreSQL would compress a repetitive
            // value to fit, and what fits must not depend on that.
            let mut state = 0x2545_F491_4F6C_DD1Du64;
            let noise: String = (0..4000)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    char::from(b'a' + (state % 26) as u8)
                })
                .collect();
            let max = PostgresStore::MAX_SCOPE_BYTES;
            // Global scope (no tenant): "POST" + "/api/echo/" + tail + key = max.
            let key = "at-the-limit";
            let tail = &noise[..max - "POST/api/echo/".len() - key.len()];
            let at_limit = || {
                Request::post(&format!("/api/echo/{tail}"))
                    .key(key)
                    .json(body)
            };
            let mut out = Vec::new();
            let first = send(addr, &at_limit()).unwrap();
            assert_eq!(first.status, 201, "at the limit: {}", first.describe());
            let again = send(addr, &at_limit()).unwrap();
            assert!(again.is_replay(), "at the limit: {}", again.describe());
            out.extend([first, again]);
            let long_path = Request::post(&format!("/api/echo/{}", &noise[..tail.len() + 1]))
                .key(key)
                .json(body);
            let long_tenant = echo_json("long-tenant", body).header("X-Tenant", &noise);
            for request in [long_path, long_tenant] {
                let r = send(addr, &request).unwrap();
                assert_problem(&r, 400, "SCOPE_TOO_LONG");
                assert!(r.header("retry-after").is_none(), "{}", r.describe());
                out.push(r);
            }
            assert_eq!(records_for_key(url, key).len(), 1);
            assert!(records_for_key(url, "long-tenant").is_empty());
            out
        },
    );

    // ---- stored responses ------------------------------------------------------------------
    h.case("response: binary body", 1, |addr, url| {
        let request = Request::post("/api/binary").key("bin").json(body);
        let a = send(addr, &request).unwrap();
        assert_eq!(a.status, 201);
        let expected: Vec<u8> = (0..4).flat_map(|_| 0..=255u8).collect();
        assert_eq!(a.body, expected);
        let b = send(addr, &request).unwrap();
        assert!(b.is_replay(), "{}", b.describe());
        assert_eq!(b.body, expected, "replayed byte for byte");
        let row = records_for_key(url, "bin").remove(0);
        assert_eq!(row.response_body.as_deref(), Some(&expected[..]));
        vec![a, b]
    });
    h.case("response: huge headers", 1, |addr, _| {
        let request = Request::post("/api/huge-headers").key("hh").json(body);
        let a = send(addr, &request).unwrap();
        assert_eq!(a.status, 201);
        let b = send(addr, &request).unwrap();
        assert!(b.is_replay(), "{}", b.describe());
        assert_eq!(b.header("x-big").map(|v| v.len()), Some(32 * 1024));
        for i in 0..50 {
            assert_eq!(b.header(&format!("x-h-{i}")), Some(format!("value-{i}")));
        }
        assert_eq!(a.body, b.body);
        vec![a, b]
    });
    h.case("response: over max_response_bytes", 0, |addr, url| {
        let request = Request::post("/api/big-response").key("bigresp").json(body);
        let a = send(addr, &request).unwrap();
        assert_eq!(a.status, 200);
        assert_eq!(a.body.len(), 2 * MIB, "the client still gets all of it");
        assert!(records_for_key(url, "bigresp").is_empty(), "not stored");
        // Released, so a retry runs the handler again (and is not stored either).
        let b = send(addr, &request).unwrap();
        assert_eq!(b.status, 200);
        assert!(!b.is_replay());
        assert_ne!(a.body[..8], b.body[..8], "a second run");
        vec![a, b]
    });

    // ---- security --------------------------------------------------------------------------
    h.case("security: Set-Cookie and denied headers", 1, |addr, url| {
        let request = Request::post("/api/cookie").key("cookie").json(body);
        let a = send(addr, &request).unwrap();
        assert_eq!(a.status, 201);
        assert!(
            a.header("set-cookie").is_some(),
            "the first response keeps it"
        );
        let row = records_for_key(url, "cookie").remove(0);
        let headers =
            StoredResponse::decode_headers(row.response_headers.as_deref().expect("headers"))
                .expect("decodable");
        let names: Vec<&str> = headers.iter().map(|(n, _)| n.as_str()).collect();
        for banned in [
            "set-cookie",
            "x-internal-token",
            "content-length",
            "connection",
        ] {
            assert!(!names.contains(&banned), "{banned} stored: {names:?}");
        }
        assert!(names.contains(&"x-visible"), "{names:?}");
        let stored = format!("{:?}", row.response_headers);
        assert!(!stored.contains("secret"));
        let b = send(addr, &request).unwrap();
        assert!(b.is_replay());
        assert!(b.header("set-cookie").is_none() && b.header("x-internal-token").is_none());
        assert_eq!(b.header("x-visible").as_deref(), Some("yes"));
        vec![a, b]
    });

    // Nothing anywhere is half-written, and the sum of executions adds up.
    let all = records(&h.db.url);
    assert!(all.iter().all(|r| r.state == State::Completed
        && r.response_status.is_some()
        && r.response_body.is_some()
        && r.response_headers.is_some()));
    println!("COUNTS hostile_input:");
    println!("| case | requests | executions | answers | rows stored |");
    println!("|---|---|---|---|---|");
    for row in &h.rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            row.case, row.requests, row.executions, row.statuses, row.stored
        );
    }
    println!(
        "total: {} cases, {} requests (+{} health checks), {} rows in idempotency_keys",
        h.rows.len(),
        h.rows.iter().map(|r| r.requests).sum::<usize>(),
        h.health,
        all.len()
    );
}
