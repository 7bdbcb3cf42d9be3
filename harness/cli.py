"""The `headroom` command: run benchmarks, build reports, list profiles, techniques and workloads.

User errors (unknown names, bad files, unwritable folders) print one line and exit with code 2;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import re
import signal
import sys
import time
from pathlib import Path

EXIT_USAGE = 2
EXIT_CELLS_FAILED = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) and exit with code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _csv(text: str) -> list[str]:
    """A comma-separated list of names; empty is refused (it would silently mean "nothing" or "all")."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected one or more names, got nothing")
    return parts


# Batches and sequence lengths beyond this are refused: tensor sizes, the records' integer columns and
# every allocator figure derived from them stay far from overflow, and no device holds such a batch.
MAX_COUNT = 2**31 - 1
# A cell may take a week, no more: a larger timeout overflows the OS's timers (and means "none").
MAX_CELL_TIMEOUT_S = 7 * 24 * 3600.0


def _count(text: str) -> int:
    """A positive integer no larger than MAX_COUNT."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"expected a positive integer up to {MAX_COUNT}, got {text}")
    return value


def _number(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def _seconds(text: str) -> float:
    """A finite, positive number of seconds, at most a week."""
    value = _number(text, "seconds")
    if not 0 < value <= MAX_CELL_TIMEOUT_S:  # also false for nan
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and at most {MAX_CELL_TIMEOUT_S:g}, got {text}")
    return value


_SIZE_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _memory_size(text: str) -> int:
    """Bytes from `16G`, `512M`, `1.5T` or a plain number of bytes; at least 2 GiB (importing torch alone
    needs about 1 GiB of data segment) and at most 1 PiB."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a size such as 16G or 512M, got {text!r}")
    value = float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]
    if not 2**31 <= value <= 2**50:
        raise argparse.ArgumentTypeError(f"expected a size from 2G to 1024T, got {text!r}")
    return int(value)


def _fraction(text: str) -> float:
    """A number strictly between 0 and 1 (a coefficient of variation to flag noise at)."""
    value = _number(text, "a number between 0 and 1")
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a number strictly between 0 and 1, got {text}")
    return value


def _folder(text: str) -> Path:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty one")
    return Path(text)


def _out_path(text: str) -> Path:
    """A path to write: a folder of results is written as Parquet, whose strings must be UTF-8, so a
    name that is not (bytes a terminal passed through) is refused before any work is done."""
    path = _folder(text)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{printable(text)!r} is not valid UTF-8; choose another name") from None
    return path


# The files a results folder keeps (harness/records.py, ledger.py, serve_matrix.py, reports/fragmentation.py).
RUN_FILES = ("results.parquet", "results.csv", "ledger.csv", "accuracy.csv", "fragmentation.csv", "serve_matrix.csv")


def guard_output(path: Path, own: str | None = None, flag: str = "--out", folder: bool = False) -> None:
    """Refuse, before any work, an output that cannot be written or a file that would overwrite a results
    folder's own files: a run's rows, twins, accuracy, probe or matrix, or a cell file (`own`: the one file
    name this command writes where it would be the run's own, e.g. serve_matrix.csv for serve-matrix).
    `folder`: the output is a folder (calibrate's overlays)."""
    if folder and path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {printable(str(path))} is a file; it names a folder: choose another {flag}")
    if not folder and path.is_dir():
        raise UsageError(f"{flag} {printable(str(path))} is a folder; give a file name")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise UsageError(f"{flag} {printable(str(path))}: {printable(str(parent))} is a file, not a folder; "
                         f"choose another {flag}")
    if folder:
        return
    holds_run = path.parent.is_dir() and any((path.parent / name).exists() for name in (*RUN_FILES, "cells"))
    in_cells = path.parent.name == "cells" and any((path.parent.parent / name).exists() for name in RUN_FILES)
    if (path.name in RUN_FILES and path.name != own and holds_run) or in_cells:
        raise UsageError(f"{flag} {printable(str(path))} would overwrite a results folder's own file; "
                         f"choose another {flag}")


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a price in USD such as 0.15, got {text!r}") from None
    if not 0 < value < 1e3 or value != value:
        raise argparse.ArgumentTypeError(f"expected a positive price below 1000 USD, got {text!r}")
    return value


