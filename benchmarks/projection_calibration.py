"""Projected step time against every measured step time the project has: the ledger's twins (measured by
headroom on real GPUs) and published single-GPU throughputs (benchmarks/data/published_speed.csv, from
reference/calibration.md). Prints, per row, the error of the current constants and the *held-out*
error (constants fitted without that cell), then the held-out error per workload and precision, the
targets (median |error| <= 15%, worst <= 35%) and whether the projection ranks GPUs as measured.

Usage: python benchmarks/projection_calibration.py [--write]
  --write: store the constants fitted on all rows in harness/project/speed_fit.toml, with provenance
  and the held-out error, and refresh the ledger's projected step times with the held-out projections.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import warnings
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import tomli_w

from harness.cell import Cell
from harness.ledger import LEDGER_FILE, read_ledger, write_ledger
from harness.profiles import load_profiles
from harness.project import project
from harness.project.roofline import PHASES, op_arrays
from harness.project.speed_constants import FIT_FILE, constants_for
from harness.project.speed_fit import (
    PARAMETERS,
    PRIOR_SPREAD,
    ROW_ERROR,
    SpeedPoint,
    fit,
    held_out,
    projected_s,
    summary,
)
from suites.workloads import WORKLOADS, spec_as_run

PUBLISHED = Path(__file__).with_name("data") / "published_speed.csv"
TARGET_MEDIAN, TARGET_WORST = 0.15, 0.35


def config_overrides(text) -> dict[str, int]:
    """`name=value;...` from the published table's config column: how the published program's model differs
    from the size's (NVIDIA's BERT pads its vocabulary to a multiple of 8: DeepLearningExamples'
    PyTorch/LanguageModeling/BERT/run_pretraining.py, "Padding for divisibility by 8"), so the projection costs that
    program."""
    if not isinstance(text, str) or not text.strip():
        return {}
    pairs = [item.split("=") for item in text.split(";")]
    return {name.strip(): int(value) for name, value in pairs}


def _point(label, group, workload, size, technique, gpu, batch, seq_len, mode, profiles, measured_s, source,
           phases=PHASES, config=None, one_forward=False) -> SpeedPoint:
    spec = spec_as_run(workload, size, seq_len, config)
    cell = Cell(workload, size, mode, technique, gpu, int(batch), "projected").resolve(profiles, spec=spec)
    if one_forward:
        # A served decoder's inference cell is a generation; a pair measured as one forward pass over the whole
        # sequence (every position's logits) is projected as that forward, not as a prefill and decode steps.
        cell = dataclasses.replace(cell, spec=dataclasses.replace(cell.spec, seq_len=spec.seq_len, gen_len=None))
    projection = project(cell)
    profile = cell.profile.per_device()
    ops = op_arrays(projection.trace, profile, tf32_matmul=projection.trace.tf32, phases=phases)
    return SpeedPoint(label=label, group=group, workload=workload, precision=projection.trace.precision, gpu=gpu,
                      ops=ops, base=constants_for(profile), measured_s=measured_s, source=source, samples=int(batch))


def ledger_points(profiles) -> list[SpeedPoint]:
    points, generations = [], 0
    for row in read_ledger().to_dict("records"):
        if str(row["step_time_noisy"]) == "True" or pd.isna(row["measured_step_ms"]):
            continue
        served = _served(row)
        if served and not pd.isna(row["gen_len"]):
            generations += 1  # a whole generation's time: the fit costs one step of phases, not gen_len steps
            continue
        label, group = ledger_label(row)
        points.append(_point(label, group, row["workload"], row["size"], row["technique"], row["gpu"],
                             row["batch_size"], row["seq_len"], row["mode"], profiles, row["measured_step_ms"] / 1e3,
                             f"ledger: {row['device_name']}, torch {row['torch_version']}", one_forward=served))
    if generations:
        print(f"{generations} ledger pairs of whole generations left out of the fit: decode is fitted apart, on "
              "published decodes (benchmarks/decode_calibration.py)")
    return points


def _served(row) -> bool:
    """A served decoder's inference pair (a generation cell, or one forward where gen_len is empty)."""
    return row["mode"] == "infer" and WORKLOADS[row["workload"]].serving is not None


