#!/usr/bin/env python3
"""Check `rtune export --format gguf-lora` against llama.cpp itself (not run in CI).

  rtune export --run RUN --format gguf-lora --out /tmp/lora.gguf
  python scripts/check_gguf_lora.py --llama-cpp LLAMA_CPP_SRC --base BASE_DIR --adapter RUN \\
      --ours /tmp/lora.gguf [--logits]

LLAMA_CPP_SRC is a llama.cpp source tree (convert_lora_to_gguf.py, convert_hf_to_gguf.py,
conversion/, gguf-py/; e.g. vendor/llama.cpp of the llama-cpp-python sdist). Needs torch and
transformers (the reference venv).

1. llama.cpp's convert_lora_to_gguf.py --outtype f32 on the same PEFT adapter -> the reference file;
   metadata (but descriptive general.* keys) and every tensor (name, GGML type, shape, bytes) compared with ours.
   rsLoRA adapters: ours stores alpha·√r (llama.cpp scales by alpha / r), the converter alpha.
2. --logits (needs the llama_cpp Python package): the base converted with convert_hf_to_gguf.py
   (f32), run by llama.cpp with our file as its LoRA adapter; logits compared with PEFT's
   base + adapter on the same token ids.
Exit 1 on any mismatch.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile


STRUCTURAL = {"general.architecture", "general.type", "general.quantization_version", "general.alignment",
              "general.file_type"}


def read_gguf(path):
    from gguf import GGUFReader

    r = GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        meta[k] = (f.types[0].name if f.types else None, f.contents())
    tensors = {t.name: t for t in r.tensors}
    return meta, tensors


def compare_files(ours, ref, rslora_r):
    import numpy as np

    mo, to = read_gguf(ours)
    mr, tr = read_gguf(ref)
    res = {"ours_metadata": mo, "ref_metadata": mr, "problems": []}
    for k in sorted(set(mo) | set(mr)):
        # Descriptive keys (name, tags, base model card) are not the adapter's layout.
        if k.startswith("general.") and k not in STRUCTURAL:
            continue
        a, b = mo.get(k), mr.get(k)
        if k == "adapter.lora.alpha" and rslora_r and a and b:
            b = (b[0], b[1] * math.sqrt(rslora_r))
            if abs(a[1] - b[1]) <= 1e-5 * abs(b[1]):
                continue
        if a != b:
            res["problems"].append(f"metadata {k}: ours {a}, llama.cpp {b}")
    if set(to) != set(tr):
        res["problems"].append(f"tensor names differ: only ours {sorted(set(to) - set(tr))[:5]}, "
                               f"only llama.cpp {sorted(set(tr) - set(to))[:5]}")
    same = 0
    for n in sorted(set(to) & set(tr)):
        x, y = to[n], tr[n]
        if list(x.shape) != list(y.shape) or x.tensor_type != y.tensor_type:
            res["problems"].append(f"{n}: ours {x.tensor_type.name} {list(x.shape)}, "
                                   f"llama.cpp {y.tensor_type.name} {list(y.shape)}")
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            res["problems"].append(f"{n}: values differ")
        else:
            same += 1
    res["tensors_identical"] = f"{same}/{len(tr)}"
    return res


# convert_hf_to_gguf.py for a test model: its tokenizer (a tiny byte-level BPE) is not one llama.cpp
# knows by hash, and only token ids are fed here, so the pre-tokenizer falls back to "default";
# without sentencepiece installed, a directory without tokenizer.model skips that vocab type.
CONVERT_BASE = """
import runpy, sys
src, base, out = sys.argv[1:4]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as b
pre = b.TextModel.get_vocab_base_pre
def get_pre(self, tok):
    try:
        return pre(self, tok)
    except NotImplementedError:
        return "default"
b.TextModel.get_vocab_base_pre = get_pre
sp = b.TextModel._set_vocab_sentencepiece
def set_sp(self, *a, **k):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("tokenizer.model")
    return sp(self, *a, **k)
b.TextModel._set_vocab_sentencepiece = set_sp
sys.argv = ["convert_hf_to_gguf.py", base, "--outtype", "f32", "--outfile", out]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def logits_check(src, base, adapter, ours, ids, tmp):
    import numpy as np
    import torch
    from llama_cpp import Llama
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_gguf = os.path.join(tmp, "base.gguf")
    subprocess.run([sys.executable, "-c", CONVERT_BASE, src, base, base_gguf], check=True, capture_output=True)
    out = {}
    for name, lora in [("base", None), ("base+lora", ours)]:
        kw = {"lora_path": lora} if lora else {}
        # f32 KV cache (type 0): the default f16 cache alone costs ~2e-4 relative.
        llm = Llama(model_path=base_gguf, n_ctx=64, logits_all=True, verbose=False, n_threads=2,
                    type_k=0, type_v=0, **kw)
        llm.reset()
        llm.eval(ids)
        out[name] = np.array(llm.scores[: len(ids)], dtype=np.float64)
        del llm
    with torch.no_grad():
        m = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager").eval()
        t = torch.tensor([ids])
        hf_base = m(input_ids=t).logits[0].double().numpy()
        peft = PeftModel.from_pretrained(m, adapter).eval()
        hf_lora = peft(input_ids=t).logits[0].double().numpy()
    scale = np.abs(hf_lora).max()
    return {
        "rel|llama.cpp base - transformers base|": float(np.abs(out["base"] - hf_base).max() / scale),
        "rel|llama.cpp base+lora - PEFT base+adapter|": float(np.abs(out["base+lora"] - hf_lora).max() / scale),
        "rel|PEFT base+adapter - base| (adapter effect)": float(np.abs(hf_lora - hf_base).max() / scale),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree")
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--ours", required=True)
    ap.add_argument("--logits", action="store_true")
    ap.add_argument("--ids", default="1,40,41,42,43,44,45,46,7,8,9,200,300,400,500")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(args.llama_cpp, "gguf-py"))
    cfg = json.load(open(os.path.join(args.adapter, "adapter_config.json")))
    with tempfile.TemporaryDirectory() as tmp:
        ref = os.path.join(tmp, "ref.gguf")
        subprocess.run([sys.executable, os.path.join(args.llama_cpp, "convert_lora_to_gguf.py"), args.adapter,
                        "--base", args.base, "--outtype", "f32", "--outfile", ref],
                       check=True, capture_output=True)
        res = compare_files(args.ours, ref, cfg["r"] if cfg.get("use_rslora") else None)
        if args.logits:
            ids = [int(x) for x in args.ids.split(",")]
            res.update(logits_check(args.llama_cpp, args.base, args.adapter, args.ours, ids, tmp))
            if res["rel|llama.cpp base+lora - PEFT base+adapter|"] > args.tol:
                res["problems"].append("llama.cpp's logits with the adapter differ from PEFT's")
    print(json.dumps(res, indent=1, default=str))
    print("RESULT:", "OK" if not res["problems"] else "FAIL")
    sys.exit(0 if not res["problems"] else 1)


if __name__ == "__main__":
    main()
