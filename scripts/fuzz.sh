#!/usr/bin/env bash
# Bounded fuzzing of the parsers that read untrusted bytes (issue 6): the Idempotency-Key
# parser, the JSON canonicaliser and the stored-response header decoder.
#
#   scripts/fuzz.sh            # each target for 60 s
#   scripts/fuzz.sh 300        # each target for 300 s
#   scripts/fuzz.sh 30 canonical_json    # one target
#
# Needs cargo-fuzz (installed on first use from crates.io). cargo-fuzz needs nightly
# features; on a stable toolchain RUSTC_BOOTSTRAP=1 unlocks them. The sanitizer defaults to
# none: the library is `#![forbid(unsafe_code)]`, so libFuzzer's crash, panic, timeout and
# memory checks are what matter; set FUZZ_SANITIZER=address to build with ASan anyway.
# Not part of `cargo test`: the corpus (fuzz/corpus) and any crash (fuzz/artifacts) stay
# local and are git-ignored. Turn every crash into a regression test (see
# idempotency-actix/tests/properties.rs) before fixing it.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=(key_parser canonical_json decode_headers)
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1

options_for() {
  case "$1" in
    key_parser) echo "-max_len=1024 -dict=fuzz/dicts/key.dict" ;;
    canonical_json) echo "-max_len=65536 -dict=fuzz/dicts/json.dict" ;;
    *) echo "-max_len=4096" ;;
  esac
}

status=0
for target in "${targets[@]}"; do
  printf '\n==> fuzzing %s for %ss\n' "$target" "$seconds"
  mkdir -p "fuzz/corpus/$target"
  # -timeout: a single input taking over 10 s is reported (quadratic blow-ups);
  # -rss_limit_mb: an input that makes the parser allocate wildly is reported.
  # shellcheck disable=SC2046
  if ! cargo fuzz run --sanitizer "${FUZZ_SANITIZER:-none}" "$target" -- \
      -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      $(options_for "$target"); then
    echo "fuzz target $target FAILED: see fuzz/artifacts/$target/" >&2
    status=1
  fi
done
exit "$status"
