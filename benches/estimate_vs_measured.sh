#!/usr/bin/env bash
# Estimated vs measured peak memory (issue 5): every row must be within ±10%.
#
#   benches/estimate_vs_measured.sh          # builds the release binary first
#
# Rows:
# - `rtune bench` on bench-small (hidden 512, 8 layers, 8/2 heads, inter 1376, vocab 32000, batch 4,
#   r 16 all-linear, f32) at seq 512 and 2048, gradient checkpointing off and on: the estimate is
#   the one `rtune bench` prints next to the measured peak RSS (VmHWM);
# - `rtune train` on every config in configs/ that runs on the CPU: the measured peak is the run's
#   summary.json `peak_memory_bytes`, the estimate `rtune estimate --data --json`. `--data` sizes
#   the batch as the data forms it (rows padded to the longest example, its target tokens); plain
#   `rtune estimate` assumes full-length rows where every position is a target (the worst case,
#   shown in the last column).
#
# - a mixture-of-experts model made by benches/make_moe_model.py (see below);
# - GRPO on SmolLM2-135M with completions of 128 tokens (see below).
#
# Env: BENCH_STEPS / BENCH_WARMUP (default 2 / 1: the peak of a steady step, not only the first),
# SEQS (default "512 2048"), CONFIGS (default configs/*.toml; "" for none), TRAIN_STEPS (default: as configured) to shorten the train runs,
# RTUNE (a built binary: skips the build).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${RTUNE:-}" ]]; then
    cargo build --release --quiet
    RTUNE="${CARGO_TARGET_DIR:-target}/release/rtune"
fi
BENCH_STEPS=${BENCH_STEPS:-2}
BENCH_WARMUP=${BENCH_WARMUP:-1}
SEQS=${SEQS:-"512 2048"}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

json() { python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))" "$@"; }
rows=()
row() { # name estimated measured [worst]
    rows+=("$1|$2|$3|${4:-}")
}

for seq in $SEQS; do
    for ckpt in "" "--gradient-checkpointing"; do
        name="bench-small seq $seq${ckpt:+ ckpt}"
        echo "== $name" >&2
        "$RTUNE" bench --seq "$seq" $ckpt --steps "$BENCH_STEPS" --warmup "$BENCH_WARMUP" \
            --json-out "$tmp/bench.json" >&2
        row "$name" "$(json "$tmp/bench.json" "d['estimated_peak_bytes']")" \
            "$(json "$tmp/bench.json" "d['peak_rss_bytes']")"
    done
done

