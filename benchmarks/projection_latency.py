"""How long a user waits for `headroom project`: one call for gpt2-124m and for ResNet-50 at batch 256
(target <= 3.5 s each), `--max-batch` for ResNet-50 (target <= 10 s), each the best of 3 fresh
processes (import included, as a user pays it). With `--baseline REV`, the same commands run from a
checkout of REV in the same session, and the ratios new / old are printed (the figure to quote: both
measured under the same load).

Usage: python benchmarks/projection_latency.py [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CALLS = {
    "project gpt2-124m train amp-bf16 h100-sxm": (
        ["project", "--workload", "gpt", "--size", "gpt2-124m", "--gpu", "h100-sxm", "--technique", "amp-bf16"], 3.5),
    "project resnet50 b256 train amp-bf16 a100": (
        ["project", "--workload", "resnet50", "--size", "resnet50", "--gpu", "a100-sxm4-80gb", "--technique",
         "amp-bf16", "--batch-size", "256"], 3.5),
    "project resnet50 --max-batch amp-bf16 a100": (
        ["project", "--workload", "resnet50", "--size", "resnet50", "--gpu", "a100-sxm4-80gb", "--technique",
         "amp-bf16", "--max-batch"], 10.0),
}
REPEATS = 3


def best_of(source: Path, args: list[str]) -> float:
    env = dict(os.environ, PYTHONPATH=str(source), HEADROOM_LOCAL_DEVICE="cpu")
    best = float("inf")
    for _ in range(REPEATS):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=source, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", metavar="REV", help="also time a checkout of this git revision")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        old = None
        if args.baseline:
            old = Path(scratch) / "baseline"
            subprocess.run(["git", "worktree", "add", "--detach", str(old), args.baseline], cwd=ROOT, check=True,
                           capture_output=True)
        try:
            header = f"{'call':45} {'now (s)':>8} {'target':>7}"
            print(header + (f" {args.baseline[:12]:>12} {'ratio':>7}" if old else ""))
            for label, (call, target) in CALLS.items():
                now = best_of(ROOT, call)
                line = f"{label:45} {now:8.2f} {target:7.1f} {'PASS' if now <= target else 'FAIL'}"
                if old:
                    before = best_of(old, call)
                    line += f" {before:12.2f} {now / before:7.2f}"
                print(line, flush=True)
        finally:
            if old:
                subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
