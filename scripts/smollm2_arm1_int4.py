#!/usr/bin/env python3
"""Arm 1 of the SmolLM2 study (f32 rollout, f32 training) evaluated quantized to int4-g32, against the
quantized-rollout arms' own int4 evaluations: does f32 RL followed by quantization serve the deployed int4
model as well as RL on int4 rollouts does?

Inputs (experiments/results/smollm2_paper/):
  heldout_int4_1-f32_seed{1,2,3}.json  `qarl eval --model <arm 1 seed N step_000039> --quant int4-g32`
                                       on the study's held-out problems (below), pinned learner c9234d4
  heldout_int4_warm_start.json         the same command on the warm start: must reproduce the study's own
                                       step-0 int4 evaluation bit for bit (checked here), so the protocol
                                       (problems, template, greedy decode, scoring) is the study's
  <arm>/seed<N>/metrics.jsonl          the study's final int4 evaluations of the other arms
The held-out problems: experiments/data/word_problems_addsub_small_test.jsonl without its repeated questions
(193 of 200, first occurrence kept, the order the study evaluates them in). The eval command:
  qarl eval --model M --data HELDOUT --limit 193 --quant int4-g32 --max-new-tokens 64 --batch 193 \
    --system "You are a helpful assistant. Solve the math problem in one short sentence and end with the number."

Statistics as in report.md (src/train/paired.rs): per problem, each arm's outcomes averaged over its seeds;
the difference's mean ± SE over problems, the problems ahead vs behind and the exact two-sided sign test;
then with the seeds' spread added (Welch over the seeds' accuracies, combined in quadrature). The warm
start is one model and adds no seed variance. Run from the repository root; prints one line per comparison.
"""
import json
import math
import os

RESULTS = "experiments/results/smollm2_paper"
ARMS = ["2-int4-rollout", "3-int4-rollout-tis", "4-int4-rollout-tbpo", "5-qarl-gspo", "6-qarl-tbpo"]


def eval_outcomes(path):
    return [int(p["correct"]) for p in json.load(open(path))["problems"]]


def study_outcomes(path, which):
    evals = [r for r in map(json.loads, open(path)) if r.get("phase") == "eval"]
    return [int(c) for c in evals[which]["eval/int4-g32/greedy_correct"]]


def sd(x):
    m = sum(x) / len(x)
    return math.sqrt(sum((v - m) ** 2 for v in x) / (len(x) - 1))


def sign_test(ahead, behind):
    n, k = ahead + behind, min(ahead, behind)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0


def accuracies(seeds):
    return [sum(s) / len(s) for s in seeds]


def seed_variance_of_mean(seeds):
    return sd(accuracies(seeds)) ** 2 / len(seeds) if len(seeds) > 1 else 0.0


def compare(name_a, a, name_b, b):
    per_problem = lambda seeds: [sum(col) / len(seeds) for col in zip(*seeds)]
    d = [x - y for x, y in zip(per_problem(a), per_problem(b))]
    se_problems = sd(d) / math.sqrt(len(d))
    se_seeds = math.sqrt(seed_variance_of_mean(a) + seed_variance_of_mean(b))
    ahead, behind = sum(x > 0 for x in d), sum(x < 0 for x in d)
    print(
        f"{name_a} - {name_b}: {sum(d) / len(d):+.3f} ± {se_problems:.3f} over problems "
        f"({ahead} vs {behind} problems; p {sign_test(ahead, behind):.1e}); "
        f"± {math.hypot(se_problems, se_seeds):.3f} with seeds (seeds alone ± {se_seeds:.3f})"
    )


def main():
    warm = eval_outcomes(f"{RESULTS}/heldout_int4_warm_start.json")
    if warm != study_outcomes(f"{RESULTS}/2-int4-rollout/seed1/metrics.jsonl", 0):
        raise SystemExit("the warm start's int4 evaluation differs from the study's: not the same protocol")
    arm1 = [eval_outcomes(f"{RESULTS}/heldout_int4_1-f32_seed{s}.json") for s in (1, 2, 3)]
    per_problem = [sum(col) / len(arm1) for col in zip(*arm1)]
    print(
        "arm 1 final in int4-g32, per seed: "
        + " ".join(f"{x:.3f}" for x in accuracies(arm1))
        + f"; clustered {sum(per_problem) / len(per_problem):.3f} ± {sd(per_problem) / math.sqrt(len(per_problem)):.3f}"
    )
    compare("arm 1 in int4", arm1, "warm start in int4", [warm])
    for arm in ARMS:
        seeds = [s for s in (1, 2, 3) if os.path.exists(f"{RESULTS}/{arm}/seed{s}/finished.json")]
        finals = [study_outcomes(f"{RESULTS}/{arm}/seed{s}/metrics.jsonl", -1) for s in seeds]
        compare(f"{arm} ({len(seeds)} seeds)", finals, "arm 1 in int4", arm1)


if __name__ == "__main__":
    main()
