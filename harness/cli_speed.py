"""The speed model's commands: `headroom calibrate` (measure this device into a profile overlay) and
`headroom ledger add/show` (the projected-vs-measured pairs behind every projected interval), and the
run's own ledger file."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from harness.cli_args import guard_output, printable
from harness.profiles import load_profiles


def cmd_calibrate(args) -> int:
    import torch

    from harness.calibrate import calibrate, write_overlay
    from harness.profiles import detect_local

    guard_output(args.out, folder=True)
    profile = detect_local(load_profiles(args.profiles))
    device = torch.device("cpu" if profile.vendor == "cpu" else "cuda")
    started = time.perf_counter()
    print(f"calibrating {profile.id} on {device} ({'quick' if args.quick else 'full'} sweep)", file=sys.stderr)
    result = calibrate(profile, device, quick=args.quick, progress=lambda line: print("  " + line, file=sys.stderr))
    path = write_overlay(result, args.out)
    rates = ", ".join(f"{k} {v / 1e12:,.3g}" for k, v in result.achievable_flops.items())  # a CPU's are < 0.1
    print(f"{profile.id}: matmul TFLOP/s {rates}; copy {result.bandwidth_bytes_s / 1e9:,.1f} GB/s; "
          f"issue {result.issue_s * 1e6:.1f} us/op" + (f"; kernel floor {result.kernel_s * 1e6:.2f} us"
                                                      if result.kernel_s else ""))
    for note in result.notes:
        print(f"note: {note}")
    print(f"-> {path} in {time.perf_counter() - started:.0f}s; projections use it with --profiles {args.out}")
    return 0


def write_run_ledger(frame, profiles, out: Path, console) -> None:
    """The run's twins as ledger pairs in its folder, ready for `headroom ledger add`."""
    from harness.ledger import LEDGER_NAME, pairs_from_frame, write_ledger

    pairs = pairs_from_frame(frame, profiles, origin=str(out))
    if len(pairs):
        write_ledger(pairs, out / LEDGER_NAME)
        shown = printable(str(out))
        console.print(f"{len(pairs)} projected-vs-measured pairs -> {shown}/{LEDGER_NAME} (to give projections "
                      f"of cells like these their error bars: headroom ledger add {shown})")


def cmd_ledger(args) -> int:
    from harness.ledger import LEDGER_FILE, merge, pairs_from, read_ledger, write_ledger

    if args.ledger_command == "show":
        shown = args.ledger or LEDGER_FILE
        if args.ledger and not shown.is_file():
            raise ValueError(f"--ledger {printable(str(shown))}: no such ledger file (headroom ledger add writes one)")
        print(f"ledger: {printable(str(shown))}")
        return _show_ledger(read_ledger(shown))
    target = args.ledger or LEDGER_FILE
    if args.ledger:
        guard_output(target, own="ledger.csv", flag="--ledger")
        if target.suffix != ".csv":
            raise ValueError(f"--ledger {printable(str(target))}: a ledger is a .csv file; name it so")
    ledger = read_ledger(target)
    profiles = load_profiles(args.profiles)
    incoming = [pairs_from(path, profiles) for path in args.results]
    added = 0
    for pairs in incoming:
        ledger, count = merge(ledger, pairs)
        added += count
    offered = sum(len(p) for p in incoming)
    if not offered:
        print(f"no projected-vs-measured pairs in {', '.join(printable(str(p)) for p in args.results)}: a pair is a "
              "measured cell and its projected twin on the same GPU profile (headroom run writes both); nothing "
              f"written to {printable(str(target))}")
        return 0
    if added:
        write_ledger(ledger, target)
    print(f"added {added} pairs ({offered - added} already in the ledger or repeated) -> {printable(str(target))} "
          f"({len(ledger)} pairs)" + ("" if added else "; nothing new, the file is unchanged"))
    return 0


def _show_ledger(ledger) -> int:
    import pandas as pd

    from harness.ledger import CELL, MIN_PAIRS, usable_pairs, workload_family

    if ledger.empty:
        print("the ledger holds no pairs: every projected interval is the wide default")
        return 0
    frame = ledger.assign(family=ledger["workload"].map(workload_family),
                          step=pd.to_numeric(ledger["projected_step_ms"])
                          / pd.to_numeric(ledger["measured_step_ms"]) - 1,
                          reserved=pd.to_numeric(ledger["projected_peak_reserved_bytes"])
                          / pd.to_numeric(ledger["measured_peak_reserved_bytes"]) - 1)
    print(f"{'workload':10} {'precision':11} {'generation':11} {'pairs':>5} {'step err median':>16} "
          f"{'reserved err median':>20}   (projected / measured - 1)")
    # An interval rests on distinct cells with a usable figure (harness/ledger.py interval): count those.
    kind = ["family", "precision", "generation"]
    cells = {figure: usable_pairs(frame, "measured_" + column, "projected_" + column).groupby(kind, dropna=False)
             .apply(lambda group: group.groupby(CELL, dropna=False).ngroups)
             for figure, column in (("step", "step_ms"), ("reserved", "peak_reserved_bytes"))}
    few = False
    for key, group in frame.groupby(kind, dropna=False):
        thin = {figure: int(counts.get(key, 0)) < MIN_PAIRS for figure, counts in cells.items()}
        few |= any(thin.values())
        family, precision, generation = key
        print(f"{family:10} {str(precision):11} {str(generation):11} {len(group):5} "
              f"{_percent(group['step'].median()) + ('*' if thin['step'] else ' '):>16} "
              f"{_percent(group['reserved'].median()) + ('*' if thin['reserved'] else ' '):>20}")
    if few:
        print(f"* fewer than {MIN_PAIRS} usable cells for that figure (noisy steps and other allocators left out): "
              "too few to set an interval alone; a row of that kind takes its interval from the same workload and "
              "precision on every GPU generation, then wider kinds")
    return 0


def _percent(value) -> str:
    """A median error as a signed percentage; "-" where no pair has that figure (a CPU pair has no reserved)."""
    return "-" if value != value else f"{value:+.1%}"
