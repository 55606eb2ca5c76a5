#!/usr/bin/env bash
# fuzz/run.sh [SECONDS] — runs each fuzz target for SECONDS (default 180) from the seed corpus.
# cargo fuzz needs nightly features; RUSTC_BOOTSTRAP=1 lets the stable toolchain provide them.
# `-s none`: no sanitizer (rtune's parsers are safe Rust; what is sought is a panic or a hang).
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-180}
for t in config jsonl adapter; do
  mkdir -p "corpus/$t" "artifacts/$t"
  cp -n seeds/$t/* "corpus/$t/"
  RUSTC_BOOTSTRAP=1 cargo fuzz run -s none "$t" "corpus/$t" -- -max_total_time="$secs" -timeout=10 \
    -artifact_prefix="artifacts/$t/" 2>&1 | grep -E "^(#[0-9]+ +DONE|Done|==|SUMMARY|.*panicked)" || true
  echo "$t: $(ls "artifacts/$t" | wc -l) crash artifact(s)"
done
