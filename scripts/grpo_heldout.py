#!/usr/bin/env python3
"""The held-out reward of a GRPO config, greedy: each held-out prompt rendered as training renders
it, completed greedily by `rtune generate` (with the run's adapter or without), and scored by the
config's built-in `[[reward]]` functions (`regex`, `answer`; weighted as the run weighs them).
Standard library only; drives the release binary.

  python3 scripts/grpo_heldout.py --config configs/smollm2-135m-grpo.toml [--adapter runs/smollm2-arith-grpo]

1. `rtune data inspect --json` renders the held-out file (`--data`, default data/arith-heldout.jsonl)
   with the config's template and lengths, unshuffled: each prompt's text, in file order.
2. `rtune generate --prompt TEXT --temperature 0 --max-new-tokens <max_completion_length>` per
   prompt: greedy, stopping at the model's end-of-turn token as sampling in training does.
3. Each reward as rtune's built-ins score it (the pattern searched anywhere; the answer the last
   `extract` match's first group, equal as numbers within `tolerance`, else as trimmed text).
Prints one JSON line: the mean total reward, each reward's mean, the prompts, and the seconds.
`--show N` also prints the first N completions. Python's `re` reads these patterns as Rust's
`regex` does (no look-around or backreferences in them).
"""
import argparse
import json
import math
import re
import subprocess
import sys
import time
import tomllib

DEFAULT_EXTRACT = r"(?s)<answer>\s*(.*?)\s*</answer>"


def rewards_of(cfg):
    """The config's `[[reward]]` tables as scoring functions `(completion, row) -> float`."""
    out = []
    for t in cfg.get("reward", []):
        kind, name, w = t.get("kind"), t["name"], t.get("weight", 1.0)
        if kind == "regex":
            pat = re.compile(t["pattern"])
            out.append((name, w, lambda c, row, pat=pat: float(bool(pat.search(c)))))
        elif kind == "answer":
            ext, col, tol = re.compile(t.get("extract", DEFAULT_EXTRACT)), t["column"], t.get("tolerance")
            out.append((name, w, lambda c, row, e=ext, k=col, tol=tol: answer(e, c, row.get(k), tol)))
        else:
            sys.exit(f"grpo_heldout.py: reward {name!r} is of kind {kind!r}; only regex and answer are scored here")
    return out


def answer(extract, completion, want, tol):
    matches = list(extract.finditer(completion))
    if not matches or want is None:
        return 0.0
    m = matches[-1]
    got = (m.group(1) if m.re.groups >= 1 and m.group(1) is not None else m.group(0)).strip()
    if tol is None:
        return float(got == (want.strip() if isinstance(want, str) else json.dumps(want)))
    try:
        g, w = float(got), float(want)
    except (TypeError, ValueError):
        return 0.0
    return float(math.isfinite(g) and abs(g - w) <= tol)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True)
    ap.add_argument("--adapter", help="the run's output dir (PEFT adapter); none: the base model")
    ap.add_argument("--data", default="data/arith-heldout.jsonl")
    ap.add_argument("--rtune", default="target/release/rtune")
    ap.add_argument("--show", type=int, default=0)
    a = ap.parse_args()

    with open(a.config, "rb") as f:
        cfg = tomllib.load(f)
    max_new = cfg["train"].get("max_completion_length", 512)
    rewards = rewards_of(cfg)
    with open(a.data, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]

    t0 = time.time()
    sets = ["--set", f"data.train={a.data}", "--set", "data.shuffle=false"]
    shown = subprocess.run([a.rtune, "data", "inspect", "--config", a.config, *sets, "--json",
                            "-n", str(len(rows))], check=True, capture_output=True, text=True).stdout
    prompts = [json.loads(line)["text"] for line in shown.splitlines() if line.startswith("{")]
    if len(prompts) != len(rows):
        sys.exit(f"grpo_heldout.py: {a.data}: {len(rows)} rows but {len(prompts)} prompts rendered "
                 "(a prompt too long for max_seq_len − max_completion_length is left out)")

    model = cfg["model"]["path"]
    totals, per = [], {n: [] for n, _, _ in rewards}
    for i, (text, row) in enumerate(zip(prompts, rows)):
        cmd = [a.rtune, "generate", "--model", model, "--prompt", text, "--temperature", "0",
               "--max-new-tokens", str(max_new)]
        if a.adapter:
            cmd += ["--adapter", a.adapter]
        c = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        scores = [(n, w, fn(c, row)) for n, w, fn in rewards]
        for n, _, s in scores:
            per[n].append(s)
        totals.append(sum(w * s for _, w, s in scores))
        if i < a.show:
            print(f"--- {row.get('answer')!r}: {c!r}", file=sys.stderr)

    mean = lambda v: sum(v) / len(v)
    print(json.dumps({
        "adapter": a.adapter, "prompts": len(rows), "reward": round(mean(totals), 4),
        **{f"rewards/{n}/mean": round(mean(v), 4) for n, v in per.items()},
        "seconds": round(time.time() - t0, 1),
    }))


if __name__ == "__main__":
    main()
