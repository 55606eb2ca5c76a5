#!/usr/bin/env bash
# benches/pref_memory.sh — a DPO step's peak memory against an SFT step's on the same tokens.
#
# The DPO recipe's pairs (data/zephyr-prefs.jsonl, SmolLM2-135M from models/, as
# configs/smollm2-135m-dpo.toml) trained STEPS steps with micro_batch_size 8 pairs, and the same
# pairs' 16 sequences (prompt + chosen, prompt + rejected, as chat rows) trained as SFT with
# micro_batch_size 16 rows: the same tokens a step, the same LoRA, no init_from. Prints each run's
# peak RSS (summary.json) and their ratio. Needs a release build (cargo build --release) and
# scripts/fetch-smollm2.sh's model.
set -euo pipefail
cd "$(dirname "$0")/.."

steps=${STEPS:-5}
bin=${RTUNE:-target/release/rtune}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

python3 - "$tmp/sft.jsonl" <<'EOF'
import json, sys
with open("data/zephyr-prefs.jsonl") as f, open(sys.argv[1], "w") as out:
    for line in f:
        p = json.loads(line)
        for side in ("chosen", "rejected"):
            out.write(json.dumps({"messages": p["prompt"] + p[side]}) + "\n")
EOF

# One config, two objectives: the recipe's LoRA, no init_from (DPO's reference is then the base).
config() { # name, objective lines, data lines, micro_batch_size
  cat >"$tmp/$1.toml" <<EOT
[model]
path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
[lora]
r = 16
alpha = 32
dropout = 0.05
targets = "all-linear"
[data]
$3
max_seq_len = 192
shuffle = false
[train]
steps = $steps
micro_batch_size = $4
lr = 2e-4
log_every = $steps
device = "cpu"
$2
[output]
dir = "$tmp/$1"
save_every = 0
EOT
  "$bin" train --config "$tmp/$1.toml" >"$tmp/$1.log" 2>&1 || { cat "$tmp/$1.log" >&2; exit 1; }
  python3 -c 'import json,sys; s=json.load(open(sys.argv[1])); print(s["peak_memory_bytes"])' \
    "$tmp/$1/summary.json"
}
dpo=$(config dpo 'objective = "dpo"' 'train = "data/zephyr-prefs.jsonl"' 8)
sft=$(config sft '' "train = \"$tmp/sft.jsonl\"" 16)
python3 -c 'import sys; d, s = int(sys.argv[1]), int(sys.argv[2]); print(f"peak RSS over {sys.argv[3]} steps: DPO {d/1e6:.1f} MB (8 pairs a step), SFT {s/1e6:.1f} MB (their 16 sequences), DPO/SFT {d/s:.3f}")' "$dpo" "$sft" "$steps"
