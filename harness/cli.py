"""The `headroom` command: run benchmarks, build reports, list profiles, techniques and workloads.

User errors (unknown names, bad files, unwritable folders) print one line and exit with code 2;
`--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import difflib
import errno
import os
import sys
from pathlib import Path

from harness.cli_args import (
    UsageError,
    _bounded,
    _count,
    _csv,
    _folder,
    _fraction,
    _memory_size,
    _out_path,
    _price,
    _profiles,
    _seconds,
    printable,
)

EXIT_USAGE = 2
EXIT_CELLS_FAILED = 1
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line (no usage dump) and exit with code 2; an unknown flag is named
    with the closest one the command takes and that command's help."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = _chosen_parser(self, parsed)
            options = [flag for action in command._actions for flag in action.option_strings]
            hints = [f"did you mean {close[0]}?" for extra in extras if extra.startswith("--")
                     for close in [difflib.get_close_matches(extra.split("=")[0], options, n=1)] if close]
            raise UsageError(f"unrecognized arguments: {' '.join(extras)}" + (f"; {' '.join(hints)}" if hints else "")
                             + f" (see `{command.prog} --help`)")
        return parsed


def _chosen_parser(parser: argparse.ArgumentParser, parsed) -> argparse.ArgumentParser:
    """The (sub)command parser the parsed arguments chose: `headroom ledger add`'s, not `headroom`'s."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and getattr(parsed, action.dest, None) in action.choices:
            return _chosen_parser(action.choices[getattr(parsed, action.dest)], parsed)
    return parser


def _add_generation_flags(parser) -> None:
    parser.add_argument("--prompt-len", type=_count, default=None,
                        help="serving (--mode infer of gpt): prompt tokens prefilled into the KV cache "
                             "(default: the size's sequence less the generated tokens)")
    parser.add_argument("--gen-len", type=_count, default=None,
                        help="serving: tokens generated per sequence, decoded one at a time (default: 128, or an "
                             "eighth of the size's sequence where that is fewer)")


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
    run.add_argument("--scale", default=None,
                     help="smoke|standard|large, or test (the suite's own tiny sizes); default: smoke on CPU, "
                          "standard on GPU")
    run.add_argument("--mode", type=_csv, default=["train", "infer"], help="train, infer or both (default)")
    run.add_argument("--batch-size", type=_count, default=None, help="override every size's default batch")
    _add_generation_flags(run)
    run.add_argument("--out", type=_out_path, default=None, help="results folder (default: results/<run-id>)")
    run.add_argument("--cell-timeout", type=_seconds, default=None, metavar="S", help="seconds per cell (default 600)")
    # Bounds refuse what can only be a typo: 10 timed steps are the fewest that give a p90 (MeasureSettings),
    # and 100,000 steps outlast the default cell timeout (600 s) at any step above 6 ms.
    run.add_argument("--warmup", type=_bounded(0, 10_000, "warm-up steps"), default=2,
                     help="untimed steps before the timed ones (default 2)")
    run.add_argument("--steps", type=_bounded(10, 100_000, "timed steps"), default=10,
                     help="timed steps per repeat (10 to 100,000; default 10)")
    run.add_argument("--repeats", type=_bounded(1, 100, "repeats"), default=3,
                     help="timed loops per cell (their spread flags noise; 1 to 100, default 3)")
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
    show = ledger_sub.add_parser("show", help="pairs per kind of cell and their step-time and reserved errors")
    show.add_argument("--ledger", type=Path, default=None, metavar="FILE.csv",
                      help="the ledger to show (default: the one shipped with headroom, which projections use)")

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


def _command(module: str, name: str):
    """A command of another harness/cli_*.py module, imported when it runs."""
    def command(args) -> int:
        import importlib

        return getattr(importlib.import_module(f"harness.{module}"), name)(args)

    return command


