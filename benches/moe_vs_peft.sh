#!/usr/bin/env bash
# benches/moe_vs_peft.sh — a mixture-of-experts training step, rtune against transformers + PEFT on
# the CPU, side by side on the same model and rows (issue 45's speed and memory item).
#
#   benches/moe_vs_peft.sh                     # PYTHON: a python with torch, transformers, peft
#   STEPS=4 RTUNE=target/debug/rtune benches/moe_vs_peft.sh
#
# The model: a random Qwen3-MoE made by transformers (benches/make_moe_model.py) with Qwen3-30B-A3B's
# sparse layer scaled down: 128 experts, top-8, expert width : hidden = 768 : 2048 (here 192 : 512),
# 32 : 4 query : kv heads (here 8 : 1); LAYERS (default 2) layers, vocab 4096, rows of SEQ (512)
# tokens, micro-batch BATCH (4). LoRA r 16, alpha 32, no dropout (PEFT refuses it on expert
# stacks) on q/k/v/o and on both expert stacks through PEFT's `target_parameters`, as the parity
# tests train (tests/parity/make_moe_goldens.py); AdamW lr 1e-4, clipping 1.0; f32; no
# checkpointing on either side. The router is frozen on both sides; the load-balancing loss is on.
#
# Reported, each side: tokens/s (median over the steps after the first) and the process's peak
# RSS; rtune's achieved GFLOP/s over the active parameters' FLOPs (`rtune bench`'s count: 6·N_active
# per token, N_active = q/k/v/o + router + top-k experts' three projections + lm_head, plus
# 12·L·seq·d for attention; the frozen-base work is 4·N, which the line after it also gives),
# against the CPU's f32 GEMM ceiling as `rtune bench` probes it (its best rate on bench-small's
# GEMM shapes), probed right before and right after rtune's run (the higher of the two counts).
# The sides run one after the other, never at once (torch's threads spin-wait); run it on an idle
# machine.
# The sides take the rows in different orders (PEFT's shuffled with its seed, rtune's in file
# order): every row is SEQ tokens, so the rates compare and the final losses do not.
#
# Measured (benches/README.md, "Mixture of experts against PEFT"; 2-core EPYC at load 7–10):
# before 267.2 vs PEFT 59.2 tokens/s (4.51x), 0.87 vs 2.49 GB (0.35x), 28.4% of the ceiling probed;
# after the grouped OpenBLAS path 366.8 vs 66.8 (5.49x), 0.94 vs 2.45 GB (0.39x), 41.4%.
# 2026-12-06 (1e9beda, experts over rayon with OpenBLAS on one thread each, load 7–8): 534.9 vs
# 73.0 (7.33x), 0.96 vs 2.44 GB (0.39x), 54.5% of the ceiling probed beside it; near idle (c317ca8,
# load 1.5–3.5) 1986.1 vs 62.2 (31.9x), 106% (74.8% at 4·N_active). Those PEFT rates were torch's
# OpenMP threads collapsing beside other jobs: on the idle VM (386f0df, 19:44 UTC) 2036.5 vs 1412.0
# (1.44x), 0.95 vs 2.48 GB (0.38x), 54.6% of the ceiling (205.3 GFLOP/s; 38.5% at 4·N_active)
# with target/debug; with target/release (a76f82b) 2815.7 vs 1279.4 (2.20x), 0.39x, 73.7% (52.0%).
# 7614732 (one job per expert; rtune alone against 39a6325, alternating, release, load 5-8): peak
# RSS 803 vs 943-956 MB, the experts' op 13% fewer CPU seconds; whole-step rate within the noise.
# Idle, release b95f0bc (7614732 merged), three runs, 22:24-22:26 UTC: 3017.4 / 2972.4 / 3048.8 vs
# PEFT 1209.1 / 1320.7 / 1237.1 (2.50x / 2.25x / 2.46x), 0.80 vs 2.46-2.51 GB (0.32x), 79.5 /
# 77.0 / 80.5% of the ceiling (56.0 / 54.3 / 56.7% at 4·N_active).
# A 2-core AVX2-only EPYC, idle, release 15c983e (the step's serial work spread over rayon):
# 2836.3 / 2700.9 / 2781.0 vs PEFT 1088.0 / 983.1 / 1018.4 (2.61x / 2.75x / 2.73x; dc8cd71
# interleaved: 2.64x / 2.45x / 2.36x), 0.31-0.33x RSS, 80.2-84.7% of a 177-186 GFLOP/s ceiling.
# The same VM, release 9cc088b (depth > 32 products on the gemm crate without AVX-512; 044ace7
# interleaved): 2893.2 / 2885.4 (4 steps), 2764.5 / 2996.2 (8 steps) vs PEFT 1099.0 / 1145.8 /
# 1190.7 / 1189.3 (2.63x / 2.52x / 2.32x / 2.52x; 044ace7 2.49x / 2.67x / 2.72x / 2.20x: a run
# moves +-5%, ~3% fewer CPU seconds measured rtune alone), 0.31-0.33x RSS, 81.9-89.1% of the ceiling.
#
# Session 34 (the same VM, idle, 8 steps): f67f3a7 3030.2 / 3056.3 vs PEFT 968.9 / 1180.1
# (3.13x / 2.59x); after the cached lora_B and the threaded optimizer host work 3070.3 / 2978.7 /
# 3029.3 vs PEFT 1090.6 / 1061.2 / 1106.0 (2.82x / 2.81x / 2.74x), 0.31-0.32x RSS, 87.7-93.5% of
# the ceiling. The shape's effect (LAYERS, HEAD_DIM): benches/README.md.
# Session 35 (transparent huge pages, routing; ebdb17e): 3138.4 / 2884.8 / 2811.0 vs PEFT 1056.0 /
# 1116.7 / 996.5 (2.97x / 2.58x / 2.82x), 0.32x RSS, 85.0-94.6% of the ceiling.
# Session 36 (PAIRS=3, the same code): 3018.5 / 2989.7 / 3123.0 vs PEFT 1078.7 / 1028.5 / 1004.5
# (2.80x / 2.91x / 3.11x, median 2.91x), 0.31-0.32x RSS, 91.9-93.2% of the ceiling.
# 9d9334d (torch's top-k tie order): 3198.3 / 3130.7 / 3135.5 vs 1016.5 / 1047.4 / 1093.4 (3.15x /
# 2.99x / 2.87x, median 2.99x), 0.32x RSS, 93.5-96.1% of the ceiling.
# Session 37 (the experts' frozen weights in panels, 09d1a15): 3107.6 / 3193.4 / 3237.0 vs PEFT
# 1054.2 / 1102.8 / 1233.1 (2.95x / 2.90x / 2.63x, median 2.90x), 0.32x RSS, 92.5-95.9% of the
# ceiling; rtune alone +0.3 to +3.3% against 8baf213 (benches/README.md).
# Session 38, another VM: a 2-core Ice Lake Xeon (AVX-512, OpenBLAS SkylakeX), each side's rate
# moving up to 2x minute to minute. f72aea1 3128.1 / 2730.6 / 3499.2 vs PEFT 1096.6 / 1168.2 /
# 1505.1 (median 2.34x); 16b4da2 (no expert product on OpenBLAS with AVX-512) 3683.4 / 3156.4 /
# 2967.3 vs 1174.8 / 1091.3 / 1459.4 (3.14x / 2.89x / 2.03x, median 2.89x), 0.32-0.33x RSS,
# 65.7-74.4% of a 235-273 GFLOP/s ceiling.
# Session 39, a 2-core AMX Xeon (model 167): 68486a6 4216.8 / 4187.9 / 3882.9 vs PEFT 1313.8 /
# 1211.2 / 1451.3 (median 3.21x), 62.2-68.5% of a 336-347 GFLOP/s ceiling; ed51754 (the forward
# turns each expert weight before its product) 4140.0 / 4015.5 / 4165.2 vs 1447.8 / 1012.8 /
# 1210.3 (2.86x / 3.96x / 3.44x, median 3.44x), 0.32-0.33x RSS, 66.6-69.3% of 329-336 GFLOP/s.
#
# Environment: PYTHON (default /work/.venv-ref/bin/python), RTUNE (default target/release/rtune,
# built if missing), STEPS (4), PAIRS (1: rounds of rtune's run then PEFT's; more give medians),
# LAYERS (2), SEQ (512), BATCH (4), HEAD_DIM (64: hidden / heads; Qwen3-30B-A3B's is 128), OUT
# (runs/bench-moe).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-/work/.venv-ref/bin/python}
STEPS=${STEPS:-4}
PAIRS=${PAIRS:-1}
LAYERS=${LAYERS:-2}
SEQ=${SEQ:-512}
BATCH=${BATCH:-4}
HEAD_DIM=${HEAD_DIM:-64}
out=${OUT:-runs/bench-moe}
mkdir -p "$out"
if [ -z "${RTUNE:-}" ]; then
  RTUNE=target/release/rtune
  [ -x "$RTUNE" ] || cargo build --release --quiet
