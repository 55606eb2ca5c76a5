#!/usr/bin/env python3
"""GPU baseline for `rtune bench`: transformers + PEFT + bitsandbytes QLoRA training steps on a random
Llama (default: the Llama-3-8B shape), on the same card, same shape, same step as rtune.

  python bench_peft_gpu.py --json-out peft.json                 # llama3-8b, NF4, seq 2048, batch 1, r 16
  python bench_peft_gpu.py --layers 4 --seq 1024 --steps 3      # smaller: any flag overrides the preset
  python bench_peft_gpu.py --preset tiny --device cpu --steps 2 --warmup 1   # CPU smoke test

The recipe is what a typical QLoRA user gets from TRL's SFTTrainer(bf16=True, gradient_checkpointing=True)
on a model loaded with BitsAndBytesConfig(load_in_4bit, nf4, compute bf16), i.e. the HF defaults:
- base: random init in bf16 on the device; the 7 linears of every layer swapped for bnb.nn.Linear4bit
  (NF4, blocksize 64, no double quant, uint8 storage, compute bf16) exactly as from_pretrained's bnb
  path builds them; lm_head and embeddings stay unquantized (bnb's default skip list);
- peft.prepare_model_for_kbit_training (freeze, non-4-bit params to fp32, gradient checkpointing with
  use_reentrant=False), get_peft_model (LoRA fp32), then TRL's peft_module_casting_to_bf16 (norms fp32,
  embed_tokens/lm_head back to bf16);
- sdpa attention (flash backend on Hopper for bf16); the step is Trainer's: forward under
  torch.autocast(bf16), backward, clip_grad_norm_(1.0), AdamW step, zero_grad. AdamW is plain
  torch.optim.AdamW(fused=True), Trainer's default optim "adamw_torch_fused" (not paged: paged AdamW
  only matters when the optimizer state would not fit; here it is 0.3 GB), weight decay 0, constant lr.
  Trainer's logging/metrics and TRL's per-step token-accuracy are left out (they would only slow PEFT).

Timed: --steps steps after --warmup, each bracketed by torch.cuda.synchronize(). tokens/s = batch*seq /
median step time. Peak memory: torch.cuda.max_memory_allocated/_reserved over the timed part, reset
after building the model (the random bf16 init briefly holds the unquantized 16 GB, a loading artefact).
FLOPs and MFU: flops_per_token() / mfu() below, the one definition run.sh's report also uses.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRESETS = {
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
    # tiny: for the CPU smoke test only (dims multiples of 64: bnb 0.50.2's CPU dequantize is wrong for a
    # last dim like 352, codes right, values off by 25%)
    "tiny": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=384, vocab=1024),
}
# Dense bf16 tensor-core peak of the H100/H200 SXM by NVIDIA's datasheet (989.4 TFLOP/s without
# sparsity; H200.md: "dense bf16 about 990"). A measured 8192^3 GEMM reaches ~790 on this workplace's
# H200 (KINDS.md), so MFU tops out near 80% even for a pure GEMM.
PEAK_BF16_FLOPS = 989.4e12


def matmul_params(hidden, layers, heads, kv_heads, intermediate, vocab, head_dim=None):
    """N: weights that take part in a matmul per token: the 7 linears of every layer plus lm_head.
    Embeddings (a lookup) and norms (elementwise) are not counted; LoRA's own (r=16: 0.6% of N) neither."""
    hd = head_dim or hidden // heads
    q, kv = heads * hd, kv_heads * hd
    per_layer = hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * intermediate
    return layers * per_layer + vocab * hidden


def flops_per_token(hidden, layers, heads, kv_heads, intermediate, vocab, seq, head_dim=None):
    """Training FLOPs per token, the PaLM-paper convention (Chowdhery et al. 2022, appendix B):

        6*N + 12 * layers * seq * (heads * head_dim)

    6N: forward 2N (one multiply-add per weight), backward 4N (input gradient 2N + weight gradient 2N).
    Attention per token per layer: the forward's Q.K^T and P.V are each 2*seq*d FLOPs (d = heads*head_dim)
    counted as full, non-causal attention (a causal kernel needs only half); backward = 2x forward;
    so 3 * 4*seq*d = 12*seq*d.
    Counted as the convention has it, NOT as done: gradient checkpointing's recomputed forward (+2N) is
    not counted, and neither is the fact that LoRA skips the frozen base's weight gradients (-2N); for
    QLoRA with checkpointing the two cancel, so this is also close to the FLOPs the GPU really executes.
    rtune's `flops_per_token` must use the same definition (run.sh's report checks it)."""
    hd = head_dim or hidden // heads
    n = matmul_params(hidden, layers, heads, kv_heads, intermediate, vocab, head_dim)
    return 6 * n + 12 * layers * seq * heads * hd


