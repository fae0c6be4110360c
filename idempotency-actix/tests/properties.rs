//! Property tests (proptest) for the parsers and encoders the contract rests on:
//! - the JSON canonicaliser is idempotent, never panics, and ignores object member order and
//!   insignificant whitespace and escapes (C4);
//! - fingerprints differ whenever method, path, query or body differ (C4, no delimiter
//!   ambiguity);
//! - keys: sf-string serialise/parse round-trips, and the parser never accepts what the
//!   contract forbids (C2);
//! - the stored-response header encoding round-trips and its decoder never panics.
//!
//! Regression cases found by fuzzing (`scripts/fuzz.sh`) are pinned at the end.

use bytes::Bytes;
use idempotency_actix::internals::{canonical_json, MAX_JSON_DEPTH};
use idempotency_actix::internals::{parse_key, to_sf_string, KeyError};
use idempotency_actix::store::StoredResponse;
use idempotency_actix::Fingerprint;
use proptest::prelude::*;

// ---------------------------------------------------------------------------------------------
// JSON documents

/// A JSON value whose objects have distinct keys (so member order carries no meaning).
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    /// Kept as text, as the canonicaliser keeps it.
    Num(String),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

fn number() -> impl Strategy<Value = String> {
    (
        any::<bool>(),
        prop_oneof![Just("0".to_owned()), "[1-9][0-9]{0,20}"],
        proptest::option::of("[0-9]{1,6}"),
        proptest::option::of(("[eE]", "[+-]?", "[0-9]{1,2}")),
    )
        .prop_map(|(neg, int, frac, exp)| {
            let mut n = String::new();
            if neg {
                n.push('-');
            }
            n.push_str(&int);
            if let Some(frac) = frac {
                n.push('.');
                n.push_str(&frac);
            }
            if let Some((e, sign, digits)) = exp {
                n.push_str(&e);
                n.push_str(&sign);
                n.push_str(&digits);
            }
            n
        })
}

fn text() -> impl Strategy<Value = String> {
    // Any chars, including controls, quotes, backslashes and astral-plane characters.
    proptest::collection::vec(any::<char>(), 0..8).prop_map(|c| c.into_iter().collect())
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        number().prop_map(Json::Num),
        text().prop_map(Json::Str),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Json::Arr),
            proptest::collection::btree_map(text(), inner, 0..6)
                .prop_map(|m| Json::Obj(m.into_iter().collect())),
        ]
    })
}

/// How to write a document: whitespace, escapes and member order are free choices.
#[derive(Debug, Clone, Copy)]
struct Style {
    seed: u64,
}

impl Style {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.seed = self.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn ws(&mut self, out: &mut String) {
        const WS: [&str; 6] = ["", "", " ", "\n", "\t ", "\r\n  "];
        out.push_str(WS[(self.next() % WS.len() as u64) as usize]);
    }

    fn string(&mut self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            let escape = self.next() % 4 == 0;
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if (c as u32) < 0x20 || escape => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        if self.next() % 2 == 0 {
                            out.push_str(&format!("\\u{unit:04x}"));
                        } else {
                            out.push_str(&format!("\\u{unit:04X}"));
                        }
                    }
                }
                '/' if self.next() % 2 == 0 => out.push_str("\\/"),
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn write(&mut self, value: &Json, shuffle: bool, out: &mut String) {
        self.ws(out);
        match value {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Num(n) => out.push_str(n),
            Json::Str(s) => self.string(s, out),
            Json::Arr(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    self.write(item, shuffle, out);
                }
                self.ws(out);
                out.push(']');
            }
            Json::Obj(members) => {
                let mut order: Vec<usize> = (0..members.len()).collect();
                if shuffle {
                    for i in (1..order.len()).rev() {
                        let j = (self.next() % (i as u64 + 1)) as usize;
                        order.swap(i, j);
                    }
                }
                out.push('{');
                for (n, i) in order.into_iter().enumerate() {
                    if n > 0 {
                        out.push(',');
                    }
                    self.ws(out);
                    self.string(&members[i].0, out);
                    self.ws(out);
                    out.push(':');
                    self.write(&members[i].1, shuffle, out);
                }
                self.ws(out);
                out.push('}');
            }
        }
        self.ws(out);
    }

    fn render(mut self, value: &Json, shuffle: bool) -> String {
        let mut out = String::new();
        self.write(value, shuffle, &mut out);
        out
    }
}