def ledger_label(row) -> tuple[str, str]:
    """A ledger pair's label in the table and its cell's group (the held-out fit leaves a group out at once;
    --write refreshes the pairs of each group with its held-out projection)."""
    label = f"{row['workload']} {row['mode']} {row['technique']} b{row['batch_size']}"
    label += " fwd" if _served(row) else ""
    return label, f"{row['gpu']} {label} s{row['seq_len']}"


def published_points(profiles) -> tuple[list[SpeedPoint], list[tuple[dict, SpeedPoint]]]:
    """(rows comparable like for like, rows kept out of the fit with their caveat)."""
    fitted, caveated = [], []
    for row in pd.read_csv(PUBLISHED).to_dict("records"):
        samples_s = row["value"] / row["seq_len"] if row["per_token"] else row["value"]
        # Pre-training accumulates over many micro-batches, so its optimizer step is a negligible share.
        phases = ("forward", "backward") if row["accumulation"] else PHASES
        point = _point(row["label"], f"{row['gpu']} {row['label']}", row["workload"], row["size"], row["technique"],
                       row["gpu"], row["batch_size"], row["seq_len"], "train", profiles,
                       row["batch_size"] / samples_s, f"published: {row['source']}", phases,
                       config_overrides(row["config"]))
        (caveated.append((row, point)) if isinstance(row["caveat"], str) else fitted.append(point))
    return fitted, caveated


def values_of(constants) -> dict[str, float]:
    """The fitted constants' values in `constants`."""
    return {name: getattr(constants.host if table == "host" else constants.gpu, name) for name, table, *_ in PARAMETERS}


def prior_values(profiles, gpu: str) -> dict[str, float]:
    """The priors of `gpu`'s vendor (speed_constants.toml without the fit): what the fit is pulled towards."""
    return values_of(constants_for(profiles[gpu].per_device(), fitted=None))


def ranking_check(results) -> list[str]:
    """For each configuration measured on several GPUs, whether the projection orders them as measured
    (faster first), and the speed ratio of the slowest to the fastest, measured and projected: per sample,
    as the GPUs may be measured at different batches."""
    lines = []
    by_config: dict[str, list] = {}
    for result in results:
        by_config.setdefault(result.point.label, []).append(result)
    for label, group in by_config.items():
        if len({r.point.gpu for r in group}) < 2:
            continue
        by_measured = sorted(group, key=lambda r: r.point.measured_s / r.point.samples)
        measured = [r.point.gpu for r in by_measured]
        projected = [r.point.gpu for r in sorted(group, key=lambda r: r.projected_s / r.point.samples)]
        fast, slow = by_measured[0], by_measured[-1]
        per_sample = slow.point.samples / fast.point.samples
        order = "same order" if measured == projected else "DIFFERENT ORDER"
        lines.append(f"{label}: measured {' faster than '.join(measured)}, projected "
                     f"{' faster than '.join(projected)}: {order}; {fast.point.gpu} / {slow.point.gpu} speed-up "
                     f"measured {slow.point.measured_s / fast.point.measured_s / per_sample:.2f}x, projected "
                     f"{slow.projected_s / fast.projected_s / per_sample:.2f}x (held-out)")
    return lines or ["no configuration is measured on two GPUs yet: the GPU ranking cannot be checked"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="store the fit and refresh the ledger")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    profiles = load_profiles()
    ledger = ledger_points(profiles)
    published, caveated = published_points(profiles)
    points = ledger + published
    start = values_of(points[0].base)
    vendors = {profiles[p.gpu].vendor for p in points}
    if len(vendors) != 1:  # one table of GPU constants is fitted: rows of two vendors must not share it
        raise SystemExit(f"calibration rows span vendors {sorted(vendors)}: fit one vendor at a time")
    priors = prior_values(profiles, points[0].gpu)
    print(f"{len(ledger)} ledger twins + {len(published)} published rows; fitting {len(PARAMETERS)} constants "
          f"towards their priors (each within a factor of {math.exp(PRIOR_SPREAD):.0f}, rows to {ROW_ERROR:.0%})")
    fitted = fit(points, start, priors)
    results = held_out(points, start, priors)
    print(f"\n{'row':44} {'GPU':15} {'measured ms':>11} {'current':>8} {'held-out':>8}  source   "
          "(error = projected / measured - 1; current: the constants in use; held-out: fitted without the row's cell)")
    for result in results:
        point = result.point
        current = projected_s(point, values_of(point.base)) / point.measured_s - 1
        print(f"{point.label:44} {point.gpu:15} {point.measured_s * 1e3:11.2f} {current:+8.1%} {result.error:+8.1%}"
              f"  {point.source[:60]}")
    for row, point in caveated:
        error = projected_s(point, fitted) / point.measured_s - 1
        print(f"{point.label:44} {point.gpu:15} {point.measured_s * 1e3:11.2f} {'':8} {error:+8.1%}"
              f"  not in the fit: {row['caveat']}")
    print("\nheld-out error by workload and precision:")
    frame = pd.DataFrame([{"workload": r.point.workload, "precision": r.point.precision, "error": r.error}
                          for r in results])
    for (workload, precision), group in frame.groupby(["workload", "precision"]):
        stats = summary(list(group["error"]))
        print(f"  {workload:9} {precision:11} n={stats['n']:2}  median |err| {stats['median_abs']:6.1%}  "
              f"worst {stats['worst_abs']:6.1%}  bias {stats['mean']:+6.1%}")
    overall = summary([r.error for r in results])
    verdict = "PASS" if overall["median_abs"] <= TARGET_MEDIAN and overall["worst_abs"] <= TARGET_WORST else "FAIL"
    print(f"all held-out rows: n={overall['n']}, median |error| {overall['median_abs']:.1%} (target <= "
          f"{TARGET_MEDIAN:.0%}), worst {overall['worst_abs']:.1%} (target <= {TARGET_WORST:.0%}): {verdict}")
    print("ranking:", *ranking_check(results), sep="\n  ")
    print("\nconstants fitted on all rows:", ", ".join(f"{k}={v:.3g}" for k, v in fitted.items()))
    # A constant on its bound is set by the bound, not by the rows: say so, as the fit's figures rest on it.
    for name, value, low, high in at_bounds(fitted):
        print(f"  {name} = {value:.3g} sits on its {'lower' if value <= low * 1.001 else 'upper'} bound "
              f"({low:g}-{high:g}): the rows push it further than the bound allows")
    if args.write:
        write(fitted, results, overall)


