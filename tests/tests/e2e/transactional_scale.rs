//! Transactional mode (C25) at scale and at its edges: round trips and commits per miss (wire
//! proxy and pg_stat_statements), exactly once across two app instances, and row-level
//! security for the handler's queries (as a role that is neither superuser nor owner).

use std::collections::HashMap;
use std::time::Duration;

use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, web, App, HttpRequest, HttpResponse};
use diesel::sql_types::{BigInt, Text};
use diesel_async::RunQueryDsl;
use futures_util::future::join_all;
use idempotency_actix::store::postgres::schema::State;
use idempotency_actix::store::postgres::{run_migrations, PostgresStore};
use idempotency_actix::{Idempotency, IdempotentTx};
use idempotency_e2e::proxy::PgProxy;
use idempotency_e2e::records::{count, execute, records, TempRole};
use idempotency_e2e::{block_on_fresh_thread, TempCluster, TestDb};

#[derive(diesel::QueryableByName)]
struct N {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Inserts one `payments` row for the request's key.
async fn insert_payment(tx: IdempotentTx, req: HttpRequest) -> actix_web::Result<HttpResponse> {
    let key = req
        .headers()
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let mut conn = tx.conn();
    let id = diesel::sql_query(
        "INSERT INTO payments (idempotency_key, amount) VALUES ($1, 1) RETURNING id AS n",
    )
    .bind::<Text, _>(&key)
    .get_result::<N>(&mut *conn)
    .await
    .map_err(actix_web::error::ErrorInternalServerError)?
    .n;
    let nonce = idempotency_actix::store::ReservationToken::random().as_uuid();
    Ok(HttpResponse::Created().json(serde_json::json!({ "id": id, "nonce": nonce.to_string() })))
}

/// Only takes the transaction: the middleware's own cost, without handler statements.
async fn nothing(tx: IdempotentTx) -> HttpResponse {
    let _ = tx;
    HttpResponse::Created().finish()
}

/// Counts the `payments` rows the handler can see (row-level security applies).
async fn visible(tx: IdempotentTx) -> actix_web::Result<HttpResponse> {
    let mut conn = tx.conn();
    let n = diesel::sql_query("SELECT count(*) AS n FROM payments")
        .get_result::<N>(&mut *conn)
        .await
        .map_err(actix_web::error::ErrorInternalServerError)?
        .n;
    Ok(HttpResponse::Ok().json(serde_json::json!({ "visible": n })))
}

const PAYMENTS: &str = "CREATE TABLE payments (
    id bigserial PRIMARY KEY,
    tenant_id text NOT NULL DEFAULT '',
    idempotency_key text,
    amount bigint NOT NULL
)";

async fn send<S, B>(app: &S, key: Option<&str>, tenant: &str) -> (StatusCode, bool, bytes::Bytes)
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: actix_web::body::MessageBody + 'static,
{
    let mut req = test::TestRequest::post()
        .uri("/payments")
        .insert_header(("x-account-id", tenant))
        .set_json(serde_json::json!({ "amount": 1 }));
    if let Some(key) = key {
        req = req.insert_header(("idempotency-key", key));
    }
    match app.call(req.to_request()).await {
        Ok(response) => {
            let status = response.status();
            let replayed = response.headers().contains_key("idempotent-replayed");
            (status, replayed, test::read_body(response).await)
        }
        Err(error) => (
            error.as_response_error().status_code(),
            false,
            bytes::Bytes::new(),
        ),
    }
}