def mfu(tokens_per_s, flops_per_tok, peak_flops=PEAK_BF16_FLOPS):
    """Model FLOPs utilisation: achieved FLOP/s / peak dense bf16 FLOP/s."""
    return tokens_per_s * flops_per_tok / peak_flops


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama3-8b",
                    help="shape; the flags below override single fields")
    for k in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--no-quant", action="store_true", help="bf16 LoRA base instead of NF4 (if bnb is absent)")
    ap.add_argument("--no-grad-ckpt", action="store_true")
    ap.add_argument("--attn", default="sdpa", help="sdpa | eager")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_BF16_FLOPS / 1e12)
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (CPU runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    for k, v in PRESETS[a.preset].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    return a


def build_model(a, dev, torch):
    """Random bf16 Llama on `dev`, its decoder linears in NF4 as from_pretrained(BitsAndBytesConfig) makes them."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                      num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate, vocab_size=a.vocab,
                      max_position_embeddings=max(8192, a.seq), rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = a.attn
    torch.set_default_dtype(torch.bfloat16)   # init straight in bf16 on the device: no fp32 copy of 8B
    with torch.device(dev):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    if a.no_quant:
        return model
    import bitsandbytes as bnb
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in TARGETS:
                old = getattr(parent, name, None)
                if old is None:
                    continue
                new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=False,
                                        compute_dtype=torch.bfloat16, compress_statistics=False,
                                        quant_type="nf4", quant_storage=torch.uint8, device="meta")
                # Params4bit.to(device) quantizes: the same call transformers' Bnb4bitQuantize makes.
                new.weight = bnb.nn.Params4bit(old.weight.data, requires_grad=False, compress_statistics=False,
                                               quant_type="nf4", quant_storage=torch.uint8, module=new).to(dev)
                setattr(parent, name, new)
                del old
    # What transformers' bnb quantizer sets after loading: PEFT dispatches its bnb LoRA layer and TRL its
    # QLoRA preparation on this flag.
    model.is_loaded_in_4bit = True
    return model


def main(argv=None):
    a = parse_args(argv)
    import torch
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    t_setup = time.perf_counter()
    model = build_model(a, dev, torch)
    gc_kwargs = {"use_reentrant": False}
    if not a.no_quant:
        # TRL (trl/models/utils.py prepare_peft_model) for a 4-bit model: prepare_model_for_kbit_training,
        # which freezes, upcasts every non-4-bit param to fp32 and turns on checkpointing.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=not a.no_grad_ckpt,
                                                gradient_checkpointing_kwargs=gc_kwargs)
    elif not a.no_grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=gc_kwargs)
    model = get_peft_model(model, LoraConfig(r=a.r, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=TARGETS,
                                             bias="none", task_type="CAUSAL_LM"))
    if not a.no_quant:
        # TRL's peft_module_casting_to_bf16 (bf16=True, 4-bit): norms fp32, embeddings and lm_head bf16.
        for name, mod in model.named_modules():
            if "norm" in name:
                mod.to(torch.float32)
            elif any(x in name for x in ("lm_head", "embed_tokens")) and getattr(mod, "weight", None) is not None \
                    and mod.weight.dtype == torch.float32:
                mod.to(torch.bfloat16)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_lora = sum(p.numel() for p in trainable)
    opt = torch.optim.AdamW(trainable, lr=a.lr, weight_decay=0.0, fused=cuda)
    n_4bit = sum(1 for m in model.modules() if type(m).__name__ == "Linear4bit" and "lora" in type(m).__module__)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})

    g = torch.Generator().manual_seed(a.seed)
    batches = [torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(dev) for _ in range(a.warmup + a.steps)]
    sync()
    setup_s = time.perf_counter() - t_setup
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        resident = torch.cuda.memory_allocated(dev)

    def step(ids):
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for i, ids in enumerate(batches):
        sync()
        t0 = time.perf_counter()
        loss = step(ids)
        sync()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if i >= a.warmup:
            times.append(dt)
        print(f"step {i:2d} {'warmup' if i < a.warmup else 'timed '} {dt:8.4f}s loss {losses[-1]:.4f}", flush=True)

    tok_step = a.batch * a.seq
    med = statistics.median(times)
    tps = tok_step / med
    shape = {k: getattr(a, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab")}
    fpt = flops_per_token(seq=a.seq, **shape)
    res = {
        "impl": "peft+bitsandbytes" if not a.no_quant else "peft (bf16 base)",
        "config": {k: v for k, v in vars(a).items() if k != "json_out"},
        "recipe": {"quant": None if a.no_quant else "nf4, blocksize 64, no double quant, compute bf16",
                   "autocast": "bf16", "attn": a.attn, "gradient_checkpointing": not a.no_grad_ckpt,
                   "optimizer": f"torch.optim.AdamW(fused={cuda}), wd 0, clip 1.0",
                   "param_dtypes": dtypes, "lora_4bit_layers": n_4bit},
        "tokens_per_s": round(tps, 2),
        "step_s_median": round(med, 5), "step_s": [round(t, 5) for t in times],
        "step_s_min": round(min(times), 5), "step_s_max": round(max(times), 5),
        "matmul_params": matmul_params(**shape), "flops_per_token": fpt,
        "mfu": round(mfu(tps, fpt, a.peak_tflops * 1e12), 4), "peak_flops": a.peak_tflops * 1e12,
        "lora_params": n_lora, "setup_s": round(setup_s, 2),
        "first_loss": losses[0], "last_loss": losses[-1],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                     "python": sys.version.split()[0]},
    }
    if not a.no_quant:
        import bitsandbytes
        res["versions"]["bitsandbytes"] = bitsandbytes.__version__
    if cuda:
        free, total = torch.cuda.mem_get_info(dev)
        res.update({
            "device": torch.cuda.get_device_name(dev),
            "peak_memory_bytes": torch.cuda.max_memory_allocated(dev),       # tensors alive at the peak
            "peak_memory_reserved_bytes": torch.cuda.max_memory_reserved(dev),  # + the caching allocator's slack
            "resident_bytes_before_steps": resident,                          # weights + LoRA + batches
            # whole device, CUDA context included, at the end (what nvidia-smi shows)
            "device_used_bytes_end": total - free,
        })
    else:
        res.update({"device": "cpu", "peak_memory_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                    "peak_memory_note": "peak RSS of the process (CPU run)"})
    print(json.dumps(res, indent=1))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