fi
"$PYTHON" benches/make_moe_model.py --out "$out" --layers "$LAYERS" --hidden 512 --heads 8 \
  --head-dim "$HEAD_DIM" --kv-heads 1 --experts 128 --top-k 8 --moe-inter 192 --vocab 4096 --rows $((BATCH * 4)) \
  --seq "$SEQ"
cat >"$out/rtune.toml" <<TOML
[model]
path = "$out/model"
[lora]
r = 16
alpha = 32
dropout = 0.0
targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
target_parameters = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
[data]
train = "$out/rows.jsonl"
max_seq_len = $SEQ
shuffle = false
[train]
steps = $STEPS
micro_batch_size = $BATCH
lr = 1e-4
warmup_steps = 0
max_grad_norm = 1.0
gradient_checkpointing = false
[output]
dir = "$out/rtune-run"
overwrite = true
TOML
# The CPU's f32 GEMM ceiling, probed by rtune bench (one step of a one-layer bench-small first)
# right before and right after rtune's run, so that it meets the load rtune's run met (a probe
# minutes away, after PEFT's run, measured another machine on a shared box).
ceiling() {
  "$RTUNE" bench --layers 1 --steps 1 --warmup 0 --json-out "$out/$1.json" >"$out/$1.log" 2>&1 \
    || { tail -20 "$out/$1.log"; exit 1; }
}
# PAIRS rounds, each rtune's run (between its two probes) then PEFT's: a run moves +-5% on either
# side, so several alternating pairs give each side's median and the median of the pairs' ratios.
for p in $(seq 1 "$PAIRS"); do
  uptime
  ceiling "ceiling-before-$p"
  "$RTUNE" train --config "$out/rtune.toml" >"$out/rtune.log" 2>&1 || { tail -20 "$out/rtune.log"; exit 1; }
  ceiling "ceiling-after-$p"
  uptime
  cp "$out/rtune-run/summary.json" "$out/rtune-$p.json"
  "$PYTHON" benches/peft_rows.py --model "$out/model" --rows "$out/rows.jsonl" --steps "$STEPS" \
    --batch "$BATCH" --r 16 --alpha 32 --dropout 0 --lr 1e-4 --warmup 0 --max-grad-norm 1.0 \
    --targets q_proj,k_proj,v_proj,o_proj \
    --target-parameters mlp.experts.gate_up_proj,mlp.experts.down_proj \
    --json-out "$out/peft-$p.json" >"$out/peft.log" 2>&1 || { tail -20 "$out/peft.log"; exit 1; }
