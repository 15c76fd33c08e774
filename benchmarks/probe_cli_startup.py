"""Wall time of a one-shot ``infercore generate`` on the CPU (the README's ``make demo`` command: interpreter start,
imports, loading the embedded SmolLM2 GGUF, building the engine, 64 tokens at most), for each of ``--trees``
(checkouts of this repository, e.g. a ``git worktree`` of an older commit), in interleaved rounds, best of
``--rounds``. The first tree is "ours", the others are peers labelled by their commit.

    python benchmarks/probe_cli_startup.py --trees .,/tmp/old [--out benchmarks/results/cpu/sweeps/cli_startup.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import case, write_results  # noqa: E402

PROMPT = "What is the capital of France?"


def _commit(tree: str) -> str:
    out = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or os.path.abspath(tree)


def _run(tree: str) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "infercore.cli", "generate", PROMPT, "--device", "cpu",
                          "--max-tokens", "64"], capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - t0, out.stdout.strip().splitlines()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/cpu/sweeps/cli_startup.json")
    args = ap.parse_args()
    trees = args.trees.split(",")
    best = {t: float("inf") for t in trees}
    answers = {}
    for _ in range(args.rounds):
        for t in trees:
            secs, answers[t] = _run(t)
            best[t] = min(best[t], secs)
    labels = {t: _commit(t) for t in trees}
    ours = trees[0]
    cases = [case(f"one-shot 'infercore generate' (SmolLM2 fp32, {PROMPT!r}), runs per minute",
                  metric="runs per minute", unit="1/min", ours=60 / best[ours],
                  peers={f"tree at {labels[t]}": 60 / best[t] for t in trees[1:]}, floor=None,
                  wall_s={labels[t]: round(best[t], 3) for t in trees}, answers={labels[t]: answers[t] for t in trees})]
    for t in trees:
        print(f"{labels[t]}: {best[t]:.2f} s  {answers[t]!r}", flush=True)
    write_results(args.out, "probe_cli_startup", "cpu", cases,
                  {"note": "Best wall time of each tree's CLI run, interleaved rounds; the first tree is ours."})


if __name__ == "__main__":
    main()
