#!/usr/bin/env python3
"""Check `rtune export --format merged` against transformers + PEFT (not run in CI: needs torch).

  rtune train --config configs/smoke.toml --set model.path=tests/fixtures/tiny-llama \\
      --set train.steps=20 --set output.dir=/tmp/run
  rtune export --run /tmp/run --format merged --out /tmp/merged
  python scripts/check_export.py --base tests/fixtures/tiny-llama --adapter /tmp/run --merged /tmp/merged

1. transformers loads the merged directory (AutoModelForCausalLM, f32 compute) -> logits_merged
2. base + adapter in PEFT (PeftModel.from_pretrained, f32) -> logits_peft
3. PEFT's own merge_and_unload() in the base's stored dtype: its weights vs the exported ones
   (where they differ, also each one's distance to the merge done in f32)
   (the export loaded by transformers in that dtype, so a mixture-of-experts base's per-expert
   tensors compare with PEFT's fused stacks)
4. the adapter's keys as PEFT loads them: missing (adapter parameters of the PEFT model the file
   lacks, DoRA magnitudes included) and unexpected (file keys PEFT does not use), both must be empty
Prints the numbers as JSON; exit 1 if max|logits_merged - logits_peft| / max|logits_peft| > --tol.
"""
import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load(path, dtype):
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return m.eval()


def exported_weights(merged_dir):
    """Every tensor of a Hugging Face safetensors directory (one file or sharded)."""
    index = os.path.join(merged_dir, "model.safetensors.index.json")
    files = (sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index)
             else ["model.safetensors"])
    out = {}
    for f in files:
        out.update(load_file(os.path.join(merged_dir, f)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--ids", default="1,40,41,42,43,44,45,46;1,7,8,9,200,300,400,500")
    ap.add_argument("--tol", type=float, default=1e-5,
                    help="relative logits tolerance (f32 base: 1e-5; bf16 base: ~2e-2)")
    args = ap.parse_args()
    ids = torch.tensor([[int(x) for x in r.split(",")] for r in args.ids.split(";")])
    res = {}
    with torch.no_grad():
        merged = load(args.merged, torch.float32)
        logits_merged = merged(input_ids=ids).logits.float()
        res["merged_class"] = type(merged).__name__
        base = load(args.base, torch.float32)
        logits_base = base(input_ids=ids).logits.float()
        peft = PeftModel.from_pretrained(base, args.adapter).eval()
        logits_peft = peft(input_ids=ids).logits.float()
        from peft.utils import set_peft_model_state_dict
        saved = load_file(os.path.join(args.adapter, "adapter_model.safetensors"))
        keys = set_peft_model_state_dict(peft, saved)
        res["use_dora"] = bool(peft.peft_config["default"].use_dora)
        res["adapter_tensors"] = len(saved)
        res["adapter_missing_keys"] = [k for k in keys.missing_keys if "lora_" in k]
        res["adapter_unexpected_keys"] = list(keys.unexpected_keys)
        scale = logits_peft.abs().max().item()
        res["max|merged-peft|"] = (logits_merged - logits_peft).abs().max().item()
        res["rel|merged-peft|"] = res["max|merged-peft|"] / scale
        res["rel|base-peft| (adapter effect)"] = (logits_base - logits_peft).abs().max().item() / scale

        # PEFT's merge in the stored dtype, weight by weight.
        dtype = next(iter(exported_weights(args.base).values())).dtype  # the base as stored
        res["base_dtype"] = str(dtype)
        base_native = load(args.base, dtype)
        peft_merged = PeftModel.from_pretrained(base_native, args.adapter).merge_and_unload()
        sd = peft_merged.state_dict()
        res["tensors_exported"] = len(exported_weights(args.merged))
        # The exported weights as transformers holds them (a mixture-of-experts checkpoint's
        # per-expert tensors fused into its stacks on load, as PEFT's merged model has them).
        ours = load(args.merged, dtype).state_dict()
        missing = [k for k in sd if k not in ours and not (k == "lm_head.weight"
                                                            and peft_merged.config.tie_word_embeddings)]
        res["tensors_missing_vs_transformers"] = missing
        # The exact merge, for reference: PEFT's merge_and_unload with everything in f32.
        exact = PeftModel.from_pretrained(load(args.base, torch.float32), args.adapter)
        exact = exact.merge_and_unload().state_dict()
        diff_tensors, diff_elems = 0, 0
        err_ours, err_peft = [], []
        for k, v in ours.items():
            p = sd[k]
            if p.dtype != v.dtype or p.shape != v.shape:
                res.setdefault("dtype_or_shape_mismatch", []).append(k)
                continue
            ne = (p != v).sum().item()
            if ne:
                diff_tensors += 1
                diff_elems += ne
                e = exact[k].float()
                err_ours.append((v.float() - e).abs().flatten())
                err_peft.append((p.float() - e).abs().flatten())
        res["weights_differing_from_peft_merge"] = {"tensors": diff_tensors, "elements": diff_elems}
        if err_ours:
            eo, ep = torch.cat(err_ours), torch.cat(err_peft)
            # Distance to the exact f32 merge over the tensors that differ: rtune rounds once.
            res["|w - exact f32 merge| in those tensors"] = {
                "rtune": {"max": eo.max().item(), "mean": eo.mean().item()},
                "peft": {"max": ep.max().item(), "mean": ep.mean().item()},
                "elements where rtune is closer / farther": [(eo < ep).sum().item(), (eo > ep).sum().item()],
            }
    ok = (res["rel|merged-peft|"] <= args.tol and not missing and "dtype_or_shape_mismatch" not in res
          and not res["adapter_missing_keys"] and not res["adapter_unexpected_keys"])
    print(json.dumps(res, indent=1))
    print("RESULT:", "OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
