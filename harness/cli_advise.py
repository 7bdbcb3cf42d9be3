"""`headroom advise`: what to do when a cell does not fit on a GPU (the stacks that make it fit, ranked
by the step time they cost), and when it fits (a larger batch, a cheaper GPU); harness/advise.py decides."""

from __future__ import annotations

import sys
from pathlib import Path

from harness.cli_args import _count, _name, _profiles, _stack, printable


def add_parser(sub) -> None:
    advise = sub.add_parser("advise", help="the stacks that make a cell fit a GPU, ranked by step time (projected)")
    advise.add_argument("--workload", type=_name, default="gpt", help="workload id (default: gpt)")
    advise.add_argument("--size", type=_name, default=None, help="size id (default: the workload's canonical size)")
    advise.add_argument("--gpu", type=_name, required=True, help="one GPU profile id")
    advise.add_argument("--mode", default="train", choices=("train", "infer"))
    advise.add_argument("--technique", type=_stack, default="baseline", metavar="STACK", help="the stack you run now")
    advise.add_argument("--batch-size", type=_count, default=None, help="samples per step (default: the size's own)")
    advise.add_argument("--prices", type=Path, default=None, metavar="FILE.csv",
                        help="GPU prices to compare at instead of the profiles' (columns gpu, usd_per_hour, date, "
                             "source), as `headroom report --prices`")


def cmd_advise(args) -> int:
    from harness.advise import advise
    from harness.prices import priced_profiles
    from harness.project.query import ProjectRequest
    from suites.workloads import get_workload

    # A mistyped workload or size is refused before anything is projected (ValueError: one line).
    workload = get_workload(args.workload)
    if args.size:
        workload.size(args.size)
    request = ProjectRequest(gpu=args.gpu, workload=args.workload, technique=args.technique, mode=args.mode,
                             size=args.size, batch_size=args.batch_size)
    # Each stack is a projection of a few seconds: say which one runs, on stderr so stdout stays the answer.
    profiles = priced_profiles(_profiles(args), args.prices)  # a bad --prices file fails before any projection
    answer = advise(request, profiles, progress=lambda text: print(f"  {text} ...", file=sys.stderr))
    print(printable(answer.headline))
    for line in answer.lines:
        print(printable(f"  {line}"))
    return 0