fn canon(text: &str) -> Vec<u8> {
    canonical_json(text.as_bytes())
        .unwrap_or_else(|| panic!("valid JSON was not canonicalised: {text:?}"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn canonicalisation_is_idempotent(value in json(), seed in any::<u64>()) {
        let text = Style { seed }.render(&value, false);
        let once = canon(&text);
        let twice = canonical_json(&once).expect("canonical output is JSON");
        prop_assert_eq!(&once, &twice);
        // And it is what serde_json would call the same document.
        let ours: serde_json::Value = serde_json::from_slice(&once).expect("serde parses it");
        let theirs: serde_json::Value = serde_json::from_str(&text).expect("serde parses the input");
        prop_assert_eq!(ours, theirs);
    }

    #[test]
    fn canonicalisation_ignores_member_order_whitespace_and_escapes(
        value in json(),
        a in any::<u64>(),
        b in any::<u64>(),
    ) {
        let first = Style { seed: a }.render(&value, true);
        let second = Style { seed: b }.render(&value, true);
        prop_assert_eq!(canon(&first), canon(&second), "{} vs {}", first, second);
        let fp = |t: &str| Fingerprint::of_request("POST", "/p", "", true, t.as_bytes());
        prop_assert_eq!(fp(&first), fp(&second));
    }

    #[test]
    fn canonicaliser_never_panics_and_is_idempotent_on_any_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        if let Some(once) = canonical_json(&bytes) {
            prop_assert_eq!(canonical_json(&once), Some(once.clone()));
        }
    }

    #[test]
    fn canonicaliser_never_panics_on_json_like_noise(
        text in r#"[\[\]{}",:0-9.eE+\- tfalsenu\\/]{0,64}"#,
    ) {
        if let Some(once) = canonical_json(text.as_bytes()) {
            prop_assert_eq!(canonical_json(&once), Some(once.clone()));
        }
    }

    #[test]
    fn different_documents_have_different_fingerprints(x in json(), y in json()) {
        let (tx, ty) = (Style { seed: 1 }.render(&x, false), Style { seed: 2 }.render(&y, false));
        let (cx, cy) = (canon(&tx), canon(&ty));
        let fx = Fingerprint::of_request("POST", "/p", "", true, tx.as_bytes());
        let fy = Fingerprint::of_request("POST", "/p", "", true, ty.as_bytes());
        prop_assert_eq!(cx == cy, fx == fy);
    }

    #[test]
    fn fingerprints_differ_when_any_part_differs(
        a in request_parts(),
        b in request_parts(),
    ) {
        let fa = Fingerprint::of_request(&a.0, &a.1, &a.2, false, &a.3);
        let fb = Fingerprint::of_request(&b.0, &b.1, &b.2, false, &b.3);
        prop_assert_eq!(a == b, fa == fb);
    }

    #[test]
    fn moving_bytes_between_parts_changes_the_fingerprint(
        parts in request_parts(),
        moved in "[a-z=&/?]{1,8}",
        which in 0usize..3,
    ) {
        let (method, path, query, body) = parts;
        let base = Fingerprint::of_request(&method, &format!("{path}{moved}"), &query, false, &body);
        let other = match which {
            0 => Fingerprint::of_request(&method, &path, &format!("{moved}{query}"), false, &body),
            1 => {
                let mut b = moved.clone().into_bytes();
                b.extend_from_slice(&body);
                Fingerprint::of_request(&method, &path, &query, false, &b)
            }
            _ => Fingerprint::of_request(&format!("{method}{moved}"), &path, &query, false, &body),
        };
        prop_assert_ne!(base, other);
    }

    #[test]
    fn json_and_raw_bodies_never_share_a_fingerprint(value in json()) {
        let text = Style { seed: 7 }.render(&value, false);
        let canonical = canon(&text);
        let as_json = Fingerprint::of_request("POST", "/p", "", true, text.as_bytes());
        let as_raw = Fingerprint::of_request("POST", "/p", "", false, &canonical);
        prop_assert_ne!(as_json, as_raw);
    }

    // ---- keys ---------------------------------------------------------------------------

    #[test]
    fn sf_strings_round_trip(key in "[ -~]{1,255}") {
        let serialised = to_sf_string(&key).expect("printable ASCII is serialisable");
        prop_assert_eq!(parse_key(serialised.as_bytes(), 255), Ok(key));
    }

    #[test]
    fn bare_tokens_parse_as_themselves(key in "[!#-~][!-~]{0,254}") {
        prop_assert_eq!(parse_key(key.as_bytes(), 255), Ok(key));
    }

    #[test]
    fn parsed_keys_obey_the_contract(
        raw in proptest::collection::vec(any::<u8>(), 0..300),
        max in 1usize..300,
    ) {
        match parse_key(&raw, max) {
            Ok(key) => {
                prop_assert!(!key.is_empty());
                prop_assert!(key.len() <= max);
                prop_assert!(key.bytes().all(|b| (0x20..=0x7e).contains(&b)));
                // Whatever was accepted re-serialises to something that parses back to it.
                let again = to_sf_string(&key).expect("serialisable");
                prop_assert_eq!(parse_key(again.as_bytes(), max), Ok(key));
            }
            Err(KeyError::TooLong { max: m }) => prop_assert_eq!(m, max),
            Err(_) => {}
        }
    }

    #[test]
    fn keys_with_non_ascii_or_controls_are_rejected(
        prefix in "[a-z]{0,5}",
        bad in prop_oneof![0u8..0x20, Just(0x7f), 0x80u8..=0xff],
        suffix in "[a-z]{1,5}",
        quoted in any::<bool>(),
    ) {
        prop_assume!(bad != b' ' && bad != b'\t');
        let mut raw = Vec::new();
        if quoted { raw.push(b'"'); }
        raw.extend_from_slice(prefix.as_bytes());
        raw.push(bad);
        raw.extend_from_slice(suffix.as_bytes());
        if quoted { raw.push(b'"'); }
        prop_assert!(matches!(parse_key(&raw, 255), Err(KeyError::Malformed(_))), "{:?}", raw);
    }

    // ---- stored response headers -----------------------------------------------------

    #[test]
    fn stored_headers_round_trip(
        headers in proptest::collection::vec(
            ("[a-z][a-z0-9-]{0,20}", proptest::collection::vec(any::<u8>(), 0..40)),
            0..12,
        ),
    ) {
        let response = StoredResponse {
            status: 201,
            headers: headers.into_iter().map(|(n, v)| (n, Bytes::from(v))).collect(),
            body: Bytes::new(),
        };
        let encoded = response.encode_headers();
        prop_assert_eq!(StoredResponse::decode_headers(&encoded), Ok(response.headers.clone()));
        // Every strict prefix is an error, never a panic or a shorter list.
        for cut in 0..encoded.len() {
            prop_assert!(StoredResponse::decode_headers(&encoded[..cut]).is_err());
        }
    }

    #[test]
    fn header_decoder_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..128)) {
        let mut with_version = vec![1u8];
        with_version.extend_from_slice(&bytes);
        for input in [&bytes[..], &with_version[..]] {
            if let Ok(headers) = StoredResponse::decode_headers(input) {
                let again = StoredResponse { status: 200, headers, body: Bytes::new() };
                prop_assert_eq!(again.encode_headers(), input.to_vec());
            }
        }
    }
}

