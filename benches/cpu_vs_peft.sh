#!/usr/bin/env bash
# benches/cpu_vs_peft.sh — rtune vs PEFT, bench-small, CPU, one after the other.
# PYTHON: a python with torch/transformers/peft (default: python3); PEFT_BENCH: path of bench_peft_cpu.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PEFT_BENCH=${PEFT_BENCH:-../shared/reference/bench_peft_cpu.py}
out=${OUT:-runs/bench}
mkdir -p "$out"
cargo build --release --quiet
./target/release/rtune bench --json-out "$out/rtune.json"
./target/release/rtune bench --gradient-checkpointing --json-out "$out/rtune_ckpt.json"
"$PYTHON" "$PEFT_BENCH" --json-out "$out/peft.json" > "$out/peft.log" 2>&1 || { cat "$out/peft.log"; exit 1; }
"$PYTHON" - "$out" <<'PY'
import json, sys
d = sys.argv[1]
r, c, p = (json.load(open(f"{d}/{n}.json")) for n in ("rtune", "rtune_ckpt", "peft"))
# Medians on both sides (these machines are noisy).
ptok = p["config"]["batch"] * p["config"]["seq"] / p["step_s_median"]; prss = p["peak_rss_mb"] * 1e6
for name, x in (("rtune", r), ("rtune + checkpointing", c)):
    print(f"{name:24s} {x['tokens_per_s']:8.1f} tok/s ({x['tokens_per_s']/ptok:.2f}x PEFT)   "
          f"peak RSS {x['peak_rss_bytes']/1e9:.2f} GB ({x['peak_rss_bytes']/prss:.2f}x PEFT)")
print(f"{'PEFT':24s} {ptok:8.1f} tok/s            peak RSS {prss/1e9:.2f} GB   (effective cores {p['effective_cores']})")
PY
