#!/usr/bin/env bash
# benches/gpu/e2e.sh — what a user runs, on the card: one device call after run.sh.
#
#   device run: command "bash benches/gpu/e2e.sh", carry ["benches/gpu/bin"], timeout_s 300
#
# 1. The README's main job (configs/smoke.toml: the embedded tiny Llama 3, 150 steps, f32) with
#    `train.device = "cuda:0"`, then the same on the machine's CPU with the same binary; the two
#    adapters compared tensor by tensor (relative Frobenius distance) and their last losses printed;
#    `rtune generate` (CPU) with the CUDA-trained adapter must print the memorised answer.
# 2. The same job as QLoRA: bf16 compute over an NF4 base on the card; generate with `--quantize nf4`.
# 3. `rtune check` on the card: every pre-flight check, stop/resume/identical adapter included.
# 4. Benches of the variants run.sh leaves out: DoRA, f16, double-quantized NF4 (bench-small widths).
# Everything prints; $OUT/e2e.log holds it all. Exit 1 if any part failed. DEVICE=cpu tries the
# script here (RTUNE=target/release/rtune PYTHON=a python with numpy and safetensors).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/runs/gpu-e2e}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
. benches/gpu/env.sh
DEV=${DEVICE:-cuda:0}
W=/tmp/e2e
rm -rf "$W"
mkdir -p "$W"
failed=0
# part NAME LIMIT CMD...: one command under a time limit, its outcome printed.
part() {
  local name=$1 limit=$2 rc=0 t0=$SECONDS
  shift 2
  echo; echo "=== $name (at ${SECONDS}s): $* ==="
  timeout -k 5 "$limit" "$@" || rc=$?
  echo "=== $name: rc $rc after $((SECONDS - t0))s ==="
  [ $rc -eq 0 ] || failed=1
}
answer() {  # answer NAME ADAPTER [ARGS...]: greedy continuation of a memorised prompt.
  local name=$1 adapter=$2 got
  shift 2
  got=$("$RTUNE" generate --model tests/fixtures/tiny-llama3 --adapter "$adapter" "$@" \
    --prompt $'Q: Who makes Zephyr?\nA:' --max-new-tokens 32 2>/dev/null | head -1)
  echo "$name generate: ${got@Q}"
  case $got in *"Nimbus Labs, Oslo."*) echo "$name generate: PASS" ;; *) echo "$name generate: FAIL"; failed=1 ;; esac
}

main() {
  echo "rtune end-to-end on the card $(date -u +%FT%TZ), git $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  local smoke=(train --config configs/smoke.toml --set output.save_every=0)
  part "train f32 cuda" 90 "$RTUNE" "${smoke[@]}" --set train.device=$DEV --set output.dir=$W/cuda
  part "train f32 cpu" 90 "$RTUNE" "${smoke[@]}" --set train.device=cpu --set output.dir=$W/cpu
  "$PY" - "$W/cuda" "$W/cpu" <<'PY' || failed=1
import json, sys
from safetensors.numpy import load_file
a, b = (load_file(f"{d}/adapter_model.safetensors") for d in sys.argv[1:3])
worst = max((float(((a[k] - b[k]) ** 2).sum() ** 0.5 / max(float((b[k] ** 2).sum() ** 0.5), 1e-30)), k) for k in b)
last = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")][-1], [json.loads(l) for l in open(f"{sys.argv[2]}/metrics.jsonl")][-1]
print(f"adapters cuda vs cpu: {len(b)} tensors, keys equal {sorted(a) == sorted(b)}, worst relative distance {worst[0]:.3e} ({worst[1]})")
print(f"last loss: cuda {last[0]['loss']:.6f} (step {last[0]['step']}), cpu {last[1]['loss']:.6f} (step {last[1]['step']})")
print("cuda steps/s:", round(last[0]["step"] / last[0]["elapsed_s"], 1), " cpu steps/s:", round(last[1]["step"] / last[1]["elapsed_s"], 1))
PY
  answer "f32 cuda" "$W/cuda"
  part "train qlora bf16 cuda" 90 "$RTUNE" "${smoke[@]}" --set train.device=$DEV --set output.dir=$W/qlora \
    --set model.dtype=bf16 --set model.quantize=nf4
  tail -1 "$W/qlora/metrics.jsonl"
  answer "qlora bf16 cuda" "$W/qlora" --quantize nf4
  part "check cuda" 120 "$RTUNE" check --config configs/smoke.toml --set train.device=$DEV \
    --set output.dir=$W/check
  local b=(bench --device $DEV --preset bench-small --seq 256 --steps 3 --warmup 1 --no-ceiling)
  part "bench dora bf16" 40 "$RTUNE" "${b[@]}" --dtype bf16 --dora
  part "bench f16" 40 "$RTUNE" "${b[@]}" --dtype f16
  part "bench bf16 nf4-dq" 40 "$RTUNE" "${b[@]}" --dtype bf16 --quantize nf4-dq --gradient-checkpointing
  echo "total ${SECONDS}s, failed=$failed"
  return $failed
}
main 2>&1 | tee "$OUT/e2e.log"
exit "${PIPESTATUS[0]}"