type Parts = (String, String, String, Vec<u8>);

fn request_parts() -> impl Strategy<Value = Parts> {
    (
        prop_oneof![
            Just("POST".to_owned()),
            Just("PATCH".to_owned()),
            "[A-Z]{1,6}"
        ],
        "/[a-z/]{0,6}",
        "[a-z=&]{0,6}",
        proptest::collection::vec(any::<u8>(), 0..6),
    )
}

// ---------------------------------------------------------------------------------------------
// Pinned cases

#[test]
fn depth_limit_is_exact_for_arrays_and_objects() {
    // The outermost value is at depth 0; a value deeper than MAX_JSON_DEPTH is not
    // canonicalised (and the raw bytes are hashed instead).
    let arrays = |d: usize| format!("{}{}", "[".repeat(d), "]".repeat(d));
    assert!(canonical_json(arrays(MAX_JSON_DEPTH + 1).as_bytes()).is_some());
    assert!(canonical_json(arrays(MAX_JSON_DEPTH + 2).as_bytes()).is_none());
    // d objects around a scalar put the scalar at depth d.
    let objects = |d: usize| format!("{}1{}", "{\"k\":".repeat(d), "}".repeat(d));
    assert!(canonical_json(objects(MAX_JSON_DEPTH).as_bytes()).is_some());
    assert!(canonical_json(objects(MAX_JSON_DEPTH + 1).as_bytes()).is_none());
    for deep in [arrays(1_000_000), objects(1_000_000)] {
        assert!(canonical_json(deep.as_bytes()).is_none());
    }
}

#[test]
fn unpaired_and_reversed_surrogates_are_not_json() {
    for bad in [
        r#""\ud800""#,
        r#""\udc00""#,
        r#""\udc00\ud800""#,
        r#""\ud800\u0041""#,
        r#""\ud800x""#,
        r#""\u+041""#,
        r#""\u-041""#,
        r#""\u004""#,
    ] {
        assert_eq!(canonical_json(bad.as_bytes()), None, "{bad}");
    }
    assert_eq!(
        canonical_json(r#""\ud83d\ude00""#.as_bytes()).as_deref(),
        Some("\"😀\"".as_bytes())
    );
}

#[test]
fn hex_escape_cut_inside_a_multibyte_character_is_rejected_not_a_panic() {
    // `\u` followed by fewer than four bytes of which one starts a multi-byte character:
    // slicing the text there must not panic.
    for bad in ["\"\\u00é\"", "\"\\ué\"", "\"\\u0é0\"", "\"\\u😀\""] {
        assert_eq!(canonical_json(bad.as_bytes()), None, "{bad}");
    }
}

#[test]
fn canonical_strings_escape_only_what_they_must() {
    let c = canonical_json(b"\"\\u007f\\u2028\\u0000\"").unwrap();
    assert_eq!(c, "\"\u{7f}\u{2028}\\u0000\"".as_bytes());
}
