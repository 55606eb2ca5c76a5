#!/usr/bin/env python3
"""A random Qwen3-MoE checkpoint made by transformers, and pre-tokenized rows to train it on, for
the mixture-of-experts benchmarks (benches/estimate_vs_measured.sh's MoE row, benches/moe_vs_peft.sh).

    python benches/make_moe_model.py --out /tmp/moe [--layers 4 --hidden 512 --experts 32 \\
        --top-k 4 --moe-inter 256 --vocab 4096 --rows 16 --seq 256]

Writes `<out>/model` (config.json + model.safetensors, f32, `output_router_logits` on, routers
drawn wide so tokens spread over the experts) and `<out>/rows.jsonl` (`input_ids` of `--seq`
tokens, every position a target). Seeded: the same arguments give the same files.
"""
import argparse
import json
import os

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--head-dim", type=int, default=None, help="default: hidden / heads")
p.add_argument("--kv-heads", type=int, default=4)
p.add_argument("--experts", type=int, default=32)
p.add_argument("--top-k", type=int, default=4)
p.add_argument("--moe-inter", type=int, default=256)
p.add_argument("--vocab", type=int, default=4096)
p.add_argument("--rows", type=int, default=16)
p.add_argument("--seq", type=int, default=256)
a = p.parse_args()

torch.manual_seed(0)
cfg = Qwen3MoeConfig(
    vocab_size=a.vocab,
    hidden_size=a.hidden,
    intermediate_size=4 * a.hidden,
    moe_intermediate_size=a.moe_inter,
    num_hidden_layers=a.layers,
    num_attention_heads=a.heads,
    num_key_value_heads=a.kv_heads,
    head_dim=a.head_dim or a.hidden // a.heads,
    num_experts=a.experts,
    num_experts_per_tok=a.top_k,
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
    max_position_embeddings=max(4096, a.seq),
    tie_word_embeddings=False,
)
model = Qwen3MoeForCausalLM(cfg).float()
with torch.no_grad():
    for name, w in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            w.normal_(0, 0.5)
os.makedirs(a.out, exist_ok=True)
model.save_pretrained(os.path.join(a.out, "model"))
g = torch.Generator().manual_seed(1)
with open(os.path.join(a.out, "rows.jsonl"), "w") as f:
    for _ in range(a.rows):
        ids = torch.randint(3, a.vocab, (a.seq,), generator=g).tolist()
        f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
