"""Writes data/arith-train.jsonl and data/arith-heldout.jsonl: one-step addition and subtraction
word problems (numbers 2 to 20, answers 0 to 40) for the GRPO recipe configs/smollm2-135m-grpo.toml.
Each row is a conversational prompt, one worked example turn (which shows the `<answer>N</answer>`
format) then the question, and its `answer` column, the number the built-in `answer` reward
compares with:

  {"prompt": [{"role": "user", ...}, {"role": "assistant", ...}, {"role": "user", ...}], "answer": 7}

Seeded and standard library only: the same files on every machine. No question text is in both
files. Run: python3 data/make_arith.py"""

import json
import pathlib
import random

SEED = 44
TRAIN, HELDOUT = 256, 64

NAMES = ["Tom", "Sara", "Ben", "Lily", "Omar", "Ana", "Ravi", "Emma", "Leo", "Nina", "Sam", "Zoe"]
THINGS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "coins", "shells",
          "cards", "balloons"]

# (template, op): {n} a name, {x} a thing, {a} and {b} the numbers.
ADD = [
    "{n} has {a} {x} and gets {b} more. How many {x} does {n} have now?",
    "{n} had {a} {x}. A friend gave {n} {b} more {x}. How many {x} does {n} have?",
    "There are {a} {x} in a box and {n} puts in {b} more. How many {x} are in the box?",
]
SUB = [
    "{n} had {a} {x} and gave away {b}. How many {x} does {n} have left?",
    "{n} has {a} {x} and loses {b} of them. How many {x} are left?",
    "There are {a} {x} on a table. {n} takes {b}. How many {x} are still on the table?",
]

# The worked example every prompt opens with (its numbers are outside the questions' pairs only
# by chance; it teaches the format, not the sum).
EXAMPLE = [
    {"role": "user", "content": "Mia has 2 cats and gets 5 more. How many cats does Mia have?"},
    {"role": "assistant", "content": "2 + 5 = 7 <answer>7</answer>"},
]


def problem(rng):
    n, x = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    if rng.random() < 0.5:
        return rng.choice(ADD).format(n=n, x=x, a=a, b=b), a + b
    a, b = max(a, b), min(a, b)
    return rng.choice(SUB).format(n=n, x=x, a=a, b=b), a - b


def main():
    rng = random.Random(SEED)
    seen, rows = set(), []
    while len(rows) < TRAIN + HELDOUT:
        q, ans = problem(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"prompt": EXAMPLE + [{"role": "user", "content": q}], "answer": ans})
    here = pathlib.Path(__file__).parent
    for name, part in [("arith-train.jsonl", rows[:TRAIN]), ("arith-heldout.jsonl", rows[TRAIN:])]:
        with open(here / name, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
        print(f"{here / name}: {len(part)} rows")


if __name__ == "__main__":
    main()
