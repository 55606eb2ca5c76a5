#!/usr/bin/env bash
# benches/grpo_memory.sh — a GRPO step's peak memory at several max_completion_length.
#
# The recipe's model and LoRA (configs/smollm2-135m-grpo.toml: SmolLM2-135M, r 16 all-linear,
# 2 prompts × 8 completions a step), STEPS steps (default 2) for each length in LENGTHS (default
# "64 256"), with plain-text prompts (no chat template: the model rarely ends a story, so the
# completions run to the limit; the mean length printed says how far they went) at temperature 1.
# Gradient checkpointing off at every length (its auto choice could differ between them).
# Prints, per length, the peak RSS of the run (summary.json), the mean completion length, and the
# growth per completion token between consecutive lengths (linear growth: the same figure).
# Needs a release build and scripts/fetch-smollm2.sh's model.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=${STEPS:-2}
lengths=${LENGTHS:-64 256}
bin=${RTUNE:-target/release/rtune}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$tmp/prompts.jsonl" <<'PY'
import json, sys
starts = ["Once upon a time, in a small village by the sea,", "The old lighthouse keeper opened the door and",
          "In the year 2150, the first city on Mars", "She found a strange map in her grandmother's attic;",
          "The train stopped in the middle of the forest and", "Every morning the baker woke before dawn to"]
with open(sys.argv[1], "w") as f:
    # "answer": the recipe's answer reward reads the column (every completion scores 0 here).
    f.writelines(json.dumps({"prompt": s, "answer": 0}) + "\n" for s in starts)
PY

echo "uptime: $(uptime)"
prev=
for len in $lengths; do
  "$bin" train --config configs/smollm2-135m-grpo.toml --set "data.train=$tmp/prompts.jsonl" \
    --set data.shuffle=false --set "data.max_seq_len=$((len + 32))" --set "train.steps=$steps" \
    --set "train.max_completion_length=$len" --set train.temperature=1.0 \
    --set train.gradient_checkpointing=false \
    --set "output.dir=$tmp/run$len" --set output.save_every=0 >"$tmp/$len.log" 2>&1 ||
    { cat "$tmp/$len.log" >&2; exit 1; }
  line=$(python3 - "$tmp/run$len" "$len" "$prev" 2>"$tmp/prev" <<'PY'
import json, sys
run, n, prev = sys.argv[1], int(sys.argv[2]), sys.argv[3]
peak = json.load(open(f"{run}/summary.json"))["peak_memory_bytes"]
m = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
mean_len = sum(x["completions/mean_length"] for x in m) / len(m)
out = f"max_completion_length {n}: peak RSS {peak / 1e6:.1f} MB, mean completion {mean_len:.1f} tokens"
if prev:
    pn, pp = map(float, prev.split(":"))
    out += f", +{(peak - pp) / 1e6 / (n - pn):.2f} MB per completion token over the last length"
print(out)
print(f"{n}:{peak}", file=sys.stderr)
PY
  )
  echo "$line"
  prev=$(cat "$tmp/prev")
done
echo "uptime: $(uptime)"