def _add_generation_flags(parser) -> None:
    parser.add_argument("--prompt-len", type=_count, default=None,
                        help="serving (--mode infer of gpt): prompt tokens prefilled into the KV cache "
                             "(default: the size's sequence less the generated tokens)")
    parser.add_argument("--gen-len", type=_count, default=None,
                        help="serving: tokens generated per sequence, decoded one at a time (default 128, at most "
                             "an eighth of the size's sequence)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="headroom", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors (also after the command)")
    parser.add_argument("--profiles", metavar="DIR", help="extra folder of GPU profile TOMLs "
                        "(also HEADROOM_PROFILES)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="measure cells on this machine and write results + report")
    run.add_argument("--workload", type=_csv, default=None, help="comma-separated (default: all built-in ones, "
                     "or none when --model / --hf-config name your own)")
    _add_user_model_flags(run)
    run.add_argument("--size", type=_csv, default=None, help="comma-separated size ids (default: by --scale)")
    run.add_argument("--technique", type=_csv, default=None, metavar="STACK,...",
                     help="technique stacks such as baseline,amp-bf16+checkpointing or recipes such as small-model; "
                          "'all' for every technique and recipe (default: baseline, amp-bf16, amp-fp16, "
                          "checkpointing, grad-accumulation)")
    run.add_argument("--gpu", type=_csv, default=None,
                     help="profile ids, families or all (default: the local device; on a machine without a GPU "
                          "also every GPU profile, projected)")
    run.add_argument("--scale", default=None, help="smoke|standard|large (default: smoke on CPU, standard on GPU)")
    run.add_argument("--mode", type=_csv, default=["train", "infer"], help="train, infer or both (default)")
    run.add_argument("--batch-size", type=_count, default=None, help="override every size's default batch")
    _add_generation_flags(run)
    run.add_argument("--out", type=_out_path, default=None, help="results folder (default: results/<run-id>)")
    run.add_argument("--cell-timeout", type=_seconds, default=None, metavar="S", help="seconds per cell (default 600)")
    run.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (default 2)")
    run.add_argument("--steps", type=int, default=10, help="timed steps per repeat (at least 10)")
    run.add_argument("--repeats", type=int, default=3, help="timed loops per cell (their spread flags noise)")
    run.add_argument("--noise-threshold", type=_fraction, default=None, metavar="CV",
                     help="flag a cell noisy above this coefficient of variation across repeats, or with its "
                          "mean step more than twice this off its median (default 0.05)")
    run.add_argument("--resume", action="store_true", help="skip cells already recorded in --out")
    run.add_argument("--retry-failed", action="store_true",
                     help="with --resume: run the error and timeout cells again (their rows are replaced)")
    run.add_argument("--cell-memory", type=_memory_size, default=None, metavar="SIZE",
                     help="most memory a cell measured on the host CPU may use, e.g. 8G (default: 80%% of the "
                          "memory available at the start); a cell projected above it is not started")
    run.add_argument("--require-device", action="store_true",
                     help="refuse instead of projecting when a requested GPU is not this machine's")
    run.add_argument("--no-report", action="store_true", help="do not write report.html")
    run.add_argument("--memory-timeline", action="store_true",
                     help="keep each measured cell's memory over one step by category in timelines/ (CUDA: also "
                          "a memory snapshot for PyTorch's memory_viz); the report draws them")
    run.add_argument("--profile", action="store_true", help="keep a profiler trace of 3 steps per measured cell in "
                                                           "traces/ (Chrome trace format)")
    run.add_argument("--usd-per-kwh", type=_price, default=None, metavar="USD",
                     help="electricity price: measured CUDA rows then cost their NVML energy per million samples")
    run.add_argument("--tensorboard", type=_folder, default=None, metavar="DIR",
                     help="write each measured cell's step times and memory as TensorBoard scalars under DIR")
    run.add_argument("--world-size", type=_count, default=1, metavar="N",
                     help="ranks per measured cell, one process each under torchrun (data-parallel, fsdp...)")
    run.add_argument("--shard", default=None, metavar="I/N", help="run only the I-th of N disjoint slices of the "
                     "plan (a job array; headroom report merges the slices' folders)")
    from harness.cli_accuracy import add_arguments

    add_arguments(run)
    run.add_argument("--serve-matrix", action="store_true",
                     help="also tabulate the serving fit matrix for the run's GPUs into serve_matrix.csv (a first "
                          "run on a CPU machine tabulates 7B at 4k tokens by itself)")

    from harness import cli_advise, cli_fragmentation, cli_project, cli_serving  # commands of their own modules

    cli_project.add_parser(sub)
    cli_serving.add_parser(sub)
    cli_advise.add_parser(sub)
    cli_fragmentation.add_parser(sub)

    report = sub.add_parser("report", help="merge results files into one HTML report (or a Markdown summary), or "
                                           "compare two runs cell by cell (--compare OLD NEW)")
    report.add_argument("results", nargs="+", type=Path, help="results folders or .parquet/.csv files")
    report.add_argument("--out", type=_out_path, required=True, metavar="FILE.html|FILE.md",
                        help="the report to write (replaced if it exists; a results folder's own files are refused)")
    report.add_argument("--compare", action="store_true",
                        help="give two results, OLD and NEW: which cells got better or worse beyond their noise")
    report.add_argument("--format", choices=("html", "md"), default=None,
                        help="html (the default) or md, a Markdown summary for pull requests (default: md for an "
                             "--out ending in .md)")
    report.add_argument("--prices", type=Path, default=None, metavar="FILE.csv",
                        help="GPU prices to cost every row at instead of the profiles' (columns gpu, usd_per_hour, "
                             "date, source; on-demand USD per GPU-hour unless a basis column says otherwise)")
    report.add_argument("--serve-matrix", type=_folder, action="append", metavar="FILE",
                        help="a serving fit matrix (headroom serve-matrix --out) to draw and judge C1 with; results "
                             "folders holding serve_matrix.csv add theirs")

    ledger = sub.add_parser("ledger", help="the projected-vs-measured pairs that give projections their error bars")
    ledger_sub = ledger.add_subparsers(dest="ledger_command", required=True, parser_class=_Parser)
    add = ledger_sub.add_parser("add", help="merge the twins of results folders/files (or ledger.csv files) into a "
                                           "ledger, skipping pairs it holds")
    add.add_argument("results", nargs="+", type=Path, help="results folders, results files or ledger.csv files")
    add.add_argument("--ledger", type=_folder, default=None, metavar="FILE.csv",
                     help="the ledger to merge into (default: the one shipped with headroom, which projections use)")
    ledger_sub.add_parser("show", help="pairs per kind of cell and their step-time and reserved errors")

    calibrate = sub.add_parser("calibrate", help="measure this device's achievable matmul rates, bandwidth and "
                                                 "per-op costs into a profile overlay (--profiles DIR reads it)")
    calibrate.add_argument("--out", type=_folder, default=Path("calibration"), metavar="DIR",
                           help="folder for <profile>.overlay.toml (default: ./calibration)")
    calibrate.add_argument("--quick", action="store_true", help="a small sweep (seconds; figures less exact)")

    sub.add_parser("profiles", help="list GPU profiles")
    sub.add_parser("techniques", help="list techniques")
    sub.add_parser("workloads", help="list workloads and sizes")
    sub.add_parser("env", help="device, driver, torch, CUDA and NVML availability")
    # `--profiles DIR` works before or after the command (`headroom run --profiles DIR`).
    for command in sub.choices.values():
        command.add_argument("--profiles", metavar="DIR", default=argparse.SUPPRESS,
                             help="extra folder of GPU profile TOMLs (also HEADROOM_PROFILES)")
    return parser


def _add_user_model_flags(command: argparse.ArgumentParser) -> None:
    command.add_argument("--model", action="append", default=[], metavar="MODULE:FACTORY",
                         help="your own model: a function returning an nn.Module, an example batch and its loss "
                              "(README, 'Your own model'); repeatable")
    command.add_argument("--hf-config", action="append", default=[], type=Path, metavar="CONFIG.json",
                         help="a Hugging Face Transformers architecture built from its config with random weights "
                              "(needs `pip install 'headroom[hf]'`); repeatable")


def _user_workloads(args) -> list[str]:
    """The workload names `--model` and `--hf-config` stand for (suites/workloads: user.py, hf.py)."""
    return ([f"model:{factory}" for factory in args.model]
            + [f"hf:{path.expanduser().resolve()}" for path in args.hf_config])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    # Taken wherever it is given, before or after the command (argparse knows it only before).
    argv = [argument for argument in argv if argument != "--debug"]
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except (UsageError, ValueError) as exc:
        if debug:
            raise
        print(f"headroom: error: {printable(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("headroom: interrupted; finished cells are saved (rerun with --resume)", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`headroom profiles | head`): end quietly, as a shell tool does, with
        # stdout pointed at /dev/null so the interpreter's final flush does not complain either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        if debug:
            raise
        # Disk full, a folder removed under a run, a permission changed: one line. A cell whose row
        # could not be written is not recorded, so `--resume` runs it again.
        where = f" ({exc.filename})" if exc.filename else ""
        hint = "; free space, then rerun with --resume" if exc.errno == errno.ENOSPC else ""
        print(printable(f"headroom: error: {exc.strerror or exc}{where}{hint}"), file=sys.stderr)
        return 1


def printable(text: str) -> str:
    """`text` with control characters escaped (`\\x1b`): a path or name from the user is printed as what
    it is, and an escape sequence in it cannot redraw the terminal."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def _profiles(args):
    from harness.profiles import load_profiles

    return load_profiles(args.profiles)


def _check_ranks(plan, local, world_size: int) -> None:
    """Refuse more ranks than this machine can hold before any starts: torchrun runs them all here, one
    GPU each with NCCL, or one process each on the CPU (gloo), where past a few per core they only queue."""
    if world_size == 1 or not any(cell.world_size > 1 for cell in plan.measured):
        return
    if local.vendor == "cpu":
        most, what = max(8, 4 * (os.cpu_count() or 1)), f"{os.cpu_count()} CPU cores"
    else:
        import torch

        most, what = torch.cuda.device_count(), "GPUs (one per rank)"
    if world_size > most:
        raise UsageError(f"--world-size {world_size}: this machine runs at most {most} ranks ({what}); "
                         f"project more GPUs instead: headroom project --dp {world_size} ...")


def cmd_run(args) -> int:
    from rich.console import Console

    from harness.measure.local import MeasureSettings
    from harness.plan import plan_run
    from harness.profiles import detect_local, resolve_gpus
    from harness.records import DEFAULT_NOISE_THRESHOLD, ResultsStore, new_run_id
    from harness.runner import DEFAULT_CELL_TIMEOUT_S, RunnerOptions, default_cell_memory, interrupt, run_plan

    if args.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard (nox installs it)")
    if args.resume and not args.out:
        raise UsageError("--resume continues the run in a results folder: give it with --out results/<run-id>")
    if args.retry_failed and not args.resume:
        raise UsageError("--retry-failed reruns the failed cells of an earlier run: give it with --resume")
    console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
    profiles = _profiles(args)
    local = detect_local(profiles)
    gpus = resolve_gpus(args.gpu, profiles) if args.gpu else None
    settings = MeasureSettings(warmup=args.warmup, steps=args.steps, repeats=args.repeats,
                               noise_threshold=args.noise_threshold or DEFAULT_NOISE_THRESHOLD,
                               memory_timeline=args.memory_timeline, profile=args.profile, usd_per_kwh=args.usd_per_kwh,
                               tensorboard_dir=str(args.tensorboard.resolve()) if args.tensorboard else None)
    plan = plan_run(local, gpus, workloads=(args.workload or []) + _user_workloads(args) or None,
                    stacks=args.technique, modes=args.mode, scale=args.scale, sizes=args.size,
                    batch_size=args.batch_size, profiles=profiles, require_device=args.require_device,
                    prompt_len=args.prompt_len, gen_len=args.gen_len, world_size=args.world_size)
    _check_ranks(plan, local, args.world_size)
    if args.shard:
        from harness.plan import parse_shard, shard

        whole, plan = plan, shard(plan, *parse_shard(args.shard))
    else:
        whole = plan
    measured, projected, foreign, cells = plan.measured, plan.projected, plan.foreign, plan.cells
    run_id = new_run_id()
    store = ResultsStore(args.out or Path("results") / run_id)
    run_id = store.open(run_id, resume=args.resume)
    out = store.root
    options = RunnerOptions(run_id=run_id, cell_timeout_s=args.cell_timeout or DEFAULT_CELL_TIMEOUT_S,
                            settings=dataclasses.replace(settings, artifacts_dir=str(out.resolve())),
                            profiles_dir=args.profiles,
                            cell_memory_bytes=args.cell_memory or default_cell_memory())
    console.print(f"headroom run {run_id}: {len(measured)} measured cells on {local.name} ({local.id}), "
                  f"scale {plan.scale}; {len(projected)} projected cells" + (f" (scale {plan.projected_scale} "
                                                                              "for other GPUs)"
                                                         if foreign else "") + f" -> {printable(str(out))}")
    if foreign:
        console.print(f"PROJECTED: {', '.join(g.id for g in foreign)} not on this machine (local device: {local.id}); "
                      f"their figures are projected from traces, not measured")
    started = time.perf_counter()

    def progress(index, total, cell, record):
        elapsed = time.perf_counter() - started
        if record is None:
            console.print(f"[{index}/{total}] {cell.describe()}: already recorded, skipped")
            return
        detail = record.reason
        if record.status == "ok":
            speed = (f"p50 {record.step_time_ms_p50:.2f} ms, {record.throughput_samples_s:.1f} samples/s, "
                     if record.step_time_ms_p50 is not None else "")
            detail = (speed + f"peak {record.peak_allocated_bytes / 2**20:.1f} MiB"
                      + (f", NOISY (cv {record.step_time_cv or 0:.1%}, mean {record.step_time_ms_mean:.2f} ms)"
                         if record.noisy else ""))
        console.print(f"[{index}/{total} {elapsed:5.0f}s] {cell.describe()}: {record.status}  {detail}")

    # SIGTERM and SIGHUP end the run as Ctrl-C does: finished cells stay saved and --resume goes on (the
    # runner defers them while it traces in-process, where an exception inside autograd would abort).
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), interrupt)
    records = run_plan(cells, profiles, store, options, on_done=progress, resume=args.resume,
                       retry_failed=args.retry_failed)
    from harness.cli_accuracy import accuracy_stage

    accuracy = accuracy_stage(args, whole, local, store, console)  # the whole plan's stacks (shard 1 measures)
    frame = store.write_frame()
    from harness.cli_speed import write_run_ledger

    write_run_ledger(frame, profiles, out, console)
    matrix = None
    if args.serve_matrix or plan.day_one:
        from harness.cli_serving import run_matrix

        matrix = run_matrix(plan, profiles, out, console, full=args.serve_matrix)
    fragmentation = None
    if plan.day_one:  # a first run judges every claim it can: C4 needs the probe
        from harness.cli_fragmentation import run_probe

        fragmentation = run_probe(plan, profiles, out, console)
    if not args.no_report:
        try:
            from reports.build import write_report
            from reports.timelines import timeline_files

            write_report([frame], out / "report.html", matrix, timeline_files([out]), fragmentation, accuracy=accuracy)
        except Exception as exc:  # the rows are saved; a report problem (a checkout updated mid-run) must not hide that
            console.print(f"headroom: report.html not written ({type(exc).__name__}: {str(exc)[:200]}); "
                          f"the results are saved: headroom report {out} --out FILE.html")
    counts = frame["status"].value_counts().to_dict()
    console.print(f"done in {time.perf_counter() - started:.0f}s: {len(records)} cells run, "
                  f"{len(frame)} rows ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) "
                  f"-> {printable(str(out))}/results.parquet, results.csv"
                  + ("" if args.no_report else ", report.html"))
    failed = frame["status"].isin(["error", "timeout"]).sum()
    return EXIT_CELLS_FAILED if failed else 0


def _command(module: str, name: str):
    """A command of another harness/cli_*.py module, imported when it runs."""
    def command(args) -> int:
        import importlib

        return getattr(importlib.import_module(f"harness.{module}"), name)(args)

    return command


def cmd_profiles(args) -> int:
    for profile in _profiles(args).values():
        memory = f"{profile.memory_bytes / 2**30:.0f} GiB" if profile.memory_bytes else "?"
        bf16 = profile.peak("bf16")
        peak = f"{bf16 / 1e12:g} TFLOP/s bf16" if bf16 else "bf16 peak unknown"
        price = f"${profile.usd_per_hour:g}/h ({profile.price_date})" if profile.usd_per_hour else "no price"
        print(f"{profile.id:16} {profile.family:8} {profile.name:28} {memory:>8}  {peak:22} {price}")
    return 0


def cmd_techniques(args) -> int:
    from suites.techniques import RECIPES, TECHNIQUES

    print(f"{'baseline':24} {'':4} {'':10} no technique")
    for technique in TECHNIQUES.values():
        print(f"{technique.id:24} {technique.guide:4} {technique.phase.name.lower():10} {technique.summary}")
    for recipe in RECIPES.values():
        print(f"{recipe.name:24} {'C14':4} {'recipe':10} {'+'.join(recipe.techniques)}: {recipe.summary}")
    return 0


def cmd_workloads(args) -> int:
    import torch

    from suites.workloads import PROBES, WORKLOADS
    from suites.workloads.base import count_parameters

    for workload in [*WORKLOADS.values(), *PROBES.values()]:
        for spec in workload.sizes.values():
            with torch.device("meta"):
                params = count_parameters(workload.build(spec))
            shape = f"seq {spec.seq_len}" if spec.seq_len else f"{spec.image_size}px"
            print(f"{workload.name:13} {spec.name:12} {spec.scale:9} {params / 1e6:10.1f} M params  "
                  f"batch {spec.batch_size:<4} {shape}")
    return 0


def cmd_env(args) -> int:
    from harness.provenance import environment

    for key, value in environment().items():
        print(f"{key:15} {value if value is not None else '-'}")
    return 0


COMMANDS = {"run": cmd_run, "project": _command("cli_project", "cmd_project"),
            "report": _command("cli_report", "cmd_report"),
            "ledger": _command("cli_speed", "cmd_ledger"),
            "serve-matrix": _command("cli_serving", "cmd_serve_matrix"),
            "fragmentation": _command("cli_fragmentation", "cmd_fragmentation"),
            "calibrate": _command("cli_speed", "cmd_calibrate"),
            "advise": _command("cli_advise", "cmd_advise"),
            "profiles": cmd_profiles,
            "techniques": cmd_techniques, "workloads": cmd_workloads, "env": cmd_env}

if __name__ == "__main__":
    # `python -m harness.cli` runs this file as __main__; the commands in harness/cli_*.py raise the
    # UsageError of `harness.cli`, so run that module's main for its handlers to catch them.
    from harness.cli import main as imported_main

    sys.exit(imported_main())