def at_bounds(values: dict[str, float]) -> list[tuple[str, float, float, float]]:
    """(name, value, low, high) of each fitted constant within 0.1% of one of its bounds."""
    return [(name, values[name], low, high) for name, _, low, high in PARAMETERS
            if name in values and (values[name] <= low * 1.001 or values[name] >= high * 0.999)]


def write(fitted: dict[str, float], results, overall) -> None:
    host = {name: fitted[name] for name, table, *_ in PARAMETERS if table == "host"}
    gpu = {k: v for k, v in fitted.items() if k not in host} | {"fitted": True}
    sources = sorted({r.point.source for r in results})
    document = {
        "fit": {"date": datetime.now(UTC).date().isoformat(), "status": "fitted", "rows": len(results),
                "held_out_median_abs_error": round(overall["median_abs"], 4),
                "held_out_worst_abs_error": round(overall["worst_abs"], 4),
                "held_out_bias": round(overall["mean"], 4),
                "method": ("least squares on log(projected / measured), pulled towards the priors of "
                           f"speed_constants.toml (each within a factor of {math.exp(PRIOR_SPREAD):.0f}; "
                           f"rows to {ROW_ERROR:.0%}); "
                           "held-out = leave one cell out"),
                "sources": sources},
        "host": host, "gpu": {"nvidia": gpu}}
    header = "# Written by benchmarks/projection_calibration.py --write: constants fitted on the rows named in [fit].\n"
    FIT_FILE.write_text(header + tomli_w.dumps(document))
    ledger = read_ledger()
    held = {r.point.group: r.projected_s for r in results}
    refreshed = 0
    for index, row in ledger.iterrows():
        key = ledger_label(row)[1]
        if key in held:
            ledger.loc[index, "projected_step_ms"] = held[key] * 1e3
            ledger.loc[index, "projected_by"] = f"held-out fit {document['fit']['date']}"
            refreshed += 1
    write_ledger(ledger, LEDGER_FILE)
    print(f"wrote {FIT_FILE} and refreshed {refreshed} of {len(ledger)} pairs in {LEDGER_FILE} with their cells' "
          "held-out projections")


if __name__ == "__main__":
    main()