done
uptime
"$PYTHON" - "$out" "$SEQ" "$PAIRS" <<'PY'
import json, statistics, sys
d, seq, pairs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c = json.load(open(f"{d}/model/config.json"))
H, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
E, k, I = c.get("num_experts") or c["num_local_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]
active = L * (H * (q + 2 * kv) + q * H + H * E + k * 3 * H * I) + V * H
attn = 12 * L * seq * q
print(f"Qwen3-MoE {L} layers, hidden {H}, {E} experts top-{k} width {I}, seq {seq}: "
      f"{active/1e6:.2f} M active parameters")
ratios = []
for n in range(1, pairs + 1):
    r, p = json.load(open(f"{d}/rtune-{n}.json")), json.load(open(f"{d}/peft-{n}.json"))
    # The higher of the pair's two probes: the fraction is never flattered by a probe that met
    # more load.
    probes = [json.load(open(f"{d}/ceiling-{w}-{n}.json"))["ceiling"]["best_gflops"]
              for w in ("before", "after")]
    ceil = max(probes)
    rt, rm = r["tokens_per_s"], r["peak_memory_bytes"]
    pt, pm = p["tokens_per_s"], p["peak_rss_bytes"]
    ratios.append(rt / pt)
    print(f"pair {n}:")
    print(f"  rtune  {rt:8.1f} tokens/s  peak RSS {rm/1e9:.2f} GB  final loss {r['final_loss']:.4f}")
    print(f"  PEFT   {pt:8.1f} tokens/s  peak RSS {pm/1e9:.2f} GB  final loss {p['final_loss']:.4f}")
    print(f"  rtune / PEFT: {rt/pt:.2f}x tokens/s, {rm/pm:.2f}x peak RSS")
    g6 = rt * (6 * active + attn) / 1e9
    g4 = rt * (4 * active + attn) / 1e9
    print(f"  rtune: {g6:.1f} GFLOP/s at 6·N_active + attention = {100*g6/ceil:.1f}% of the "
          f"f32 GEMM ceiling {ceil:.1f} GFLOP/s (probed {probes[0]:.1f} before rtune's run, "
          f"{probes[1]:.1f} after); {g4:.1f} GFLOP/s ({100*g4/ceil:.1f}%) at 4·N_active")
if pairs > 1:
    print(f"median over {pairs} pairs: {statistics.median(ratios):.2f}x tokens/s "
          f"(pairs {' / '.join(f'{x:.2f}' for x in ratios)})")
PY
