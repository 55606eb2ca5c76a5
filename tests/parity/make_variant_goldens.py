#!/usr/bin/env python3
"""rtune's generator for the LoRA-variant goldens (issue 17): LoRA+, PiSSA, pissa_niter_4, OLoRA.

An extension of make_goldens.py (same reference venv, same determinism settings, same tiny model and
batch); run from the repository root:

    python tests/parity/make_variant_goldens.py --out /tmp/variant-goldens
    cp /tmp/variant-goldens/golden_tiny_*.safetensors tests/parity/

Each golden is PEFT 0.21.2 training `tests/fixtures/tiny-llama` (r 8, alpha 16, all-linear, B 2, T 16,
golden_tiny's batch) for 3 steps of torch.optim.AdamW (lr 1e-3, constant, no clipping), f32:

    golden_tiny_loraplus       create_loraplus_optimizer(loraplus_lr_ratio=16, loraplus_weight_decay=0.01)
                               from adapter_tiny_init (B non-zero, so both groups move from step 1)
    golden_tiny_pissa          init_lora_weights="pissa"
    golden_tiny_pissa_niter_4  init_lora_weights="pissa_niter_4"
    golden_tiny_olora          init_lora_weights="olora"

The PiSSA / OLoRA goldens train on `tiny-llama` with every targeted weight's spectrum reshaped: the top 8
singular values 5% apart (sigma_i = sigma_0 * (1 - 0.05 i)), the rest cut by 100x (`base.<module>.weight`,
f32), so the top-8 singular vectors are determined to f32 precision and torch's randomized SVD (svd_lowrank, niter 4, from torch's random stream) finds it to
~1e-16 — the same subspace rtune's randomized SVD finds from its own random draws. Their `adamw.*`
tensors are PEFT's converted adapter (`save_pretrained(..., path_initial_model_for_weight_conversion=)`,
rank 16 against the original base); `init.*` are PEFT's initial A0, B0. Keys: `input_ids`, `labels`,
`adamw.loss` (the loss before each update), `adamw.<PEFT key>`, `init.<PEFT key>`, `base.<name>`.
"""
import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_goldens as mg  # noqa: E402  (sets the determinism environment before torch loads)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

R, ALPHA, BATCH, SEQ = 8, 16, 2, 16
GAP = 0.01            # sigma_i *= GAP for i >= R in the PiSSA / OLoRA base
SPACING = 0.05        # sigma_i = sigma_0 * (1 - SPACING * i) for i < R
LORAPLUS_RATIO, LORAPLUS_WD = 16.0, 0.01


def batch(config, model_dir):
    from tokenizers import Tokenizer
    vocab = min(Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")).get_vocab_size(),
                config.vocab_size)
    ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(mg.SEED),
                        dtype=torch.int64)
    ids[:, 0] = config.bos_token_id
    labels = ids.clone()
    labels[:, :mg.MASK_PREFIX] = -100
    return ids, labels


def gapped_model(src, dst):
    """`src` with each targeted linear weight's singular values after the R-th scaled by GAP."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    w = load_file(path)
    changed = {}
    for name, t in w.items():
        if name.endswith(".weight") and any(".%s." % m in name for m in mg.LINEARS):
            u, s, vh = torch.linalg.svd(t.double(), full_matrices=False)
            # Top R spaced 5% apart: with random spectra two of them can be 0.1% apart, and then
            # torch's f32 SVD rotates their vectors by ~1e-4 (measured), more than the tolerance.
            s[:R] = s[0] * (1.0 - SPACING * torch.arange(R, dtype=torch.float64))
            s[R:] *= GAP
            w[name] = (u @ torch.diag(s) @ vh).float().contiguous()
            changed["base." + name] = w[name].clone()
    save_file(w, path, metadata={"format": "pt"})
    return changed


def train(model, params, opt, ids, labels):
    mask = torch.ones_like(ids)
    losses = []
    for _ in range(mg.STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float32)


def golden_loraplus(out):
    from peft import PeftModel
    from peft.optimizers import create_loraplus_optimizer
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    base = AutoModelForCausalLM.from_pretrained("tiny", dtype=torch.float32, attn_implementation="eager")
    init_dir = os.path.join(mg.REPO_TESTS, "parity", "adapter_tiny_init")
    model = PeftModel.from_pretrained(base, init_dir, is_trainable=True)
    ids, labels = batch(model.config, "tiny")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=mg.LR, loraplus_lr_ratio=LORAPLUS_RATIO,
                                    loraplus_weight_decay=LORAPLUS_WD, betas=(0.9, 0.999), eps=1e-8)
    model.train()
    tensors = {"input_ids": ids, "labels": labels, "adamw.loss": train(model, params, opt, ids, labels)}
    for n, p in params:
        tensors["adamw." + mg.adapter_key(n)] = p.detach().float().clone()
    meta = {"variant": "loraplus", "loraplus_lr_ratio": LORAPLUS_RATIO, "weight_decay": LORAPLUS_WD,
            "init": "tests/parity/adapter_tiny_init", "lr": mg.LR, "steps": mg.STEPS}
    save(tensors, out, meta)


def golden_split(out, init):
    import peft
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    changed = gapped_model("tiny", "tiny_gap")
    base = AutoModelForCausalLM.from_pretrained("tiny_gap", dtype=torch.float32, attn_implementation="eager")
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=mg.LINEARS,
                                            bias="none", task_type="CAUSAL_LM", init_lora_weights=init))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tensors = dict(changed)
    for n, p in params:
        tensors["init." + mg.adapter_key(n)] = p.detach().float().clone()
    shutil.rmtree("init_adapter", ignore_errors=True)
    model.peft_config["default"].init_lora_weights = True
    model.save_pretrained("init_adapter")
    model.peft_config["default"].init_lora_weights = init
    ids, labels = batch(model.config, "tiny_gap")
    opt = torch.optim.AdamW([p for _, p in params], lr=mg.LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    model.train()
    tensors.update({"input_ids": ids, "labels": labels, "adamw.loss": train(model, params, opt, ids, labels)})
    shutil.rmtree("converted", ignore_errors=True)
    model.save_pretrained("converted", path_initial_model_for_weight_conversion="init_adapter")
    for k, t in load_file(os.path.join("converted", "adapter_model.safetensors")).items():
        tensors["adamw." + k] = t.float().clone()
    with open(os.path.join("converted", "adapter_config.json")) as f:
        cfg = json.load(f)
    meta = {"variant": init, "r": R, "lora_alpha": ALPHA, "gap": GAP, "lr": mg.LR, "steps": mg.STEPS,
            "converted_r": cfg["r"], "converted_lora_alpha": cfg["lora_alpha"],
            "peft": peft.__version__, "torch": torch.__version__}
    save(tensors, out, meta)


def save(tensors, out, meta):
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={"config": json.dumps(meta)})
    print("%s: losses %s, %d tensors" % (out, tensors["adamw.loss"].tolist(), len(tensors)), flush=True)


GOLDENS = {
    "golden_tiny_loraplus": golden_loraplus,
    "golden_tiny_pissa": lambda out: golden_split(out, "pissa"),
    "golden_tiny_pissa_niter_4": lambda out: golden_split(out, "pissa_niter_4"),
    "golden_tiny_olora": lambda out: golden_split(out, "olora"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (made if missing)")
    ap.add_argument("--only", default=None, help="comma-separated golden names (default: all)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.chdir(args.out)
    mg.make_models(".")
    for name in (args.only.split(",") if args.only else GOLDENS):
        GOLDENS[name](name + ".safetensors")


if __name__ == "__main__":
    main()
