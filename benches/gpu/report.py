#!/usr/bin/env python3
"""The final table of run.sh: reads DIR/{selftest,rtune_tiny,rtune,peft,roofline}.json (any may be
missing) and DIR/steps.tsv (each step's outcome, written by run.sh), prints rtune vs PEFT and the goals
met / not met, writes DIR/summary.json and the one report of the run, DIR/report.json:

  {"meta": {...}, "steps": [{name, file, status, seconds}], "selftest": S, "rtune_tiny": S, "rtune": S,
   "peft": S, "roofline": S, "summary": {...}}
  S = {"status": "ok" | "FAILED rc=N" | "TIMEOUT" | "skipped: why", "result": <the step's JSON> | null}
      plus "skipped": why when the step was not run for a known reason (no torch, no binary, budget).

  python report.py --dir $OUT [--preset llama3-8b] [--layers N] [--seq 2048] [--batch 1] [--quick]
                   [--mode full|quick|dry] [--device cuda:0] [--toggles "cudnn add_norm ... all"]

With --toggles, DIR/unfused_<name>.json (rtune's bench with RTUNE_UNFUSED=<name>) for each name gives
the toggle table: each fast path's share of the step, (step with it off - step with all on) / step
with it off, i.e. the fraction of the unfused step that path saves; report.json's "toggles" holds
each one's status, result and share.

Both sides' tokens/s and MFU are computed here the same way: tokens/s = batch*seq / step_s_median,
MFU = tokens/s * flops_per_token / peak (bench_peft_gpu.flops_per_token and .mfu, the one definition).
Each JSON's own flops_per_token is checked against that definition for the shape run.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peft_gpu import PEAK_BF16_FLOPS, PRESETS, flops_per_token, matmul_params, mfu  # noqa: E402

GOAL_SPEEDUP, GOAL_MFU, GOAL_PEAK_BYTES, GOAL_NF4 = 2.5, 0.45, 7.5e9, 0.85


def load(d, name):
    p = os.path.join(d, f"{name}.json")
    try:
        with open(p) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        print(f"warning: {p}: {e}")
        return None


def mark(ok):
    return "n/a" if ok is None else ("met" if ok else "NOT MET")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="smaller shape: memory and MFU goals are n/a")
    ap.add_argument("--mode", default="full", help="run.sh's mode, recorded in report.json")
    ap.add_argument("--device", default="cuda:0", help="recorded in report.json")
    ap.add_argument("--toggles", default="", help="RTUNE_UNFUSED names run.sh ran (unfused_<name>.json)")
    a = ap.parse_args(argv)
    shape = dict(PRESETS[a.preset])
    if a.layers:
        shape["layers"] = a.layers
    fpt_ref, n_ref = flops_per_token(seq=a.seq, **shape), matmul_params(**shape)
    st, rl, rt, pf = (load(a.dir, n) for n in ("selftest", "roofline", "rtune", "peft"))
    notes, sides = [], {}

    for name, j in (("rtune", rt), ("PEFT", pf)):
        if not j:
            continue
        if j.get("step_s_median"):
            tps = a.batch * a.seq / j["step_s_median"]
            if j.get("tokens_per_s") and abs(j["tokens_per_s"] / tps - 1) > 0.02:
                notes.append(f"{name}: its tokens_per_s {j['tokens_per_s']:.0f} != batch*seq/step_s_median {tps:.0f}")
        else:
            tps = j.get("tokens_per_s")
        fpt = j.get("flops_per_token") or fpt_ref
        if abs(fpt / fpt_ref - 1) > 0.01:
            notes.append(f"{name}: flops_per_token {fpt:.4g} differs from the definition's {fpt_ref:.4g}; using the latter")
            fpt = fpt_ref
        if j.get("matmul_params") and j["matmul_params"] != n_ref:
            notes.append(f"{name}: matmul_params {j['matmul_params']} != {n_ref} (shape mismatch?)")
        sides[name] = {"tokens_per_s": tps, "step_s_median": j.get("step_s_median"),
                       "mfu": mfu(tps, fpt) if tps else None, "peak_memory_bytes": j.get("peak_memory_bytes"),
                       "peak_memory_reserved_bytes": j.get("peak_memory_reserved_bytes")}

    r, p = sides.get("rtune"), sides.get("PEFT")
    speedup = r["tokens_per_s"] / p["tokens_per_s"] if r and p and r["tokens_per_s"] and p["tokens_per_s"] else None
    nf4 = None
    if st:
        nf4 = st.get("nf4_vs_copy")
        if nf4 is None and st.get("nf4_dequant_gb_s") and st.get("copy_gb_s"):
            nf4 = st["nf4_dequant_gb_s"] / st["copy_gb_s"]
    checks = (st or {}).get("checks", [])
    failed = [c.get("name") for c in checks if not c.get("pass")]

    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f} GB"  # noqa: E731
    print()
    print(f"=== rtune vs PEFT, {a.preset}{' (quick)' if a.quick else ''}: {shape['layers']} layers, "
          f"seq {a.seq}, batch {a.batch}, NF4, LoRA r16 all-linear, gradient checkpointing ===")
    print(f"{'':8s} {'tokens/s':>10s} {'step s':>8s} {'MFU':>7s} {'peak mem':>10s}  {'reserved':>10s}")
    for name in ("rtune", "PEFT"):
        s = sides.get(name)
        if not s:
            print(f"{name:8s} {'(no result)':>10s}")
            continue
        print(f"{name:8s} {s['tokens_per_s']:10.0f} {s['step_s_median'] or 0:8.4f} {s['mfu']:7.1%} "
              f"{gb(s['peak_memory_bytes']):>10s}  {gb(s['peak_memory_reserved_bytes']):>10s}")
    if rl:
        g = rl.get("gemm_8192_tflops")
        print(f"ceilings: copy {rl.get('copy_gb_s', 0):.0f} GB/s, bf16 GEMM 8192^3 {g} TFLOP/s "
              f"(= {g * 1e12 / PEAK_BF16_FLOPS:.0%} of the {PEAK_BF16_FLOPS / 1e12:.1f} peak MFU uses)"
              + (f"; bnb NF4 dequant {rl['bnb_nf4_vs_copy']:.0%} of copy" if rl.get("bnb_nf4_vs_copy") else ""))
    if st:
        print(f"selftest: {len(checks) - len(failed)}/{len(checks)} checks pass" + (f"; FAILED: {failed}" if failed else "")
              + (f"; NF4 dequant {st.get('nf4_dequant_gb_s', 0):.0f} GB/s vs copy {st.get('copy_gb_s', 0):.0f} GB/s"
                 if st.get("copy_gb_s") else ""))
    for n in notes:
        print("note:", n)
    toggles = toggle_table(a.dir, a.toggles.split(), rt)

    full = not a.quick
    goals = [
        ("rtune >= 2.5x PEFT tokens/s", "-" if speedup is None else f"{speedup:.2f}x",
         None if speedup is None else speedup >= GOAL_SPEEDUP),
        ("rtune MFU >= 45%", "-" if not r else f"{r['mfu']:.1%}", r["mfu"] >= GOAL_MFU if r and full else None),
        ("rtune peak <= 7.5 GB", "-" if not r else gb(r["peak_memory_bytes"]),
         r["peak_memory_bytes"] <= GOAL_PEAK_BYTES if r and full and r["peak_memory_bytes"] else None),
        ("NF4 dequant >= 85% of copy", "-" if nf4 is None else f"{nf4:.0%}", None if nf4 is None else nf4 >= GOAL_NF4),
        ("selftest all pass", "-" if not st else f"{len(failed)} failed", None if not st else not failed),
    ]
    print(f"\n{'goal':32s} {'value':>10s}  status")
    for g, v, ok in goals:
        print(f"{g:32s} {v:>10s}  {mark(ok)}")
    summary = {"shape": shape, "seq": a.seq, "batch": a.batch, "quick": a.quick, "peak_flops": PEAK_BF16_FLOPS,
               "flops_per_token": fpt_ref, "sides": sides, "speedup": speedup, "nf4_vs_copy": nf4,
               "selftest_failed": failed if st else None, "notes": notes, "toggles": toggles,
               "goals": {g: {"value": v, "status": mark(ok)} for g, v, ok in goals}}
    with open(os.path.join(a.dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_report(a, summary)


def toggle_table(d, names, on):
    """Each fast path's share: its unfused_<name>.json step time against rtune.json's (all on).
    Returns {name: {step_s_median, tokens_per_s, share}} for the toggles that gave a result."""
    out = {}
    if not names:
        return out
    on_s = (on or {}).get("step_s_median")
    print(f"\n{'fast path off (RTUNE_UNFUSED)':30s} {'tokens/s':>10s} {'step s':>8s} {'share':>7s}")
    if on_s:
        print(f"{'(none: all on)':30s} {(on or {}).get('tokens_per_s', 0):10.0f} {on_s:8.4f} {'':>7s}")
    for n in names:
        j = load(d, f"unfused_{n}")
        if not j or not j.get("step_s_median"):
            print(f"{n:30s} {'(no result)':>10s}")
            continue
        off_s = j["step_s_median"]
        share = (off_s - on_s) / off_s if on_s else None
        out[n] = {"step_s_median": off_s, "tokens_per_s": j.get("tokens_per_s"), "share": share}
        print(f"{n:30s} {j.get('tokens_per_s', 0):10.0f} {off_s:8.4f} "
              + ("      -" if share is None else f"{share:7.1%}"))
    return out


SECTIONS = ("selftest", "rtune_tiny", "rtune", "peft", "roofline")


def read_steps(d):
    """steps.tsv: name, file, status, seconds per line (run.sh's step/skip)."""
    steps = []
    try:
        with open(os.path.join(d, "steps.tsv")) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) == 4:
                    steps.append({"name": parts[0], "file": parts[1], "status": parts[2], "seconds": int(parts[3])})
    except FileNotFoundError:
        pass
    return steps


