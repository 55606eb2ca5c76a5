#!/usr/bin/env python3
"""rtune's generator for the LoRA-variant goldens (issue 17): LoRA+, PiSSA, pissa_niter_4, OLoRA,
trainable tokens.

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
    golden_tiny_l3_tokens      trainable_token_indices=[3 ids] on tiny-llama3 (tied embeddings: the
                               lm_head is the same trained rows), weight_decay 0.01
    golden_tiny_tokens         the same on tiny-llama (untied: PEFT adapts the embedding only)

The trainable-tokens goldens (made with `--only golden_tiny_l3_tokens,golden_tiny_tokens`) train two
ids that occur in the batch's inputs and `</s>` (id 2, never an input: only the tied lm_head moves
it), listed unsorted; `init.*` is PEFT's adapter before training (`save_pretrained`, token rows =
the original embedding rows; A, B drawn as make_goldens.py draws them), `meta.adapter_config` its
adapter_config.json, `meta.tokens` the
tokens as strings, `adamw.logits` the trained PEFT model's logits on the batch. Check an adapter
rtune saved for one of them in PEFT (0 missing / unexpected keys, logits against `adamw.logits`):

    python tests/parity/make_variant_goldens.py --out /tmp/vg --check-adapter RUN_DIR \
        --golden tests/parity/golden_tiny_l3_tokens.safetensors

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


TOKENS_WD = 0.01


def token_ids(ids, tok):
    """Two ids of the batch's inputs (after BOS) and `</s>`, unsorted, with their token strings."""
    present = sorted(set(ids[:, 1:].flatten().tolist()))
    chosen = [present[len(present) // 2], 2, present[3]]
    return chosen, [tok.id_to_token(i) for i in chosen]


def golden_tokens(out, model_dir):
    import peft
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ids, labels = batch(base.config, model_dir)
    chosen, strings = token_ids(ids, Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json")))
    model = get_peft_model(base, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=mg.LINEARS,
                                            bias="none", task_type="CAUSAL_LM",
                                            trainable_token_indices=chosen))
    # A and B drawn as make_goldens.py draws them (B ~ N(0, 0.05²), not PEFT's B = 0): with B = 0
    # some of dB's elements are ~1e-8 (Adam's eps), where Adam's first steps amplify f32 rounding
    # past 1e-4.
    from peft.tuners.lora import LoraLayer
    g = torch.Generator().manual_seed(mg.LORA_SEED)
    with torch.no_grad():
        for _, module in model.named_modules():
            if isinstance(module, LoraLayer) and "default" in module.lora_A:
                a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
                bound = 1.0 / (a.shape[1] ** 0.5)
                a.copy_((torch.rand(a.shape, generator=g, dtype=torch.float32) * 2 - 1) * bound)
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float32) * mg.B_STD)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    shutil.rmtree("init_adapter", ignore_errors=True)
    model.save_pretrained("init_adapter")
    tensors = {"init." + k: t.float().clone()
               for k, t in load_file(os.path.join("init_adapter", "adapter_model.safetensors")).items()}
    with open(os.path.join("init_adapter", "adapter_config.json")) as f:
        adapter_config = f.read()
    opt = torch.optim.AdamW([p for _, p in params], lr=mg.LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=TOKENS_WD)
    model.train()
    tensors.update({"input_ids": ids, "labels": labels, "adamw.loss": train(model, params, opt, ids, labels)})
    shutil.rmtree("trained", ignore_errors=True)
    model.save_pretrained("trained")
    for k, t in load_file(os.path.join("trained", "adapter_model.safetensors")).items():
        tensors["adamw." + k] = t.float().clone()
    model.eval()
    with torch.no_grad():
        tensors["adamw.logits"] = model(input_ids=ids).logits.float().clone()
    meta = {"variant": "trainable_tokens", "model": model_dir, "token_ids": chosen, "tokens": strings,
            "tied": bool(base.config.tie_word_embeddings), "weight_decay": TOKENS_WD, "r": R,
            "lora_alpha": ALPHA, "lr": mg.LR, "steps": mg.STEPS, "adapter_config": adapter_config,
            "peft": peft.__version__, "torch": torch.__version__}
    save(tensors, out, meta)


def check_adapter(adapter_dir, golden):
    """PEFT loads rtune's saved adapter on the golden's base: missing / unexpected keys and the
    logits on the golden's batch against `adamw.logits` (max |diff| / max |golden|)."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    with safe_open(golden, "pt") as f:
        meta = json.loads(f.metadata()["config"])
    g = load_file(golden)
    base = AutoModelForCausalLM.from_pretrained(meta["model"], dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    saved = set(load_file(os.path.join(adapter_dir, "adapter_model.safetensors")))
    wanted = set(get_peft_model_state_dict(model))
    with torch.no_grad():
        logits = model(input_ids=g["input_ids"]).logits.float()
    want = g["adamw.logits"]
    res = {"missing": sorted(wanted - saved), "unexpected": sorted(saved - wanted),
           "logits_rel_err": ((logits - want).abs().max() / want.abs().max()).item()}
    print(json.dumps(res, indent=1))
    return 0 if not res["missing"] and not res["unexpected"] and res["logits_rel_err"] <= 1e-5 else 1


def save(tensors, out, meta):
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={"config": json.dumps(meta)})
    print("%s: losses %s, %d tensors" % (out, tensors["adamw.loss"].tolist(), len(tensors)), flush=True)


GOLDENS = {
    "golden_tiny_loraplus": golden_loraplus,
    "golden_tiny_pissa": lambda out: golden_split(out, "pissa"),
    "golden_tiny_pissa_niter_4": lambda out: golden_split(out, "pissa_niter_4"),
    "golden_tiny_olora": lambda out: golden_split(out, "olora"),
    "golden_tiny_l3_tokens": lambda out: golden_tokens(out, "tiny_l3"),
    "golden_tiny_tokens": lambda out: golden_tokens(out, "tiny"),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (made if missing)")
    ap.add_argument("--only", default=None, help="comma-separated golden names (default: all)")
    ap.add_argument("--check-adapter", default=None,
                    help="an adapter directory rtune saved: load it in PEFT against --golden and exit")
    ap.add_argument("--golden", default=None, help="the trainable-tokens golden --check-adapter compares with")
    args = ap.parse_args()
    adapter = os.path.abspath(args.check_adapter) if args.check_adapter else None
    golden = os.path.abspath(args.golden) if args.golden else None
    os.makedirs(args.out, exist_ok=True)
    os.chdir(args.out)
    mg.make_models(".")
    if adapter:
        sys.exit(check_adapter(adapter, golden))
    for name in (args.only.split(",") if args.only else GOLDENS):
        GOLDENS[name](name + ".safetensors")


if __name__ == "__main__":
    main()
