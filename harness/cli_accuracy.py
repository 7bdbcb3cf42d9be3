"""`headroom run`'s accuracy stage: which workload and stacks to measure, on what budget, and the rows it fills.

`--accuracy` measures every workload and stack of the run's cells; a run with the default stacks measures
the default accuracy set (harness/accuracy/book.py DEFAULT_STACKS) unless `--no-accuracy` is given. The
budget follows the run's scale: `smoke` on a CPU's default run, `standard` with `--scale standard` (or on a
GPU, whose default scale it is).
"""

from __future__ import annotations

import time


def add_arguments(run) -> None:
    """`headroom run`'s accuracy options."""
    from harness.cli_args import _count

    which = run.add_mutually_exclusive_group()
    which.add_argument("--accuracy", action="store_true",
                     help="measure the accuracy of every workload and stack of the run on real data (3 seeds)")
    which.add_argument("--no-accuracy", action="store_true",
                     help="skip the default run's accuracy stage (int8, int4, sharing, pruning, bf16 vs the baseline)")
    run.add_argument("--accuracy-seeds", type=_count, default=None, metavar="N",
                     help="seeds per accuracy measurement (default 3; fewer gives no noise estimate)")


def requests(args, cells) -> dict[str, list[str]]:
    """workload -> stacks whose accuracy this run measures (empty: none)."""
    from harness.accuracy.book import DEFAULT_STACKS
    from suites.tasks import task_for

    if args.no_accuracy:
        return {}
    workloads = list(dict.fromkeys(cell.workload for cell in cells))
    if args.accuracy:
        wanted: dict[str, list[str]] = {}
        for cell in cells:
            wanted.setdefault(cell.workload, [])
            if cell.technique not in wanted[cell.workload]:
                wanted[cell.workload].append(cell.technique)
        return wanted
    if args.technique is None:  # the default suite: the default accuracy set for its workloads with a task
        return {w: list(DEFAULT_STACKS[w]) for w in workloads if w in DEFAULT_STACKS and task_for(w) is not None}
    return {}


def budget_scale(plan_scale: str) -> str:
    return "smoke" if plan_scale == "smoke" else "standard"


def run_accuracy(wanted: dict[str, list[str]], local, out, scale: str, seeds: int, console):
    """Measure `wanted` into `out`/accuracy.csv (resuming what it holds), printing progress lines."""
    import torch

    from harness.accuracy.book import AccuracyBook, measure_accuracy

    stacks = sum(len(v) for v in wanted.values())
    console.print(f"accuracy: {stacks} workload-stack pairs x {seeds} seeds on real data, {scale} budget "
                  f"(--no-accuracy skips this stage)")
    started = time.perf_counter()
    device = torch.device("cpu" if local.vendor == "cpu" else "cuda")
    book = AccuracyBook(out)
    measure_accuracy(wanted, book, local, device, scale=scale, seeds=seeds,
                     progress=lambda line: console.print(f"[{time.perf_counter() - started:5.0f}s] {line}"))
    return book


def accuracy_stage(args, plan, local, store, console):
    """The accuracy of the run's stacks on real data, filled into the store's rows; the accuracy frame, or
    None when the run measures none."""
    wanted = requests(args, plan.cells)
    if not wanted:
        return None
    from harness.plan import parse_shard

    if args.shard and parse_shard(args.shard)[0] != 1:  # "01/8" is slice 1 too
        console.print(f"accuracy: measured by shard 1 of the plan only (this is {args.shard}); its accuracy.csv "
                      "joins the others' rows in headroom report")
        return None
    from harness.accuracy.attach import attach_accuracy
    from harness.accuracy.book import DEFAULT_SEEDS

    book = run_accuracy(wanted, local, store.root, budget_scale(plan.scale), args.accuracy_seeds or DEFAULT_SEEDS,
                        console)
    attach_accuracy(store, book)
    return book.frame()
