#!/usr/bin/env python3
"""Easy arithmetic word problems in GSM8K's JSONL format (question, answer ending in `#### N`).

GSM8K is out of reach of a 135M model (SmolLM2-135M-Instruct solves ~0 of the first 16 test problems), so
GRPO would see all-zero reward groups. These one- and two-step problems (numbers 2-20, +, -, x) sit where a
small instruct model is right some of the time, which is what group-relative RL needs.
Deterministic: `python3 scripts/make_word_problems.py experiments/data` writes train (2000) and test (200) of
the default mix (`word_problems_{train,test}.jsonl`: four one-step kinds and one two-step kind, equally likely).
`--mix one-step` writes `word_problems_1step_*` (the four one-step kinds: +, -, + of two boxes, x) and
`--mix add-sub` writes `word_problems_addsub_*` (the three one-step + and - kinds), and `--mix add-sub-small`
`word_problems_addsub_small_*` (the same with operands 2-9), with the same seeds.
"""
import json
import random
import sys
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Maria", "Leo", "Nina", "Omar", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards"]


# mix: (file stem, number of kinds drawn from, largest operand of kinds 0-2)
MIXES = {
    "default": ("word_problems", 5, 20),
    "one-step": ("word_problems_1step", 4, 20),
    "add-sub": ("word_problems_addsub", 3, 20),
    "add-sub-small": ("word_problems_addsub_small", 3, 9),
}


def problem(rng, kinds=5, hi=20):
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(kinds)
    a, b, c = rng.randint(2, hi), rng.randint(2, hi), rng.randint(1, 9)
    if kind == 0:
        q = f"{n} has {a} {it}. {n} buys {b} more. How many {it} does {n} have now?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == 1:
        a, b = max(a, b), min(a, b)
        q = f"{n} had {a} {it} and gave {b} of them to a friend. How many {it} does {n} have left?"
        ans, work = a - b, f"{a} - {b} = {a - b}"
    elif kind == 2:
        q = f"There are {a} {it} in one box and {b} {it} in another box. How many {it} are there in total?"
        ans, work = a + b, f"{a} + {b} = {a + b}"
    elif kind == 3:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q = f"{n} has {a} bags with {b} {it} in each bag. How many {it} does {n} have?"
        ans, work = a * b, f"{a} x {b} = {a * b}"
    else:
        q = f"{n} has {a} {it}, buys {b} more, and then gives away {c}. How many {it} does {n} have now?"
        ans, work = a + b - c, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}"
    return {"question": q, "answer": f"{work}.\n#### {ans}"}


def main():
    args = sys.argv[1:]
    mix = "default"
    if "--mix" in args:
        i = args.index("--mix")
        mix = args[i + 1]
        del args[i : i + 2]
    stem, kinds, hi = MIXES[mix]
    out = Path(args[0] if args else "experiments/data")
    out.mkdir(parents=True, exist_ok=True)
    for split, count, seed in [("train", 2000, 1), ("test", 200, 2)]:
        rng = random.Random(seed)
        with open(out / f"{stem}_{split}.jsonl", "w") as f:
            for _ in range(count):
                f.write(json.dumps(problem(rng, kinds, hi)) + "\n")


if __name__ == "__main__":
    main()
