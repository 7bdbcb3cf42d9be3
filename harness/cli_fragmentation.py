"""`headroom fragmentation`: the fragmentation probe's rows printed (and kept with --out), then the guide's
C4 judged on them (harness/fragmentation.py runs the probe)."""

from __future__ import annotations

import sys
import time

from harness.cli_args import UsageError, _count, _folder, _name, _profiles, guard_output, printable


def add_parser(sub) -> None:
    frag = sub.add_parser("fragmentation", help="the fragmentation probe (guide's scenario, variable-length "
                                                "training) under each allocator setting; judges C4")
    frag.add_argument("--gpu", type=_name, default=None,
                      help="profile id (or a family of one) whose capacity the projected probe uses (default: the "
                           "local GPU, else h100-sxm)")
    frag.add_argument("--size", type=_name, default="gpt2-124m",
                      help="gpt size of the variable-length loop (default gpt2-124m)")
    frag.add_argument("--batch-size", type=_count, default=8, help="the loop's batch (default 8)")
    frag.add_argument("--measure", action="store_true", help="also run both scenarios on this machine's CUDA device, "
                                                             "one process per allocator setting")
    frag.add_argument("--out", type=_folder, default=None, metavar="FILE.csv",
                      help="keep the rows (the report draws fragmentation.csv found in a results folder)")


def probe_rows(profiles: dict, gpu: str, size: str = "gpt2-124m", batch_size: int = 8, measure: bool = False):
    """The probe's rows as a frame (projected on `gpu`'s capacity; measured too with `measure`) and the
    results C4 is judged on."""
    import dataclasses

    import pandas as pd

    from harness.cell import Cell
    from harness.fragmentation import (
        SETTINGS,
        measure_guide_scenario,
        measure_loop,
        projected_probe,
        variable_length_events,
    )

    cell = Cell("gpt", size, "train", "amp-bf16", gpu, batch_size, source="projected").resolve(profiles)
    results = projected_probe(profiles[gpu], cell)
    if measure:
        _, lengths = variable_length_events(cell)
        results += [measure_guide_scenario(setting) for setting in SETTINGS]
        results += [measure_loop(setting, size, batch_size, lengths) for setting in SETTINGS]
    frame = pd.DataFrame([{**dataclasses.asdict(r), "waste": r.waste, "gpu": gpu} for r in results])
    return frame, results


def run_probe(plan, profiles: dict, out, console):
    """A first run's fragmentation probe (projected, about 15 s), written to `out`/fragmentation.csv so its
    report judges the guide's C4; None where the run has no GPU profile to size it with."""
    from harness.fragmentation import judge_c4
    from harness.records import atomic_write_text
    from reports.fragmentation import FILE

    gpus = [g.id for g in [plan.local, *plan.foreign] if g.vendor != "cpu"]
    if not gpus:
        return None
    gpu = "h100-sxm" if "h100-sxm" in gpus else gpus[0]  # the probe's default GPU where the run has it
    started = time.perf_counter()
    frame, results = probe_rows(profiles, gpu)
    atomic_write_text(out / FILE, frame.to_csv(index=False))
    console.print(f"fragmentation probe (projected on {gpu}, {time.perf_counter() - started:.0f}s): C4 "
                  f"{judge_c4(results).split(' (')[0]} -> {printable(str(out / FILE))}")
    return frame


def probe_gpu(name: str, profiles) -> str:
    """The one GPU profile id `name` stands for: an id, or a family with a single variant; a family of several,
    an unknown name or the CPU is refused in one line saying what to give instead."""
    from harness.profiles import resolve_gpus

    try:  # an id first: `h200` is the SXM's id as well as the family of the SXM and the NVL
        chosen = [profile for profile in ([profiles[name]] if name in profiles else resolve_gpus([name], profiles))
                  if profile.vendor != "cpu"]
    except ValueError as exc:
        raise UsageError(f"--gpu: {exc}") from None
    if not chosen:
        raise UsageError(f"--gpu {printable(name)}: the probe needs a GPU profile (with a memory size); "
                         "see headroom profiles")
    if len(chosen) > 1:
        raise UsageError(f"--gpu {printable(name)} names {len(chosen)} profiles with their own capacities "
                         f"({', '.join(p.id for p in chosen)}): give one of them")
    return chosen[0].id


def cmd_fragmentation(args) -> int:
    """The probe's rows printed (and kept with --out), then C4's verdict."""
    from harness.fragmentation import judge_c4
    from harness.profiles import detect_local

    if args.out:
        if args.out.suffix.lower() != ".csv":
            raise UsageError(f"--out {printable(str(args.out))}: the probe's rows are written as .csv; name it so")
        guard_output(args.out, own="fragmentation.csv")
    profiles = _profiles(args)
    local = detect_local(profiles)
    gpu = probe_gpu(args.gpu or (local.id if local.vendor != "cpu" else "h100-sxm"), profiles)
    if args.measure and local.vendor != "nvidia":
        raise UsageError("--measure runs the guide's scenario on a CUDA device; this machine has none "
                         "(the projected probe runs without it)")
    started = time.perf_counter()
    frame, results = probe_rows(profiles, gpu, args.size, args.batch_size, args.measure)
    table, legend = probe_table(frame)
    print(table)
    for line in legend:
        print(line)
    print(f"\nC4 (fragmentation wastes 30-50% of GPU memory): {judge_c4(results)}")
    print(f"done in {time.perf_counter() - started:.0f}s (projected rows: the allocator model on {gpu}'s capacity; "
          "the guide's scenario on a device with room for one more 1 GiB tensor)", file=sys.stderr)
    if args.out:
        replaced = " (replacing the file there)" if args.out.exists() else ""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
        print(f"rows -> {printable(str(args.out))}{replaced}", file=sys.stderr)
    return 0


def probe_table(frame) -> tuple[str, list[str]]:
    """The probe's rows for people: scenarios numbered (their full text, with the loop's lengths, under the
    table rather than in a column as wide as it), one-token headers, GiB to 2 places, '-' where a setting
    has no such figure (cudaMallocAsync keeps no blocks the probe can see)."""
    import pandas as pd

    scenarios = list(dict.fromkeys(frame["scenario"]))

    def gib(values):
        return [f"{v / 2**30:,.2f}" if v == v and v is not None else "-" for v in values]

    shown = {"scenario": [f"[{scenarios.index(s) + 1}]" for s in frame["scenario"]],
             "allocator": frame["allocator"], "source": frame["source"],
             "reserved-GiB": gib(frame["peak_reserved_bytes"]),
             "alloc@peak-GiB": gib(frame["allocated_at_reserved_peak_bytes"]),
             "waste": [f"{w:.0%}" for w in frame["waste"]],
             "held-free-GiB": gib(frame["most_held_free_bytes"]),
             "largest-free-GiB": gib(frame["largest_free_block_bytes"]),
             "retries": [str(int(r)) if r == r and r is not None else "-" for r in frame["retries"]],
             "oom": ["yes" if bool(o) else "no" for o in frame["oom"]]}
    legend = [f"scenario [{index}] {printable(text)}" for index, text in enumerate(scenarios, 1)]
    return pd.DataFrame(shown).to_string(index=False), legend