/// Round trips of a keyed miss besides the handler's statements: BEGIN (+ SET LOCAL), the
/// claim, the complete and COMMIT: 4, with nothing prepared again, and exactly one COMMIT on
/// the server (pg_stat_statements, in a throwaway cluster that preloads it). A replay costs
/// BEGIN, the claim and ROLLBACK.
#[actix_web::test]
async fn a_miss_is_four_round_trips_and_one_commit() {
    let started = block_on_fresh_thread(async {
        TempCluster::start(&["shared_preload_libraries = 'pg_stat_statements'"], &[])
    });
    // Only missing binaries are a skip: any other failure (pg_stat_statements not installed)
    // fails the test.
    let cluster = match started {
        Some(Ok(cluster)) => cluster,
        Some(Err(idempotency_e2e::ClusterError::NotInstalled)) => {
            idempotency_e2e::skip_without_binaries("a_miss_is_four_round_trips_and_one_commit");
            return;
        }
        Some(Err(e)) => panic!("starting a cluster with pg_stat_statements: {e}"),
        None => panic!("the cluster's thread failed"),
    };
    let url = cluster.url();
    run_migrations(&url).await.unwrap();
    execute(&url, "CREATE EXTENSION pg_stat_statements");
    let proxy = PgProxy::for_url(&url).await.unwrap();
    let store = PostgresStore::builder(proxy.url_through(&url))
        .max_size(1)
        .build()
        .await
        .unwrap();
    let middleware = Idempotency::builder(store.clone())
        .tenant_header("x-account-id")
        .transactional()
        .build();
    let app = test::init_service(
        App::new().service(
            web::scope("")
                .wrap(middleware)
                .route("/payments", web::post().to(nothing)),
        ),
    )
    .await;
    // Warm-up: the claim and complete statements prepared on the one connection.
    assert_eq!(send(&app, Some("warm"), "t").await.0, StatusCode::CREATED);

    execute(&url, "SELECT pg_stat_statements_reset()");
    let before = proxy.counts();
    let (status, replayed, _) = send(&app, Some("k1"), "t").await;
    let miss = proxy.counts().since(&before);
    assert_eq!(status, StatusCode::CREATED);
    assert!(!replayed);
    println!("transactional miss: {miss:?}");
    assert_eq!(miss.round_trips(), 4, "{miss:?}");
    assert_eq!(miss.get(b'P'), 0, "nothing prepared again: {miss:?}");
    assert_eq!(
        miss.get(b'Q'),
        2,
        "BEGIN and COMMIT as simple queries: {miss:?}"
    );
    let commits = count(
        &url,
        "SELECT coalesce(sum(calls), 0)::bigint AS n FROM pg_stat_statements \
         WHERE query ILIKE 'commit%'",
    );
    assert_eq!(commits, 1, "one COMMIT per miss");

    let before = proxy.counts();
    let (status, replayed, _) = send(&app, Some("k1"), "t").await;
    let replay = proxy.counts().since(&before);
    assert_eq!(status, StatusCode::CREATED);
    assert!(replayed);
    println!("transactional replay: {replay:?}");
    assert_eq!(replay.round_trips(), 3, "{replay:?}");
    drop(app);
    drop(store);
    drop(cluster);
}

/// Exactly once across two app instances (two pools, two middlewares) on one database: many
/// concurrent requests over 2000 keys, each sent to both instances at once and retried on
/// 409/503 until answered; then rows in `payments` = keys = completed records, and every
/// further retry is a replay of the one committed response.
#[actix_web::test]
async fn exactly_once_across_two_instances() {
    const KEYS: usize = 2000;
    const BATCH: usize = 50;
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let mut apps = Vec::new();
    for _ in 0..2 {
        let store = PostgresStore::builder(db.url.clone())
            .max_size(8)
            .build()
            .await
            .unwrap();
        let middleware = Idempotency::builder(store)
            .tenant_header("x-account-id")
            .transactional()
            .build();
        apps.push(
            test::init_service(
                App::new().service(
                    web::scope("")
                        .wrap(middleware)
                        .route("/payments", web::post().to(insert_payment)),
                ),
            )
            .await,
        );
    }
    let mut first_bodies: HashMap<String, bytes::Bytes> = HashMap::new();
    let keys: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();
    for batch in keys.chunks(BATCH) {
        let calls = batch.iter().flat_map(|key| {
            apps.iter().map(move |app| async move {
                loop {
                    let (status, replayed, body) = send(app, Some(key), "acct").await;
                    match status {
                        StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        StatusCode::CREATED => return (key.clone(), replayed, body),
                        other => panic!("{key}: unexpected {other}"),
                    }
                }
            })
        });
        for (key, replayed, body) in join_all(calls).await {
            if !replayed {
                let earlier = first_bodies.insert(key.clone(), body);
                assert!(earlier.is_none(), "{key} ran twice");
            }
        }
    }
    assert_eq!(first_bodies.len(), KEYS, "every key ran once");
    assert_eq!(
        count(&db.url, "SELECT count(*) AS n FROM payments"),
        KEYS as i64
    );
    assert_eq!(
        count(
            &db.url,
            "SELECT count(DISTINCT idempotency_key) AS n FROM payments"
        ),
        KEYS as i64
    );
    let records = records(&db.url);
    assert_eq!(records.len(), KEYS);
    assert!(records.iter().all(|r| r.state == State::Completed));
    // Every retry, on either instance, replays the committed response.
    for (i, key) in keys.iter().enumerate().step_by(7) {
        let (status, replayed, body) = send(&apps[i % 2], Some(key), "acct").await;
        assert_eq!(status, StatusCode::CREATED);
        assert!(replayed, "{key}");
        assert_eq!(Some(&body), first_bodies.get(key), "{key}");
    }
}

