#!/usr/bin/env python3
"""Read rtune's TensorBoard event files with TensorBoard's own reader (not run in CI).

  python -m venv /tmp/tb && /tmp/tb/bin/pip install tensorboard
  cargo run -p rtune-watch --example watch_run -- runs/smoke      # or a run the trainer logged
  /tmp/tb/bin/python scripts/check_tensorboard.py runs/smoke/tb --metrics runs/smoke/metrics.jsonl

Loads the directory with tensorboard's EventAccumulator (the loader behind `tensorboard --logdir`,
which checks each record's CRCs), prints every scalar tag with its point count and first/last
values, and with --metrics compares train/loss with the `loss` of metrics.jsonl (as f32).
--golden prints the bytes of one Event framed by TensorBoard's RecordWriter (the golden record in
crates/watch/src/tb.rs). Exit 1 on any mismatch.
"""
import argparse
import io
import json
import struct
import sys


def golden():
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.record_writer import RecordWriter

    buf = io.BytesIO()
    e = Event(wall_time=1.5, step=3, summary=Summary(value=[Summary.Value(tag="loss", simple_value=0.25)]))
    RecordWriter(buf).write(e.SerializeToString())
    print(", ".join(f"0x{b:02x}" for b in buf.getvalue()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logdir", nargs="?")
    ap.add_argument("--metrics", help="metrics.jsonl of the same run")
    ap.add_argument("--golden", action="store_true")
    args = ap.parse_args()
    if args.golden:
        golden()
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(args.logdir, size_guidance={"scalars": 0})
    acc.Reload()
    tags = acc.Tags()["scalars"]
    ok = bool(tags)
    report = {}
    for t in tags:
        ev = acc.Scalars(t)
        report[t] = {"points": len(ev), "first": [ev[0].step, ev[0].value], "last": [ev[-1].step, ev[-1].value]}
    if args.metrics and "train/loss" in tags:
        want = [(j["step"], j["loss"]) for j in map(json.loads, open(args.metrics)) if j.get("loss") is not None]
        got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
        f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]
        same = len(got) == len(want) and all(s == ws and v == f32(wv) for (s, v), (ws, wv) in zip(got, want))
        report["train/loss equals metrics.jsonl"] = same
        ok = ok and same
    print(json.dumps(report, indent=1))
    print("RESULT:", "OK" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
