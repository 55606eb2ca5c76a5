#!/usr/bin/env bash
# benches/gpu/probe.sh — where an rtune step's time goes on the card: one device call after run.sh.
#
#   device run: command "bash benches/gpu/probe.sh", carry ["benches/gpu/bin"], timeout_s 420
#
# 1. Variants of the 8B QLoRA step on fewer layers (same widths; each `--no-ceiling`, 2 warm-up and
#    4 timed steps): the default, the plain attention, no checkpointing, a bf16 base (no NF4), twice
#    the layers (per-layer cost = the difference), 4 rows of 512 (the same tokens, attention / 4).
#    One line each in $OUT/variants.tsv: name, tokens/s, median step s, peak device MB.
# 2. Nsight Compute's per-kernel GPU time (`gpu__time_duration.sum`, one replay pass, clocks left
#    alone) over one step of a 2-layer model at the same widths: $OUT/ncu.csv. Their sum against
#    the step's wall time says whether the step is GPU-bound or waits on the host.
# Env: RTUNE (benches/gpu/bin/rtune, unpacked from .xz as run.sh does), PROBE_BUDGET_S (360).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/runs/gpu-probe}
mkdir -p "$OUT"
BUDGET=${PROBE_BUDGET_S:-360}
PY=${PYTHON:-python3}
. benches/gpu/env.sh

W=(--preset llama3-8b --dtype bf16 --r 16 --steps 4 --warmup 2 --no-ceiling)
# variant NAME ENV... -- ARGS...: one bench, one line in variants.tsv.
variant() {
  local name=$1 envs=() left=$((BUDGET - SECONDS))
  shift
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  [ "$left" -lt 20 ] && { echo "$name: skipped, budget spent"; return; }
  echo "=== $name (at ${SECONDS}s): ${envs[*]} $* ==="
  env "${envs[@]}" timeout -k 5 $((left < 60 ? left : 60)) "$RTUNE" bench --device cuda:0 "${W[@]}" "$@" \
    --json-out "$OUT/v_$name.json" 2>&1 | grep -E '^(step|rtune bench|memory)|rror' || true
  "$PY" - "$OUT/v_$name.json" "$name" >> "$OUT/variants.tsv" <<'PY' || echo "$name: no result"
import json, sys
j = json.load(open(sys.argv[1]))
print(sys.argv[2], round(j["tokens_per_s"], 1), j.get("step_s_median"), round((j.get("peak_memory_bytes") or 0) / 1e6), sep="\t")
PY
}
variant l8 -- --layers 8 --quantize nf4 --gradient-checkpointing
variant l16 -- --layers 16 --quantize nf4 --gradient-checkpointing
variant l8_plain RTUNE_ATTN=plain -- --layers 8 --quantize nf4 --gradient-checkpointing
variant l8_nockpt -- --layers 8 --quantize nf4
variant l8_bf16base -- --layers 8 --gradient-checkpointing
variant l8_seq512x4 -- --layers 8 --quantize nf4 --gradient-checkpointing --seq 512 --batch 4
echo; cat "$OUT/variants.tsv"

# 2. Nsight Compute: one step, 2 layers (+ the bench's own warm-up step, which ncu also times).
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
left=$((BUDGET - SECONDS - 10))
if [ -n "$ncu" ] && [ "$left" -gt 30 ]; then
  echo "=== ncu (at ${SECONDS}s, limit ${left}s): $ncu ==="
  timeout -k 5 "$left" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
    --log-file "$OUT/ncu.csv" "$RTUNE" bench --device cuda:0 --preset llama3-8b --dtype bf16 --r 16 --layers 2 \
    --quantize nf4 --gradient-checkpointing --steps 1 --warmup 1 --no-ceiling > "$OUT/ncu_bench.log" 2>&1
  echo "ncu rc $?; $(wc -l < "$OUT/ncu.csv") lines"; tail -3 "$OUT/ncu_bench.log"
  xz -T0 -f "$OUT/ncu.csv"
else
  echo "ncu: not found or no time left (${left}s)"
fi
echo "total ${SECONDS}s"
