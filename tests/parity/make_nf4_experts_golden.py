"""NF4 expert stacks (issue 45, `[model] quantize_experts`): each expert's `(out, in)` matrix of a 3-D
stack quantized alone by bitsandbytes 0.50.2's `quantize_4bit` (NF4, blocksize 64, plain and double
quant) and dequantized by its `dequantize_4bit`, on the CPU. rtune holds an NF4 stack as one such
matrix per expert (`rtune_experts::moe::stack`); `crates/experts/src/moe/stack_tests.rs` checks its
packed codes, scales and dequantized values against these, bit for bit.

    /work/.venv-ref/bin/python tests/parity/make_nf4_experts_golden.py \
        --out tests/parity/golden_nf4_experts.safetensors

Per case `<c>` (shapes `(E, out, in)`: a gate_up-like stack with a short last block per expert, a
down-like one of a single short block, and one of 300 blocks per expert, two nested blocks of 256
for double quant), with `<q>` in `nf4`, `nf4dq`:
- `<c>.stack` f32 `(E, out, in)`, seeded normal draws (std 0.05);
- `<c>.<q>.packed` u8 `(E, ceil(out·in / 2))`: each expert's codes as bitsandbytes packs them;
- `<c>.<q>.absmax` f32 `(E, blocks)`: each block's scale, decoded (double quant: bitsandbytes'
  own `dequantize_blockwise` of its 8-bit codes, plus the offset);
- `<c>.<q>.dequant` f32 `(E, out, in)`: `dequantize_4bit` of each expert.
Byte-identical on rerun.
"""
import argparse
import os

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")

import torch
import bitsandbytes.functional as F
from safetensors.torch import save_file

CASES = {"gate_up": (3, 10, 24), "down": (3, 8, 5), "wide": (2, 96, 200)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(45)
    out = {}
    for name, (e_n, o, i) in CASES.items():
        stack = (torch.randn((e_n, o, i), generator=g) * 0.05).float()
        out[f"{name}.stack"] = stack
        for q, dq in (("nf4", False), ("nf4dq", True)):
            packed, absmax, deq = [], [], []
            for e in range(e_n):
                w = stack[e].contiguous()
                p, st = F.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=dq)
                packed.append(p.reshape(-1).view(torch.uint8).clone())
                if dq:
                    a = F.dequantize_blockwise(st.absmax, st.state2) + st.offset
                else:
                    a = st.absmax
                absmax.append(a.float().reshape(-1).clone())
                deq.append(F.dequantize_4bit(p, st).float().reshape(o, i).clone())
            out[f"{name}.{q}.packed"] = torch.stack(packed)
            out[f"{name}.{q}.absmax"] = torch.stack(absmax)
            out[f"{name}.{q}.dequant"] = torch.stack(deq)
    # One metadata key: safetensors writes a dict's keys in no fixed order.
    meta = {"versions": "torch %s, bitsandbytes %s" % (torch.__version__, __import__("bitsandbytes").__version__)}
    save_file(out, args.out, metadata=meta)


if __name__ == "__main__":
    main()