for cfg in ${CONFIGS-configs/*.toml}; do
    # CUDA configs cannot run in this build; "auto" and "cpu" run on the CPU.
    if grep -Eq '^[[:space:]]*device[[:space:]]*=[[:space:]]*"cuda' "$cfg"; then
        echo "== $cfg: skipped (CUDA)" >&2
        continue
    fi
    echo "== $cfg" >&2
    set_args=(--set "output.dir=$tmp/run" --set output.overwrite=true)
    if [[ -n "${TRAIN_STEPS:-}" ]]; then
        set_args+=(--set "train.steps=$TRAIN_STEPS" --set train.warmup_steps=0)
    fi
    "$RTUNE" estimate --config "$cfg" "${set_args[@]}" --data --json >"$tmp/est.json"
    "$RTUNE" estimate --config "$cfg" "${set_args[@]}" --json >"$tmp/worst.json"
    "$RTUNE" train --config "$cfg" "${set_args[@]}" >&2
    row "$(basename "$cfg")" "$(json "$tmp/est.json" "d['peak_bytes']")" \
        "$(json "$tmp/run/summary.json" "d['peak_memory_bytes']")" \
        "$(json "$tmp/worst.json" "d['peak_bytes']")"
done

# A mixture-of-experts model (issue 45): a random Qwen3-MoE made by transformers
# (benches/make_moe_model.py: 4 layers, hidden 512, 32 experts, top-4, expert width 256), LoRA on
# q/k/v/o and both expert stacks, batch 4 × 256, checkpointing off and on. Needs PYTHON with
# transformers (default: the reference venv); MOE=0 skips it.
PYTHON=${PYTHON:-/work/.venv-ref/bin/python}
if [[ "${MOE:-1}" != 0 ]]; then
    "$PYTHON" benches/make_moe_model.py --out "$tmp/moe" >&2
    for ckpt in false true; do
        name="qwen3-moe 32x256 ckpt=$ckpt"
        echo "== $name" >&2
        cat >"$tmp/moe.toml" <<TOML
[model]
path = "$tmp/moe/model"
[lora]
r = 16
alpha = 32
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
[data]
train = "$tmp/moe/rows.jsonl"
max_seq_len = 256
shuffle = false
[train]
steps = 3
micro_batch_size = 4
gradient_checkpointing = $ckpt
[output]
dir = "$tmp/moe-run"
overwrite = true
TOML
        "$RTUNE" estimate --config "$tmp/moe.toml" --data --json >"$tmp/est.json"
        "$RTUNE" train --config "$tmp/moe.toml" >&2
        row "$name" "$(json "$tmp/est.json" "d['peak_bytes']")" \
            "$(json "$tmp/moe-run/summary.json" "d['peak_memory_bytes']")"
    done
fi

# GRPO (issue 44): the recipe's model and LoRA (configs/smollm2-135m-grpo.toml, 2 prompts × 8
# completions a step) with plain-text story openings whose completions run to the limit
# (benches/grpo_memory.sh's prompts), 2 steps at max_completion_length GRPO_LEN (default 128),
# checkpointing off. The estimate counts the training rows (longest prompt + a whole completion,
# every completion token a target) and the sampling KV cache (crates/estimate/src/sampling.rs).
# Needs scripts/fetch-smollm2.sh's model; GRPO=0 skips it.
if [[ "${GRPO:-1}" != 0 && -f models/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then
    len=${GRPO_LEN:-128}
    name="grpo smollm2 len $len"
    echo "== $name" >&2
    python3 - "$tmp/grpo-prompts.jsonl" <<'PY'
import json, sys
starts = ["Once upon a time, in a small village by the sea,", "The old lighthouse keeper opened the door and",
          "In the year 2150, the first city on Mars", "She found a strange map in her grandmother's attic;"]
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"prompt": s, "answer": 0}) + "\n" for s in starts)
PY
    grpo_args=(--config configs/smollm2-135m-grpo.toml --set "data.train=$tmp/grpo-prompts.jsonl"
        --set data.shuffle=false --set "data.max_seq_len=$((len + 32))" --set train.steps=2
        --set "train.max_completion_length=$len" --set train.temperature=1.0
        --set train.gradient_checkpointing=false --set "output.dir=$tmp/grpo-run"
        --set output.overwrite=true)
    "$RTUNE" estimate "${grpo_args[@]}" --data --json >"$tmp/est.json"
    "$RTUNE" estimate "${grpo_args[@]}" --json >"$tmp/worst.json"
    "$RTUNE" train "${grpo_args[@]}" >&2
    row "$name" "$(json "$tmp/est.json" "d['peak_bytes']")" \
        "$(json "$tmp/grpo-run/summary.json" "d['peak_memory_bytes']")" \
        "$(json "$tmp/worst.json" "d['peak_bytes']")"
fi

printf '\n%-32s %14s %14s %8s %18s\n' config estimated measured ratio "worst-case rows"
fail=0
for r in "${rows[@]}"; do
    IFS='|' read -r name est meas worst <<<"$r"
    ratio=$(python3 -c "print(f'{$est / $meas:.3f}')")
    ok=$(python3 -c "print('ok' if abs($est / $meas - 1) <= 0.10 else 'OUT')")
    [[ $ok == ok ]] || fail=1
    worst_mb=${worst:+$(python3 -c "print(f'{$worst / 1e6:.1f} MB')")}
    printf '%-32s %11.1f MB %11.1f MB %8s %18s  %s\n' "$name" \
        "$(python3 -c "print($est / 1e6)")" "$(python3 -c "print($meas / 1e6)")" \
        "$ratio" "$worst_mb" "$ok"
done
exit $fail
