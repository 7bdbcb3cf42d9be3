"""How much faster one GPU is than another, projected against measured, on data the speed model never sees.

A buyer compares GPUs by the ratio of their throughputs, so this checks that ratio rather than absolute
step times: each row of benchmarks/data/heldout_gpu_ratios.csv is one workload's single-GPU training
throughput on one GPU, all measured by one party with one program (Lambda's deeplearning-benchmark running
NVIDIA DeepLearningExamples in NGC containers: lambdal/deeplearning-benchmark, files
pytorch/pytorch-train-throughput-fp16.csv and -fp32.csv at commit 0551cb70, single-GPU rows; its "fp32"
runs in NGC containers, where fp32 matmuls and convolutions take TF32 on Ampere and later, so those rows
are compared with the `tf32` technique). Each row is projected at the batch Lambda ran on that GPU (its
pytorch-train-bs-fp16.csv and -fp32.csv at the same commit: smaller on the 24 GB A10 and the 40 GB A100
than on 80 GB parts). Dividing by the same program's figure on the reference GPU cancels what headroom
does not model about that program (its data loader, its fusions), leaving what the projection must get
right: how the GPUs differ.

These rows are held out: `projection_calibration.py` never reads this file, so nothing here is fitted and
the error printed is an honest out-of-sample error. Do not tune constants against it; add rows instead.

Usage: python benchmarks/cross_gpu_ratios.py [--reference a100-sxm4-80gb] [--write]
  --write: store the held-out ratio error in harness/project/ratio_check.toml (with the training fit it checked),
  where the report reads how far apart two projected GPUs must be to rank them (reports/answer.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path

import pandas as pd
import tomli_w

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project
from harness.project.speed_constants import RATIO_CHECK_FILE, training_fit_digest
from suites.workloads import spec_as_run

HELD_OUT = Path(__file__).with_name("data") / "heldout_gpu_ratios.csv"


def projected_samples_s(row: dict, profiles) -> float:
    """Projected training throughput (samples/s) of one held-out row's configuration on its GPU."""
    spec = spec_as_run(row["workload"], row["size"], row["seq_len"])
    batch = int(row["batch_size"])
    cell = Cell(row["workload"], row["size"], "train", row["technique"], row["gpu"], batch,
                "projected").resolve(profiles, spec=spec)
    estimate = project(cell).time
    return batch / estimate.step_s


def ratio_table(frame: pd.DataFrame, reference: str) -> pd.DataFrame:
    """Measured and projected throughput relative to `reference`, per configuration (label) and GPU."""
    rows = []
    for label, group in frame.groupby("label", sort=False):
        base = group[group["gpu"] == reference]
        if base.empty:
            continue
        base = base.iloc[0]
        for row in group[group["gpu"] != reference].to_dict("records"):
            measured = row["value"] / base["value"]
            projected = row["projected_samples_s"] / base["projected_samples_s"]
            rows.append({"label": label, "gpu": row["gpu"], "measured_ratio": measured,
                         "projected_ratio": projected, "error": projected / measured - 1})
    return pd.DataFrame(rows)


def ranking_agreement(frame: pd.DataFrame) -> list[str]:
    """Per configuration, whether the projection orders the GPUs as the measurements do."""
    lines = []
    for label, group in frame.groupby("label", sort=False):
        measured = list(group.sort_values("value", ascending=False)["gpu"])
        projected = list(group.sort_values("projected_samples_s", ascending=False)["gpu"])
        verdict = "same order" if measured == projected else "ORDER DIFFERS"
        lines.append(f"{label}: {verdict} (measured {' > '.join(measured)}; projected {' > '.join(projected)})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", default="a100-sxm4-80gb", help="the GPU every ratio is taken against")
    parser.add_argument("--write", action="store_true",
                        help=f"store the held-out ratio error in {RATIO_CHECK_FILE.name}")
    args = parser.parse_args(argv)
    profiles = load_profiles()
    frame = pd.read_csv(HELD_OUT)
    if args.reference not in set(frame["gpu"]):
        print(f"error: no held-out row is measured on {args.reference}; pick one of "
              f"{', '.join(sorted(set(frame['gpu'])))}", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        projected = []
        for index, row in enumerate(frame.to_dict("records"), 1):
            print(f"[{index}/{len(frame)}] projecting {row['label']} on {row['gpu']}", file=sys.stderr, flush=True)
            projected.append(projected_samples_s(row, profiles))
    frame["projected_samples_s"] = projected
    table = ratio_table(frame, args.reference)
    print(f"throughput relative to {args.reference} (held out: never fitted; error = projected / measured - 1)")
    print(f"{'configuration':24} {'GPU':16} {'measured':>9} {'projected':>9} {'error':>7}")
    for row in table.to_dict("records"):
        print(f"{row['label']:24} {row['gpu']:16} {row['measured_ratio']:9.2f} {row['projected_ratio']:9.2f} "
              f"{row['error']:+7.1%}")
    errors = [abs(e) for e in table["error"]]
    print(f"\nn={len(errors)} ratios: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}, "
          f"mean signed {table['error'].mean():+.1%} (positive: the projection favours the other GPU over "
          f"{args.reference})")
    for gpu, group in table.groupby("gpu", sort=False):
        print(f"  {gpu:16} mean signed {group['error'].mean():+.1%} over {len(group)} configurations")
    print("ranking:", *ranking_agreement(frame), sep="\n  ")
    caveats = sorted({c for c in frame["caveat"] if isinstance(c, str)})
    if caveats:
        print("caveats:", *caveats, sep="\n  ")
    if args.write:
        write_check(table, args.reference)
        print(f"held-out ratio error -> {RATIO_CHECK_FILE}")
    return 0


def write_check(table: pd.DataFrame, reference: str) -> None:
    """The held-out ratio error, with what it was measured on and the training fit it checked."""
    from datetime import UTC, datetime

    errors = [abs(e) for e in table["error"]]
    check = {"ratios": {
        "date": datetime.now(UTC).date().isoformat(), "reference": reference, "n": len(errors),
        "median_abs_error": round(statistics.median(errors), 4), "worst_abs_error": round(max(errors), 4),
        "training_fit_digest": training_fit_digest(), "gpus": sorted(set(table["gpu"]) | {reference}),
        "source": "Lambda deeplearning-benchmark single-GPU training throughputs (benchmarks/data/"
                  "heldout_gpu_ratios.csv), never fitted: benchmarks/cross_gpu_ratios.py"}}
    header = ("# Written by benchmarks/cross_gpu_ratios.py --write: how far off the projection is on how\n"
              "# much faster one GPU is than another, on data it never saw.\n")
    RATIO_CHECK_FILE.write_text(header + tomli_w.dumps(check))


if __name__ == "__main__":
    sys.exit(main())
