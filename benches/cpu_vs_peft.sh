#!/usr/bin/env bash
# benches/cpu_vs_peft.sh — rtune vs PEFT on the CPU, bench-small, side by side.
#
# RUNS rounds (default 3); each round runs rtune, rtune with checkpointing, PEFT and PEFT with
# --grad-ckpt one after the other, so slow phases of a noisy machine hit both sides. Prints every
# run and the medians with their ratios. Extra arguments go to both benches (e.g. --seq 2048).
#
# PYTHON: a python with torch/transformers/peft (default: python3); PEFT_BENCH: path of
# bench_peft_cpu.py (default ../shared/reference/bench_peft_cpu.py); OUT: where the JSON goes.
# RTUNE_ARGS / PEFT_ARGS: extra arguments for one side only, e.g. the bf16 comparison
#   RTUNE_ARGS="--dtype bf16" PEFT_ARGS="--bf16-autocast" benches/cpu_vs_peft.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PEFT_BENCH=${PEFT_BENCH:-../shared/reference/bench_peft_cpu.py}
RUNS=${RUNS:-3}
STEPS=${STEPS:-6}
read -r -a rtune_args <<<"${RTUNE_ARGS:-}"
read -r -a peft_args <<<"${PEFT_ARGS:-}"
out=${OUT:-runs/bench}
mkdir -p "$out"
cargo build --release --quiet
for i in $(seq 1 "$RUNS"); do
  ./target/release/rtune bench --steps "$STEPS" "${rtune_args[@]}" "$@" --json-out "$out/rtune.$i.json" | grep '^rtune bench'
  ./target/release/rtune bench --steps "$STEPS" --gradient-checkpointing "${rtune_args[@]}" "$@" \
    --json-out "$out/rtune_ckpt.$i.json" | grep '^rtune bench'
  for mode in peft peft_ckpt; do
    flag=(); [ "$mode" = peft_ckpt ] && flag=(--grad-ckpt)
    "$PYTHON" "$PEFT_BENCH" --steps "$STEPS" "${flag[@]}" "${peft_args[@]}" "$@" --json-out "$out/$mode.$i.json" \
      > "$out/$mode.$i.log" 2>&1 || { cat "$out/$mode.$i.log"; exit 1; }
    echo "$mode run $i done"
  done
done
"$PYTHON" - "$out" "$RUNS" <<'PY'
import json, statistics, sys
d, runs = sys.argv[1], int(sys.argv[2])
load = lambda n: [json.load(open(f"{d}/{n}.{i}.json")) for i in range(1, runs + 1)]
r, rc, p, pc = load("rtune"), load("rtune_ckpt"), load("peft"), load("peft_ckpt")
# Tokens/s from the median step on both sides (these machines are noisy).
tok_r = lambda x: x["tokens_per_s"]
tok_p = lambda x: x["config"]["batch"] * x["config"]["seq"] / x["step_s_median"]
mem_r = lambda x: x["peak_rss_bytes"]
mem_p = lambda x: x["peak_rss_mb"] * 1e6
rows = [("rtune", r, tok_r, mem_r), ("rtune + checkpointing", rc, tok_r, mem_r),
        ("PEFT", p, tok_p, mem_p), ("PEFT --grad-ckpt", pc, tok_p, mem_p)]
med = {}
for name, xs, tok, mem in rows:
    ts, ms = [tok(x) for x in xs], [mem(x) for x in xs]
    med[name] = (statistics.median(ts), statistics.median(ms))
    print(f"{name:24s} tokens/s {' '.join(f'{t:7.1f}' for t in ts)}   median {med[name][0]:7.1f}"
          f"   peak RSS median {med[name][1]/1e9:.2f} GB")
pt, pm = med["PEFT"]
for name in ("rtune", "rtune + checkpointing"):
    t, m = med[name]
    print(f"{name:24s} {t/pt:.2f}x PEFT tokens/s, {m/pm:.2f}x PEFT peak RSS (medians)")
pct, pcm = med["PEFT --grad-ckpt"]
t, m = med["rtune + checkpointing"]
print(f"{'rtune + ckpt vs PEFT ckpt':24s} {t/pct:.2f}x tokens/s, {m/pcm:.2f}x peak RSS")
print(f"BLAS: {r[0].get('blas')}, PEFT effective cores: {[x['effective_cores'] for x in p]}")
PY
