"""A served decoder over a tensor-parallel group, projected against published measurements none of its constants
was fitted on.

benchmarks/data/published_tp_decode.csv holds gpt-fast's batch-1 compiled decodes of Llama models on 1, 2, 4
and 8 A100-80GB (its README's tensor-parallel tables). The projection (harness/project/served_parallel.py)
traces one rank's part of the model in gpt-fast's layout (its tp.py shards attention and MLP only: the
embedding and head stay whole on every rank, with no collective of their own), costs its generation with the
decode fit (whose fit rows are torchao's one-GPU decodes, not these) and adds every forward's all-reduces at
NCCL's latency model. The table prints each row's tokens/s error with and without the collectives, and the
speed-up over one GPU (what a buyer of more GPUs pays for), projected against published.

Usage: python benchmarks/tp_decode_validation.py
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pandas as pd

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import outcome_of, project_outcome
from harness.project.query import with_degrees
from harness.project.served_parallel import local_served_cell, project_served, served_collectives

DATA = Path(__file__).with_name("data") / "published_tp_decode.csv"
# gpt-fast's generate.py: a 5-token prompt ("Hello, my name is"), 200 new tokens; tokens/s = new tokens / the
# generation's time, prefill included (as benchmarks/decode_calibration.py reads them).
PROMPT_TOKENS, NEW_TOKENS = 5, 200


def projected(row: dict, profiles) -> tuple[float, float]:
    """(tokens/s with the collectives, tokens/s without them) projected for the row's cell."""
    ranks = int(row["ranks"])
    technique = row["technique"] if ranks == 1 else with_degrees(f"tensor-parallel+{row['technique']}", ranks,
                                                                   None)
    cell = Cell("gpt", row["size"], "infer", technique, row["gpu"], 1, "projected", prompt_len=PROMPT_TOKENS,
                gen_len=NEW_TOKENS, world_size=ranks).resolve(profiles)
    # gpt-fast's layout: the vocabulary whole on every rank.
    outcome = project_outcome(cell) if ranks == 1 else project_served(cell, outcome_of, time.perf_counter(),
                                                                       vocabulary=False)
    if outcome.status != "ok" or outcome.speed is None:
        raise SystemExit(f"{row['label']} on {ranks} GPUs: projected {outcome.status}: {outcome.reason}")
    seconds = outcome.speed.step_time_ms_p50 / 1e3
    alone = seconds
    if ranks > 1:
        precision = outcome.precision or "bf16"
        local = local_served_cell(cell, ranks, vocabulary=False)
        prefill = served_collectives(local, ranks, precision, PROMPT_TOKENS, vocabulary=False)
        decode = served_collectives(local, ranks, precision, 1, vocabulary=False)
        alone = seconds - prefill.seconds - (NEW_TOKENS - 1) * decode.seconds
    return NEW_TOKENS / seconds, NEW_TOKENS / alone


def summary(name: str, errors: list[float]) -> str:
    absolute = [abs(e) for e in errors]
    return (f"{name}: n={len(errors)}, median |error| {statistics.median(absolute):.1%}, worst {max(absolute):.1%}, "
            f"mean signed {statistics.mean(errors):+.1%}")


def main() -> int:
    profiles = load_profiles()
    frame = pd.read_csv(DATA)
    one_gpu: dict[tuple[str, str], tuple[float, float]] = {}
    lines, errors, bare, speedups = [], [], [], []
    for index, row in enumerate(frame.to_dict("records"), start=1):
        print(f"[{index}/{len(frame)}] projecting {row['label']} on {row['ranks']} x {row['gpu']}", flush=True)
        tokens_s, without = projected(row, profiles)
        key = (row["label"], row["technique"])
        ranks = int(row["ranks"])
        if ranks == 1:
            one_gpu[key] = (tokens_s, float(row["value"]))
            lines.append((row, tokens_s, None, None, None))
            continue
        error, error_bare = tokens_s / row["value"] - 1, without / row["value"] - 1
        errors.append(error)
        bare.append(error_bare)
        speedup = None
        if key in one_gpu:
            projected_one, published_one = one_gpu[key]
            speedup = ((tokens_s / projected_one), (row["value"] / published_one))
            speedups.append(speedup[0] / speedup[1] - 1)
        lines.append((row, tokens_s, error, error_bare, speedup))
    print("\nbatch-1 tensor-parallel decode tokens/s, projected / published - 1 (with: the collectives at NCCL's "
          "latency model; without: the rank's own work only); speed-up over one GPU, projected vs published")
    print(f"{'row':24} {'GPUs':>4} {'published':>9} {'projected':>9} {'with':>8} {'without':>8} {'speed-up':>16}")
    for row, tokens_s, error, error_bare, speedup in lines:
        shown = (f"{error:+8.1%} {error_bare:+8.1%}" if error is not None else f"{'(1 GPU)':>8} {'':>8}")
        ratio = f"{speedup[0]:5.2f}x vs {speedup[1]:4.2f}x" if speedup else ""
        print(f"{row['label']:24} {row['ranks']:>4} {row['value']:9.2f} {tokens_s:9.2f} {shown} {ratio:>16}")
    print()
    print(summary("tensor-parallel rows, with the collectives (never fitted)", errors))
    print(summary("the same rows without them", bare))
    if speedups:
        print(summary("speed-up over one GPU, projected / published", speedups))
    caveats = sorted({str(row["caveat"]) for row in frame.to_dict("records") if isinstance(row["caveat"], str)})
    print("caveats:\n  " + "\n  ".join(caveats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
