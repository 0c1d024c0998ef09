#!/usr/bin/env python3
"""Easy arithmetic word problems in GSM8K's JSONL format (question, answer ending in `#### N`).

GSM8K is out of reach of a 135M model (SmolLM2-135M-Instruct solves ~0 of the first 16 test problems), so
GRPO would see all-zero reward groups. These one- and two-step problems (numbers 2-20, +, -, x) sit where a
small instruct model is right some of the time, which is what group-relative RL needs.
Deterministic: `python3 scripts/make_word_problems.py experiments/data` writes train (2000) and test (200).
"""
import json
import random
import sys
from pathlib import Path

NAMES = ["Tom", "Anna", "Ben", "Lucy", "Sam", "Maria", "Leo", "Nina", "Omar", "Zoe"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "coins", "cards"]


def problem(rng):
    n, it = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.randrange(5)
    a, b, c = rng.randint(2, 20), rng.randint(2, 20), rng.randint(1, 9)
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
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "experiments/data")
    out.mkdir(parents=True, exist_ok=True)
    for name, count, seed in [("word_problems_train.jsonl", 2000, 1), ("word_problems_test.jsonl", 200, 2)]:
        rng = random.Random(seed)
        with open(out / name, "w") as f:
            for _ in range(count):
                f.write(json.dumps(problem(rng)) + "\n")


if __name__ == "__main__":
    main()