def write_report(a, summary):
    """DIR/report.json: every section, whether its step ran or not (see the module doc); atomic."""
    steps = read_steps(a.dir)
    by_file = {s["file"]: s["status"] for s in steps}
    report = {"meta": {"mode": a.mode, "device": a.device, "preset": a.preset, "layers": a.layers,
                       "seq": a.seq, "batch": a.batch},
              "steps": steps}
    for sec in SECTIONS:
        status = by_file.get(f"{sec}.json", "not run")
        entry = {"status": status, "result": load(a.dir, sec)}
        if status.startswith("skipped: "):
            entry["skipped"] = status[len("skipped: "):]
        report[sec] = entry
    toggles = {}
    for n in a.toggles.split():
        status = by_file.get(f"unfused_{n}.json", "not run")
        entry = {"status": status, "result": load(a.dir, f"unfused_{n}"),
                 "share": summary["toggles"].get(n, {}).get("share")}
        if status.startswith("skipped: "):
            entry["skipped"] = status[len("skipped: "):]
        toggles[n] = entry
    report["toggles"] = toggles
    report["summary"] = summary
    path = os.path.join(a.dir, "report.json")
    with open(path + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(path + ".tmp", path)
    print(f"report: {path} (" + ", ".join(f"{s}: {report[s]['status']}" for s in SECTIONS) + ")")


if __name__ == "__main__":
    main()
