"""`headroom project`: one cell projected onto a GPU profile (memory, fit, step time, cost) without that
GPU (or N GPUs: --dp, --tp, --pp, --ep); with --max-batch, --max-context, --largest-model or --min-gpus it
solves for the figure asked
(harness/project/query.py answers)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

from harness.cli import EXIT_CELLS_FAILED, EXIT_USAGE, _add_generation_flags, _add_user_model_flags, _user_workloads
from harness.cli_args import UsageError, _count, _name, _names, _profiles, _stack, printable


def add_parser(sub) -> None:
    project = sub.add_parser("project", help="project one cell onto a GPU profile (no GPU needed)")
    project.add_argument("--workload", type=_name, default=None, help="default: gpt, or your own model's")
    _add_user_model_flags(project)
    project.add_argument("--size", type=_name, default=None, help="size id (default: the workload's canonical size)")
    project.add_argument("--gpu", type=_names, required=True,
                         help="profile id or family (every variant of it), or several, comma-separated")
    project.add_argument("--technique", type=_stack, default="baseline", metavar="STACK",
                         help="a technique stack such as amp-bf16+checkpointing (default: baseline)")
    project.add_argument("--mode", default="train", help="train or infer")
    batch = project.add_mutually_exclusive_group()
    batch.add_argument("--batch-size", type=_count, default=None,
                       help="samples per step (default: the size's own; the global batch under --dp)")
    batch.add_argument("--max-batch", action="store_true",
                       help="solve for the largest batch that fits without the allocator freeing its cache and "
                            "retrying each step (a parallel stack: the largest global batch every rank fits)")
    project.add_argument("--max-context", action="store_true",
                       help="serving (--mode infer, gpt): solve for the longest prompt that fits at --batch-size")
    project.add_argument("--seq-len", type=_count, default=None, help="tokens per sample (language models)")
    _add_generation_flags(project)
    project.add_argument("--largest-model", action="store_true",
                         help="instead: the largest size of --workload that fits --gpu at its smallest batch")
    ranks = project.add_mutually_exclusive_group()
    ranks.add_argument("--dp", type=_count, default=None, metavar="N",
                       help="data-parallel degree: replicas or shards of the model, each of --tp x --pp GPUs (so "
                            "N x tp x pp GPUs in all); the global batch is N x the size's batch (x the pipeline's "
                            "micro-batches with --pp, x --ep), or --batch-size where given")
    ranks.add_argument("--min-gpus", action="store_true",
                       help="the fewest GPUs on which a parallel stack fits (data-parallel groups of 1, 2, 4, ... "
                            "of --tp x --pp GPUs)")
    project.add_argument("--tp", type=_count, default=None, metavar="N",
                         help="tensor-parallel ranks per group (the stack's tensor-parallel:t=N)")
    project.add_argument("--pp", type=_count, default=None, metavar="N",
                         help="pipeline stages (the stack's pipeline-parallel:p=N; m=M micro-batches, "
                              "schedule=gpipe as technique options)")
    project.add_argument("--ep", type=_count, default=None, metavar="N",
                         help="expert-parallel ranks (the stack's expert-parallel:e=N; a MoE size: mixtral-8x7b)")
    project.add_argument("--format", choices=("table", "json"), default="table",
                         help="table (default) or json, one line per answer")
    project.add_argument("--prices", type=Path, default=None, metavar="FILE.csv",
                         help="GPU prices to cost the answer at instead of the profiles' (columns gpu, "
                              "usd_per_hour, date, source), as `headroom report --prices`")



def cmd_project(args) -> int:
    import json

    from harness.prices import price_table
    from harness.project.query import ProjectRequest, largest_model_answers, projected_rows

    user = _user_workloads(args)
    if args.max_context and args.max_batch:
        raise UsageError("--max-context solves for the prompt at a given batch, --max-batch for the batch at a given "
                         "prompt: give one")
    if args.max_context and args.prompt_len is not None:
        raise UsageError("--max-context solves for the prompt's length: leave --prompt-len out, or drop --max-context "
                         "to project that prompt")
    if len(user) + bool(args.workload) > 1:
        raise UsageError("project answers for one model: give one of --workload, --model, --hf-config")
    named = {"workload": args.workload or user[0]} if args.workload or user else {}
    request = ProjectRequest(dp=args.dp, tp=args.tp, pp=args.pp, ep=args.ep, min_gpus=args.min_gpus,
                             gpu=args.gpu, technique=args.technique, mode=args.mode, size=args.size,
                             batch_size=args.batch_size, max_batch=args.max_batch, seq_len=args.seq_len,
                             prompt_len=args.prompt_len, gen_len=args.gen_len, max_context=args.max_context, **named)
    profiles = _profiles(args)
    # A family name answers for each of its variants: one line of JSON each, or one table each.
    if args.largest_model:
        for answer in largest_model_answers(request, profiles):
            print(json.dumps(answer) if args.format == "json" else
                  f"{answer['gpu']}: largest {answer['workload']} that fits ({answer['technique']}, "
                  f"{answer['mode']}, batch {answer['batch_size']}): "
                  f"{answer['largest_size_that_fits'] or 'none'}"
                  + (f" ({answer['reason']})" if answer["reason"] else ""))
        return 0
    prices = price_table(profiles, args.prices)  # a bad --prices file fails before any projection
    records = [priced(record, prices) for record in projected_rows(request, profiles)]
    for index, record in enumerate(records):
        row = record.to_dict()
        if args.format == "json":
            print(json.dumps(row))
            continue
        width = max(map(len, row))
        print("\n" * bool(index), end="")
        for key, value in row.items():
            print(f"{key:{width}}  {readable(key, value)}")
    if args.format != "json" and len(records) > 1:
        print("\n" + summary_table(records))
    # A projection that failed is not an answer: the row says why, the exit code that it failed.
    if any(record.status == "error" for record in records):
        return EXIT_CELLS_FAILED
    # A stack no GPU asked for can run is a request to change: said in one line, as other bad input is.
    if records and all(record.status == "unsupported" for record in records):
        for reason in dict.fromkeys(record.reason for record in records):
            print(printable(f"headroom: error: unsupported here: {reason}"), file=sys.stderr)
        return EXIT_USAGE
    return 0


# The side-by-side summary of several rows: (header, how a record gives the cell).
SUMMARY = (
    ("GPU", lambda r: r.gpu + (f" x{r.world_size}" if (r.world_size or 1) > 1 else "")),
    ("status", lambda r: r.status),
    ("batch", lambda r: str(r.batch_size)),
    ("reserved GiB", lambda r: _gib(r.peak_reserved_bytes)),
    ("step ms (range)", lambda r: _ranged(r.step_time_ms_p50, r.step_time_ms_low, r.step_time_ms_high)),
    ("samples/s", lambda r: _figure(r.throughput_samples_s)),
    ("tokens/s", lambda r: _figure(r.tokens_per_s)),
    ("MFU", lambda r: f"{r.mfu:.0%}" if r.mfu else "-"),
    ("USD/M samples", lambda r: _figure(r.usd_per_million_samples)),
)


def summary_table(records) -> str:
    """Several projections side by side, one line each (the rows above hold every column and note), fastest
    first among those that ran."""
    ranked = sorted(records, key=lambda r: -(r.throughput_samples_s or 0) if r.status == "ok" else float("inf"))
    cells = [[header for header, _ in SUMMARY]] + [[cell(record) for _, cell in SUMMARY] for record in ranked]
    widths = [max(len(row[i]) for row in cells) for i in range(len(SUMMARY))]
    lines = ["  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
             for row in cells]
    return "\n".join(["side by side, fastest first (projected):", *lines])


def _figure(value) -> str:
    return "-" if value is None or value != value else f"{value:,.3g}" if value < 100 else f"{value:,.0f}"


def _gib(value) -> str:
    return "-" if value is None or value != value else f"{value / 2**30:,.1f}"


def _ranged(value, low, high) -> str:
    if value is None or value != value:
        return "-"
    return _figure(value) + (f" ({_figure(low)}-{_figure(high)})" if low and high else "")


def priced(record, prices):
    """`record` costed at `prices` (the profiles' unless --prices replaced them), with a note saying which
    price, of what date and from where, or that none is known and how to give one."""
    import pandas as pd

    from harness.prices import cost_rows

    if record.status != "ok" or not record.throughput_samples_s:
        return record
    price = prices.get(record.gpu)
    if price is None:
        record.notes = "; ".join(filter(None, [record.notes, f"no price for {record.gpu}: give --prices FILE.csv "
                                                             "(columns gpu, usd_per_hour, date, source)"]))
        return record
    (costed,) = cost_rows(pd.DataFrame([record.to_dict()]), prices).to_dict("records")
    record.usd_per_million_samples = costed["usd_per_million_samples"]
    record.usd_per_million_tokens = costed["usd_per_million_tokens"]
    record.notes = "; ".join(filter(None, [record.notes, f"cost at {price.label} ({price.basis}, {price.source})"]))
    return record


def readable(key: str, value) -> str:
    """A table cell: '-' for nothing, bytes also in GiB, other floats to 4 significant figures (json keeps
    the raw values)."""
    if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if key.endswith("_bytes") and isinstance(value, int | float) and abs(value) >= 2**20:
        return f"{int(value):,} ({value / 2**30:,.2f} GiB)"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
