#!/usr/bin/env bash
# fuzz/run.sh [SECONDS] — builds every fuzz target and runs each for SECONDS (default 180) from its
# seed corpus; exit 1 if any target crashed (the input is kept in fuzz/artifacts/<target>/).
#
# No cargo-fuzz and no nightly: the targets are built by plain cargo with the instrumentation
# flags `cargo fuzz build -s none` would pass (SanitizerCoverage through LLVM, `--cfg fuzzing`), and
# each binary is libFuzzer itself. No sanitizer: rtune's parsers are safe Rust, so what is sought
# is a panic, an abort, a hang (-timeout) or runaway memory (-rss_limit_mb).
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-180}
targets=(config jsonl preference adapter safetensors_index chat_template gguf_metadata)
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps RUSTFLAGS off the build scripts and proc macros (as cargo fuzz does).
host=$(rustc -vV | sed -n 's/^host: //p')
cargo build --release --locked --target "$host" --target-dir target/fuzz "${targets[@]/#/--bin=}"
failed=0
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t" "artifacts/$t"
  cp -n seeds/$t/* "corpus/$t/" 2>/dev/null || true
  if ! "target/fuzz/$host/release/$t" "corpus/$t" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="artifacts/$t/" -print_final_stats=0 >"artifacts/$t.log" 2>&1; then
    failed=1
    echo "fuzz: $t FAILED:"; grep -E "panicked|ERROR|SUMMARY|timeout|out-of-memory" "artifacts/$t.log" | head -20
  fi
  echo "fuzz: $t: $(grep -oE '^#[0-9]+' "artifacts/$t.log" | tail -1 | tr -d '#') runs in ${secs} s, $(ls "artifacts/$t" | wc -l) crash artifact(s)"
done
exit $failed
