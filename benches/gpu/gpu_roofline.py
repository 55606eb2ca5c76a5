#!/usr/bin/env python3
"""The card's two ceilings, measured with torch (METHOD.md: "measure the two ceilings once"):

- copy bandwidth: a large device-to-device copy, GB/s counting bytes read + bytes written;
- bf16 GEMM rate: 8192^3 and the GEMMs of one Llama-3-8B training step at 2048 tokens
  (x @ W^T as F.linear does: forward of q/k/v/o, gate/up, down, lm_head);
- for reference, bitsandbytes' own NF4 dequantize (the op PEFT runs before every 4-bit matmul), as
  GB/s and as a fraction of copy bandwidth: the yardstick for rtune's NF4 kernel (goal >= 85% of copy).

  python gpu_roofline.py --json-out roofline.json
  python gpu_roofline.py --device cpu --small          # CPU smoke test

Each number is the median of --reps timed runs after warm-up runs, timed with CUDA events; inputs are
random (METHOD.md: a GEMM on zeros ran 13% faster here).
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

# (name, tokens M, in K, out N): y[M,N] = x[M,K] @ W[N,K]^T
LAYER_GEMMS = [
    ("q/o 2048x4096x4096", 2048, 4096, 4096),
    ("k/v 2048x4096x1024", 2048, 4096, 1024),
    ("gate/up 2048x4096x14336", 2048, 4096, 14336),
    ("down 2048x14336x4096", 2048, 14336, 4096),
    ("lm_head 2048x4096x128256", 2048, 4096, 128256),
]


def timed(fn, dev, warmup, reps):
    """Median seconds of fn() over reps runs."""
    for _ in range(warmup):
        fn()
    ts = []
    if dev.type == "cuda":
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--copy-gib", type=float, default=2.0, help="size of each copy buffer (>> 60 MB L2)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="tiny sizes, for a CPU smoke test")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    scale = 16 if a.small else 1   # --small: every dimension / 16
    res = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__}

    # Copy: uint8 random bytes; bytes moved = read n + write n.
    n = int(a.copy_gib * 2**30) // (scale**3)
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), dev, 3, a.reps)
    res["copy_bytes"] = 2 * n
    res["copy_gb_s"] = round(2 * n / t / 1e9, 1)
    print(f"copy {n / 2**30:.2f} GiB: {t * 1e3:.3f} ms, {res['copy_gb_s']:.0f} GB/s (read + write)", flush=True)
    del src, dst

    # GEMMs in bf16 with fp32 accumulation (torch's default for bf16 matmul).
    gemms = [("square 8192x8192x8192", 8192, 8192, 8192)] + LAYER_GEMMS
    res["gemm"] = []
    for name, m, k, nn in gemms:
        m, k, nn = m // scale, k // scale, nn // scale
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(nn, k, device=dev, dtype=torch.bfloat16)
        t = timed(lambda: F.linear(x, w), dev, 3, a.reps)
        tf = 2 * m * k * nn / t / 1e12
        res["gemm"].append({"name": name, "m": m, "k": k, "n": nn, "ms": round(t * 1e3, 4), "tflops": round(tf, 1)})
        print(f"gemm {name:28s} (/{scale}) {t * 1e3:8.3f} ms {tf:7.1f} TFLOP/s", flush=True)
        del x, w
    res["gemm_8192_tflops"] = res["gemm"][0]["tflops"]

    # bitsandbytes NF4 dequantize of the 8B's largest weight [14336, 4096] to bf16. Bytes: packed codes
    # (n/2) + fp32 absmax (4 per 64-block) read, bf16 (2n) written.
    try:
        import bitsandbytes as bnb
        w = torch.randn(14336 // scale, 4096 // scale, device=dev, dtype=torch.bfloat16)
        q, qs = bnb.functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
        t = timed(lambda: bnb.functional.dequantize_4bit(q, qs), dev, 3, a.reps)
        ne = w.numel()
        nbytes = ne // 2 + ne // 64 * 4 + 2 * ne
        res["bnb_nf4_dequant_gb_s"] = round(nbytes / t / 1e9, 1)
        res["bnb_nf4_vs_copy"] = round(res["bnb_nf4_dequant_gb_s"] / res["copy_gb_s"], 3)
        res["bitsandbytes"] = bnb.__version__
        print(f"bnb nf4 dequant {tuple(w.shape)} -> bf16: {t * 1e3:.3f} ms, {res['bnb_nf4_dequant_gb_s']:.0f} GB/s "
              f"({res['bnb_nf4_vs_copy']:.0%} of copy)", flush=True)
    except Exception as e:  # bitsandbytes missing or broken: the ceilings above still stand
        res["bnb_error"] = f"{type(e).__name__}: {e}"
        print("bnb nf4 dequant: skipped:", res["bnb_error"], flush=True)

    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