def cmd_profiles(args) -> int:
    """One line per profile: what fits (the memory a process can use, as projections count it), how fast
    (dense bf16 peak, fp16 where there is no bf16; memory bandwidth), and what it costs; a multi-device
    package per device, as it runs."""
    profiles = _profiles(args)  # a bad --profiles folder is refused before the header is printed
    print(f"{'id':16} {'family':8} {'name':28} {'usable':>10} {'16-bit dense':>18} {'bandwidth':>10}  price")
    for profile in profiles.values():
        device = profile.per_device()
        usable = f"{device.capacity_bytes / 2**30:,.1f} GiB" if device.capacity_bytes else "?"
        half = next(((name, device.peak(name)) for name in ("bf16", "fp16") if device.peak(name)), None)
        peak = f"{half[1] / 1e12:,.0f} TFLOP/s" + (" (fp16)" if half[0] == "fp16" else "") if half else "unknown"
        bandwidth = f"{device.memory_bandwidth_bytes_s / 1e12:,.2f} TB/s" if device.memory_bandwidth_bytes_s else "?"
        price = f"${device.usd_per_hour:,.2f}/h ({profile.price_date})" if device.usd_per_hour else "no price"
        per = (f"  [each of its {profile.devices_per_package} devices; the package: "
               f"{profile.memory_bytes / 2**30:,.0f} GiB]" if profile.devices_per_package > 1 else "")
        print(f"{profile.id:16} {profile.family:8} {profile.name:28} {usable:>10} {peak:>18} {bandwidth:>10}  "
              f"{price}{per}")
        if profile.calibration:
            print("  " + _calibrated(device))
    return 0


def _calibrated(device) -> str:
    """The line under a profile a `headroom calibrate` overlay changed: what it measured, when and where, so a
    user sees the overlay was read (projections for the profile use these figures)."""
    rates = ", ".join(f"{dtype} {rate / 1e12:,.3g}" for dtype, rate in device.achievable_flops.items())
    bandwidth = device.achievable_bandwidth_bytes_s
    said = device.calibration
    return (f"calibrated {said.get('date', '?')[:10]} on {said.get('device', '?')} ({said.get('file', '?')}): "
            f"achievable {rates or 'no'} TFLOP/s"
            + (f", {bandwidth / 1e9:,.1f} GB/s" if bandwidth else "")
            + (f"; {said['notes']}" if said.get("notes") else ""))


def _check_given_profiles(args) -> None:
    """Read a --profiles folder a listing does not use, so a mistyped one is refused (one line, exit 2)
    rather than ignored."""
    if getattr(args, "profiles", None):
        _profiles(args)


def cmd_techniques(args) -> int:
    from suites.techniques import RECIPES, TECHNIQUES

    _check_given_profiles(args)

    print(f"{'technique':24} {'guide':5} {'phase':13} what it does")
    print(f"{'baseline':24} {'':5} {'':13} no technique")
    for technique in TECHNIQUES.values():
        print(f"{technique.id:24} {technique.guide:5} {technique.phase.name.lower():13} {technique.summary}")
    for recipe in RECIPES.values():
        print(f"{recipe.name:24} {'C14':5} {'recipe':13} {'+'.join(recipe.techniques)}: {recipe.summary}")
    return 0


def cmd_workloads(args) -> int:
    import torch

    from suites.workloads import PROBES, WORKLOADS
    from suites.workloads.base import count_parameters

    _check_given_profiles(args)

    print(f"{'workload':13} {'size':12} {'scale':9} {'parameters':>11}  {'batch':>5}  input")
    for workload in [*WORKLOADS.values(), *PROBES.values()]:
        for spec in workload.sizes.values():
            with torch.device("meta"):
                params = count_parameters(workload.build(spec))
            shape = f"{spec.seq_len} tokens" if spec.seq_len else f"{spec.image_size} px images"
            count = f"{params / 1e9:,.1f} B" if params >= 1e9 else f"{params / 1e6:,.1f} M"
            print(f"{workload.name:13} {spec.name:12} {spec.scale:9} {count:>11}  {spec.batch_size:>5}  {shape}")
    return 0


def cmd_env(args) -> int:
    from harness.provenance import environment

    _check_given_profiles(args)
    for key, value in environment().items():
        print(f"{key:15} {value if value is not None else '-'}")
    return 0


COMMANDS = {"run": _command("cli_run", "cmd_run"), "project": _command("cli_project", "cmd_project"),
            "report": _command("cli_report", "cmd_report"),
            "ledger": _command("cli_speed", "cmd_ledger"),
            "serve-matrix": _command("cli_serving", "cmd_serve_matrix"),
            "fragmentation": _command("cli_fragmentation", "cmd_fragmentation"),
            "calibrate": _command("cli_speed", "cmd_calibrate"),
            "advise": _command("cli_advise", "cmd_advise"),
            "profiles": cmd_profiles,
            "techniques": cmd_techniques, "workloads": cmd_workloads, "env": cmd_env}

if __name__ == "__main__":
    # `python -m harness.cli` runs this file as __main__; the commands in harness/cli_*.py import
    # `harness.cli` again under its own name, so run that one module's main (one parser, one COMMANDS).
    from harness.cli import main as imported_main

    sys.exit(imported_main())
