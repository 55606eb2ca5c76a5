#!/usr/bin/env python3
"""The PEFT side of benches/smollm2_vs_peft.sh: LoRA training on pre-tokenized rows, timed as rtune
times itself.

    python benches/peft_rows.py --model HF_DIR --rows rows.jsonl --steps 100 --json-out peft.json

`--rows`: one `{"input_ids": [...], "labels": [...]}` object a line (-100 where masked), as
`rtune data inspect --json` prints them: the very rows rtune trains on, template, BOS/EOS and
truncation applied. The settings mirror `configs/smollm2-135m-lora.toml` (override with the flags):
LoRA r 16, alpha 32, dropout 0.05 on all linear layers (PEFT's "all-linear": every decoder linear,
not the lm_head); micro-batch 8, rows shuffled with the seed and each micro-batch right-padded to
its longest row; torch.optim.AdamW (betas 0.9/0.999, eps 1e-8, no weight decay), lr 1e-3 with 5
warmup steps then cosine to 0 over the run, gradient clipping at 1.0; f32 weights and compute;
transformers' default attention (sdpa); no gradient checkpointing (PEFT's default).
`--bf16-autocast`: every forward under torch.autocast('cpu', dtype=torch.bfloat16).
`--targets q_proj,k_proj,...` instead of all-linear, and `--target-parameters
mlp.experts.gate_up_proj,...` for LoRA on 3-D expert stacks (PEFT's `ParamWrapper`, which refuses
dropout: pass `--dropout 0`), as benches/moe_vs_peft.sh trains a mixture of experts.

Reported as rtune reports a run: `tokens_per_s` is the median over the steps after the first of
(non-padding tokens of the step / the step's wall time: forward, backward, clipping, AdamW);
`peak_rss_bytes` is the process's peak resident set (getrusage ru_maxrss), model load included.
"""
import argparse
import json
import math
import os
import random
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def batches(rows, batch, steps, seed, pad_id):
    """`steps` micro-batches of `batch` rows: the rows shuffled with `seed` each epoch, each batch
    right-padded to its longest row (input pad_id, label -100, attention 0)."""
    import torch
    rng = random.Random(seed)
    order = []
    out = []
    while len(out) < steps:
        if len(order) < batch:
            fresh = list(range(len(rows)))
            rng.shuffle(fresh)
            order += fresh
        take, order = order[:batch], order[batch:]
        width = max(len(rows[i]["input_ids"]) for i in take)
        ids = torch.full((batch, width), pad_id, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for j, i in enumerate(take):
            r = rows[i]
            n = len(r["input_ids"])
            ids[j, :n] = torch.tensor(r["input_ids"])
            labels[j, :n] = torch.tensor(r["labels"])
            mask[j, :n] = 1
        out.append((ids, labels, mask))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face model directory (f32 or any dtype)")
    ap.add_argument("--rows", required=True, help="JSONL of input_ids/labels (rtune data inspect --json)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32.0)
    ap.add_argument("--dropout", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bf16-autocast", action="store_true")
    ap.add_argument("--targets", default="all-linear",
                    help="comma-separated module names, or all-linear (the default)")
    ap.add_argument("--target-parameters", default="",
                    help="comma-separated 3-D parameters (PEFT's target_parameters)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, get_cosine_schedule_with_warmup

    torch.manual_seed(a.seed)
    rows = [json.loads(line) for line in open(a.rows) if line.strip()]
    if not rows:
        sys.exit("error: %s holds no rows" % a.rows)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    pad_id = model.config.pad_token_id
    if pad_id is None:
        eos = model.config.eos_token_id
        pad_id = (eos[0] if isinstance(eos, list) else eos) or 0
    targets = a.targets if a.targets == "all-linear" else a.targets.split(",")
    extra = {"target_parameters": a.target_parameters.split(",")} if a.target_parameters else {}
    model = get_peft_model(model, LoraConfig(
        r=a.r, lora_alpha=a.alpha, lora_dropout=a.dropout, target_modules=targets,
        bias="none", task_type="CAUSAL_LM", **extra))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, min(a.warmup, a.steps), a.steps)
    data = batches(rows, a.batch, a.steps, a.seed, pad_id)
    model.train()
    speeds, losses = [], []
    for step, (ids, labels, mask) in enumerate(data):
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16_autocast):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        if a.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, a.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        tokens = int(mask.sum())
        if step > 0 or a.steps == 1:
            speeds.append(tokens / dt)
        losses.append(loss.item())
        print("step %d loss %.4f %.1f tokens/s" % (step + 1, losses[-1], tokens / dt), flush=True)
    out = {
        "steps": a.steps, "batch": a.batch, "rows": len(rows),
        "tokens_per_s": statistics.median(speeds),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "final_loss": losses[-1], "losses": losses,
        "bf16_autocast": a.bf16_autocast, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "peft": __import__("peft").__version__,
    }
    assert all(math.isfinite(x) for x in losses), losses
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(out, f, indent=1)
    print("peft: %.1f tokens/s, peak RSS %.2f GB" % (out["tokens_per_s"], out["peak_rss_bytes"] / 1e9))


if __name__ == "__main__":
    main()