/// Row-level security: connected as a role that is neither superuser nor owner (both bypass
/// RLS), a handler reading `payments` under a tenant policy sees only its tenant's rows,
/// because the middleware sets `app.tenant_id` on the transaction. The optional policy on
/// `idempotency_keys` (docs/transactional.md) is on too: records, replays and 422 still work,
/// and each tenant's records are invisible to the other.
#[actix_web::test]
async fn rls_handler_sees_only_its_tenant() {
    let db = TestDb::new().await;
    execute(&db.url, PAYMENTS);
    let role = TempRole::create(&idempotency_e2e::server_url(), "idem_rls");
    execute(
        &db.url,
        &format!(
            "INSERT INTO payments (tenant_id, amount) VALUES ('a', 1), ('a', 2), ('b', 3), \
                 ('b', 4), ('b', 5);
             ALTER TABLE payments ENABLE ROW LEVEL SECURITY;
             CREATE POLICY tenant_isolation ON payments
                 USING (tenant_id = current_setting('app.tenant_id', true))
                 WITH CHECK (tenant_id = current_setting('app.tenant_id', true));
             GRANT SELECT, INSERT, UPDATE, DELETE ON payments, idempotency_keys TO \"{0}\";
             GRANT USAGE ON SEQUENCE payments_id_seq TO \"{0}\";
             DO $$ DECLARE t text; BEGIN
                 -- The tables that hold the records: idempotency_keys, or on the rotated
                 -- layout (IDEM_TEST_LAYOUT=rotated, where idempotency_keys is a view that
                 -- reads them with the invoker's rights, PostgreSQL 15 on) its three
                 -- generation tables.
                 FOREACH t IN ARRAY CASE WHEN to_regclass('idempotency_generation') IS NULL
                     THEN ARRAY['idempotency_keys']
                     ELSE ARRAY['idempotency_keys_0', 'idempotency_keys_1', 'idempotency_keys_2']
                 END LOOP
                     EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
                     EXECUTE format('CREATE POLICY tenant_isolation ON %I
                         USING (tenant = current_setting(''app.tenant_id'', true))
                         WITH CHECK (tenant = current_setting(''app.tenant_id'', true))', t);
                     EXECUTE format('GRANT SELECT, INSERT, UPDATE, DELETE ON %I TO %I', t, '{0}');
                 END LOOP;
                 IF to_regclass('idempotency_generation') IS NOT NULL THEN
                     GRANT SELECT, UPDATE (singleton) ON idempotency_generation TO \"{0}\";
                 END IF;
                 -- The partitioned layout (IDEM_TEST_LAYOUT=partitioned) keeps the responses
                 -- in a second table, read by token: no tenant column, so no policy of its own.
                 IF to_regclass('idempotency_responses') IS NOT NULL THEN
                     GRANT SELECT, INSERT ON idempotency_responses TO \"{0}\";
                 END IF;
             END $$;",
            role.name
        ),
    );
    let store = PostgresStore::connect(&role.url_for(&db.url))
        .await
        .unwrap();
    let middleware = Idempotency::builder(store.clone())
        .tenant_header("x-account-id")
        .transactional()
        .build();
    let app = test::init_service(
        App::new().service(
            web::scope("")
                .wrap(middleware)
                .route("/payments", web::post().to(visible)),
        ),
    )
    .await;
    let json = |body: &bytes::Bytes| serde_json::from_slice::<serde_json::Value>(body).unwrap();
    let (status, _, body) = send(&app, Some("k"), "a").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(json(&body)["visible"], 2);
    let (status, replayed, body) = send(&app, Some("k"), "b").await;
    assert_eq!(status, StatusCode::OK);
    assert!(!replayed, "another tenant's key is another record");
    assert_eq!(json(&body)["visible"], 3);
    let (_, replayed, body) = send(&app, Some("k"), "a").await;
    assert!(replayed);
    assert_eq!(json(&body)["visible"], 2);
    // Keyless: the tenant is set too.
    let (_, _, body) = send(&app, None, "b").await;
    assert_eq!(json(&body)["visible"], 3);
    // The role itself, outside the middleware's transactions, sees no payments at all.
    assert_eq!(
        count(&role.url_for(&db.url), "SELECT count(*) AS n FROM payments"),
        0
    );
    // As the owner (bypasses RLS): both tenants' records exist.
    assert_eq!(
        count(&db.url, "SELECT count(*) AS n FROM idempotency_keys"),
        2
    );
    drop(app);
    drop(store);
    drop(db);
    drop(role);
}
