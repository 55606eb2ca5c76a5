#!/usr/bin/env python3
"""A `command` reward for rtune's GRPO (`[[reward]] kind = "command"`), standard library only.

Protocol: one JSON request per line on stdin, one JSON list per line on stdout.
  request: {"step": N, "prompts": [...], "completions": [...], "completion_ids": [[...]],
            "columns": {"<column>": [one value per completion, null where the row lacks it]}}
  answer:  [one number or null per completion]   (null: no reward from this function)

This one gives 1.0 when a completion contains its row's `answer` column, 0.0 when it does not,
and null for a row without an answer. Anything it prints to stderr shows in rtune's output.
Replace `reward` with your own function (or call a reward model from it).
"""
import json
import sys


def reward(prompt, completion, answer):
    if answer is None:
        return None
    return 1.0 if str(answer) in completion else 0.0


def main():
    for line in sys.stdin:
        req = json.loads(line)
        answers = req["columns"].get("answer", [None] * len(req["completions"]))
        out = [reward(p, c, a) for p, c, a in zip(req["prompts"], req["completions"], answers)]
        # allow_nan=False: a NaN is a bug in the reward, better an error here than in the run.
        print(json.dumps(out, allow_nan=False), flush=True)


if __name__ == "__main__":
    main()
