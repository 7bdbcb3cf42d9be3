"""`headroom fragmentation`: the fragmentation probe's rows printed (and kept with --out), then the guide's
C4 judged on them (harness/fragmentation.py runs the probe)."""

from __future__ import annotations

import sys
import time

from harness.cli import UsageError, _count, _folder, _profiles, printable


def add_parser(sub) -> None:
    frag = sub.add_parser("fragmentation", help="the fragmentation probe (guide's scenario, variable-length "
                                                "training) under each allocator setting; judges C4")
    frag.add_argument("--gpu", default=None, help="profile id whose capacity the projected probe uses (default: the "
                                                  "local GPU, else h100-sxm)")
    frag.add_argument("--size", default="gpt2-124m", help="gpt size of the variable-length loop (default gpt2-124m)")
    frag.add_argument("--batch-size", type=_count, default=8)
    frag.add_argument("--measure", action="store_true", help="also run both scenarios on this machine's CUDA device, "
                                                             "one process per allocator setting")
    frag.add_argument("--out", type=_folder, default=None, metavar="FILE.csv",
                      help="keep the rows (the report draws fragmentation.csv found in a results folder)")


def cmd_fragmentation(args) -> int:
    """The probe's rows printed (and kept with --out), then C4's verdict."""
    import dataclasses

    import pandas as pd

    from harness.cell import Cell
    from harness.fragmentation import (
        SETTINGS,
        judge_c4,
        measure_guide_scenario,
        measure_loop,
        projected_probe,
        variable_length_events,
    )
    from harness.profiles import detect_local

    profiles = _profiles(args)
    local = detect_local(profiles)
    gpu = args.gpu or (local.id if local.vendor != "cpu" else "h100-sxm")
    if gpu not in profiles or profiles[gpu].vendor == "cpu":
        raise UsageError(f"--gpu {gpu}: the probe needs a GPU profile (with a memory size); see headroom profiles")
    if args.measure and local.vendor != "nvidia":
        raise UsageError("--measure runs the guide's scenario on a CUDA device; this machine has none "
                         "(the projected probe runs without it)")
    cell = Cell("gpt", args.size, "train", "amp-bf16", gpu, args.batch_size, source="projected").resolve(profiles)
    started = time.perf_counter()
    results = projected_probe(profiles[gpu], cell)
    if args.measure:
        _, lengths = variable_length_events(cell)
        results += [measure_guide_scenario(setting) for setting in SETTINGS]
        results += [measure_loop(setting, args.size, args.batch_size, lengths) for setting in SETTINGS]
    frame = pd.DataFrame([{**dataclasses.asdict(r), "waste": r.waste, "gpu": gpu} for r in results])
    shown = frame.assign(**{
        "reserved GiB": frame["peak_reserved_bytes"] / 2**30,
        "allocated at that peak GiB": frame["allocated_at_reserved_peak_bytes"] / 2**30,
        "waste": [f"{w:.0%}" for w in frame["waste"]],
        "most held free GiB": frame["most_held_free_bytes"] / 2**30,
        "largest free block GiB": frame["largest_free_block_bytes"] / 2**30})
    columns = ["scenario", "allocator", "source", "reserved GiB", "allocated at that peak GiB", "waste",
               "most held free GiB", "largest free block GiB", "retries", "oom"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 60, "display.float_format", "{:,.2f}".format):
        print(shown[columns].to_string(index=False))
    print(f"\nC4 (fragmentation wastes 30-50% of GPU memory): {judge_c4(results)}")
    print(f"done in {time.perf_counter() - started:.0f}s (projected rows: the allocator model on {gpu}'s capacity; "
          "the guide's scenario on a device with room for one more 1 GiB tensor)", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
        print(f"rows -> {printable(str(args.out))}", file=sys.stderr)
    return 0
