//! `idem-cli migrate --partitioned` on a schema dropped by hand: refused as dropped, before
//! anything is applied (a review of the fixes of 2026-12-05).

use std::process::{Command, Output, Stdio};

use diesel_async::SimpleAsyncConnection;
use idempotency_actix::store::postgres;
use idempotency_e2e::TestDb;

const BIN: &str = env!("CARGO_BIN_EXE_idem-cli");

fn idem(url: &str, args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .env("DATABASE_URL", url)
        .env_remove("REDIS_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run idem-cli")
}

fn show(out: &Output) -> String {
    format!(
        "code {:?}\nstdout: {}\nstderr: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A schema dropped by hand (every migration recorded as applied, the tables gone): `idem-cli
/// migrate` exits 4 pointing at docs/operations.md, "A schema dropped by hand". With
/// `--partitioned` the new check before applying reads "no `idempotency_responses`" as "the
/// plain layout" and exits 1 with "the database already has the plain layout ... see
/// docs/operations.md for moving a deployment", even on a database that had the partitioned
/// layout until its tables were dropped (the first step docs/operations.md gives for leaving
/// or re-provisioning it). Before 795352d the refusal came after the dropped-by-hand check.
#[tokio::test]
async fn migrate_partitioned_on_a_schema_dropped_by_hand_says_dropped_by_hand() {
    let mut seen = Vec::new();
    for partitioned in [false, true] {
        let db = TestDb::new_unmigrated().await;
        let args: &[&str] = if partitioned {
            &["migrate", "--partitioned"]
        } else {
            &["migrate"]
        };
        let out = idem(&db.url, args);
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        let mut conn = postgres::establish(&db.url).await.unwrap();
        let drop = if partitioned {
            "DROP TABLE idempotency_keys, idempotency_responses, idempotency_partitioning"
        } else {
            "DROP TABLE idempotency_keys"
        };
        conn.batch_execute(drop).await.unwrap();
        let plain = idem(&db.url, &["migrate"]);
        let part = idem(&db.url, &["migrate", "--partitioned"]);
        println!(
            "provisioned partitioned={partitioned}\n migrate: {}\n migrate --partitioned: {}",
            show(&plain),
            show(&part)
        );
        assert_eq!(plain.status.code(), Some(4), "{}", show(&plain));
        seen.push((partitioned, show(&part), part.status.code()));
    }
    let wrong: Vec<_> = seen
        .iter()
        .filter(|(_, _, code)| *code != Some(4))
        .collect();
    assert!(
        wrong.is_empty(),
        "migrate --partitioned on a schema dropped by hand does not say so: {wrong:#?}"
    );
}

/// The same when what was dropped is a function the store calls (here `idempotency_release`,
/// migration 000015), or, on the partitioned layout, only its response table: every command
/// that reads the layout says "dropped by hand" (exit 4), not "the database already has the
/// plain layout" (exit 1), which the first version of the table-only check before applying
/// answered to `migrate --partitioned` (review of 2026-12-07).
#[tokio::test]
async fn a_function_or_the_response_table_dropped_by_hand_says_dropped_by_hand() {
    let cases: [(&[&str], &str); 3] = [
        (
            &["migrate"],
            "DROP FUNCTION idempotency_release(text, text, text, text, uuid)",
        ),
        (
            &["migrate", "--partitioned"],
            "DROP FUNCTION idempotency_release(text, text, text, text, uuid)",
        ),
        (
            &["migrate", "--partitioned"],
            "DROP TABLE idempotency_responses",
        ),
    ];
    for (provision, drop) in cases {
        let db = TestDb::new_unmigrated().await;
        let out = idem(&db.url, provision);
        assert_eq!(out.status.code(), Some(0), "{}", show(&out));
        let mut conn = postgres::establish(&db.url).await.unwrap();
        conn.batch_execute(drop).await.unwrap();
        for args in [
            &["migrate"][..],
            &["migrate", "--partitioned"],
            &["migrate", "--check"],
        ] {
            let out = idem(&db.url, args);
            assert_eq!(
                out.status.code(),
                Some(4),
                "{provision:?} then {drop}; {args:?}: {}",
                show(&out)
            );
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("A schema dropped by hand"),
                "{args:?}: {}",
                show(&out)
            );
        }
    }
}
