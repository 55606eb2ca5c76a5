"""Real-model parity: Gemma 3 270M from the GGUF, 2 training steps with rtune against transformers +
PEFT on the same converted weights, the same rows, the same LoRA start and the same optimizer.

    scripts/fetch-gemma3.sh
    cargo build --release
    python scripts/check_gemma3_parity.py [--rtune target/release/rtune] [--out runs/gemma3-parity]

What runs (f32 on the CPU both sides):
1. `rtune convert gguf` → OUT/hf (the weights both sides load);
2. the rows rtune trains on: `rtune data inspect --json` of configs/gemma3-270m-lora.toml with
   `data.shuffle = false`, `data.group_by_length = false` (chat template, BOS, answer-only labels
   applied), the first 2 × 8 in file order;
3. a PEFT adapter made by PEFT (r 16, α 32, all-linear: the seven projections of each layer),
   A as PEFT initialises it and B drawn as 0.01·N(0, 1) with a fixed seed (non-zero, so step 1
   moves A too), saved with `save_pretrained` → OUT/init;
4. rtune trains 2 steps from it (`lora.init_from`), micro-batch 8, lr 1e-3 constant, no warmup,
   AdamW (0.9, 0.999, 1e-8, no weight decay), clipping at 1.0, LoRA dropout 0;
5. PEFT trains the same 2 steps on the same rows (right-padded as rtune pads, eager attention,
   torch.optim.AdamW, clip_grad_norm_).

Checks, exit status 1 when one fails: each step's loss equal within 1e-4 relative (step 1 is the
forward on the converted weights and the adapter; step 2 also the backward, clipping and AdamW
update); the adapter after 2 steps is printed (max |diff| / max |w| per side).
"""

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from safetensors.torch import load_file

CONFIG = "configs/gemma3-270m-lora.toml"
GGUF = "models/gemma-3-270m-q4_k_m.gguf"
STEPS, BATCH, LR = 2, 8, 1e-3


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtune", default="target/release/rtune")
    ap.add_argument("--out", default="runs/gemma3-parity")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    hf = os.path.join(a.out, "hf")
    if not os.path.exists(os.path.join(hf, "config.json")):
        run([a.rtune, "convert", "gguf", GGUF, hf])
    common = ["--set", f"model.path={hf}", "--set", "data.shuffle=false",
              "--set", "data.group_by_length=false"]
    rows_path = os.path.join(a.out, "rows.jsonl")
    with open(rows_path, "w") as f:
        run([a.rtune, "data", "inspect", "--config", CONFIG, "--json", "-n", str(STEPS * BATCH)] + common,
            stdout=f)
    rows = [json.loads(line) for line in open(rows_path) if line.strip()][: STEPS * BATCH]
    assert len(rows) == STEPS * BATCH, len(rows)

    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    def base():
        return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")

    init = os.path.join(a.out, "init")
    torch.manual_seed(0)  # PEFT's kaiming-uniform A
    model = get_peft_model(base(), LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                              target_modules="all-linear", bias="none",
                                              task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    model.save_pretrained(init)
    del model

    run_dir = os.path.join(a.out, "rtune-run")
    run([a.rtune, "train", "--config", CONFIG] + common + [
        "--set", f"lora.init_from={init}", "--set", "lora.dropout=0.0",
        "--set", f"train.steps={STEPS}", "--set", f"train.micro_batch_size={BATCH}",
        "--set", "train.grad_accum=1", "--set", f"train.lr={LR}", "--set", "train.schedule=constant",
        "--set", "train.warmup_steps=0", "--set", "train.weight_decay=0.0",
        "--set", "train.max_grad_norm=1.0", "--set", "train.log_every=1",
        "--set", f"output.dir={run_dir}", "--set", "output.overwrite=true"])
    metrics = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    rt_losses = [m["loss"] for m in metrics if "loss" in m][:STEPS]

    model = PeftModel.from_pretrained(base(), init, is_trainable=True)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    pad = model.config.pad_token_id or 0
    model.train()
    pt_losses = []
    for s in range(STEPS):
        batch = rows[s * BATCH:(s + 1) * BATCH]
        width = max(len(r["input_ids"]) for r in batch)
        ids = torch.full((BATCH, width), pad, dtype=torch.long)
        labels = torch.full((BATCH, width), -100, dtype=torch.long)
        mask = torch.zeros((BATCH, width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r["input_ids"])
            ids[i, :n] = torch.tensor(r["input_ids"])
            labels[i, :n] = torch.tensor(r["labels"])
            mask[i, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pt_losses.append(loss.item())

    ok = len(rt_losses) == STEPS
    for s, (r, p) in enumerate(zip(rt_losses, pt_losses)):
        rel = abs(r - p) / abs(p)
        ok &= rel <= a.tol
        print(f"step {s + 1}: rtune loss {r:.7f}  PEFT loss {p:.7f}  relative diff {rel:.2e}")
    ours = load_file(os.path.join(run_dir, "adapter_model.safetensors"))
    theirs = {k.replace(".default", ""): v.detach() for k, v in model.named_parameters() if "lora_" in k}
    worst, far, n = 0.0, 0, 0
    for k, v in theirs.items():
        d = (ours[k] - v).abs()
        worst = max(worst, (d.max() / v.abs().max()).item())
        far += int((d > 1e-2 * LR).sum())
        n += d.numel()
    # AdamW's first steps move each weight by about ±lr whatever the gradient's size, so a weight
    # whose gradient is at rounding level on both sides can step the other way: a few such elements
    # set the max; the count says how few.
    print(f"adapter after {STEPS} steps: {len(ours)} tensors, max |diff| / max |w| = {worst:.2e}; "
          f"{far} of {n} elements differ by more than 1% of lr")
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
