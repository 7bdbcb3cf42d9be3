"""A served decoder's one-row decode speed, projected against published measurements: fitted on some, judged
on others the fit never sees.

benchmarks/data/published_decode.csv holds batch-1 decodes of Llama models under torch.compile (CUDA graphs),
in bf16 and with int8 / int4 weight-only quantisation: torchao's README tables (the `fit` rows, on an
A100-80GB; its H100 rows are held out, as it does not say which H100) and gpt-fast's README (`held-out`: the
same kind of program, measured apart, on A100s and one MI250X GCD). The fit sets how fast NVIDIA GPUs stream
a decode's weights (harness/project/decode_fit.py); the table prints each row's error under the priors,
under the fit, and held out (fit rows: leave one model out; held-out rows: never fitted). AMD rows keep
AMD's priors: NVIDIA's fit never applies to them.

Usage: python benchmarks/decode_calibration.py [--write]   (--write stores the fit in
harness/project/decode_fit.toml, which the projection then uses; refit after the training fit changes)
"""

from __future__ import annotations

import argparse
import statistics
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import tomli_w

from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import project
from harness.project.decode_fit import (
    SHARES,
    STREAM,
    DecodePoint,
    fit,
    held_out_errors,
    parameter_names,
    projected_tokens_s,
)
from harness.project.roofline import op_arrays
from harness.project.speed_constants import DECODE_FIT_FILE, constants_for, training_fit_digest

DATA = Path(__file__).with_name("data") / "published_decode.csv"
# gpt-fast's and torchao's generate.py: a short prompt ("Hello, my name is": 5 tokens), 200 new tokens,
# tokens/s = new tokens / the generation's time, prefill included.
PROMPT_TOKENS, NEW_TOKENS = 5, 200
FITTED_VENDOR = "nvidia"
PHASES = ("prefill", "decode_first", "decode_last")


def decode_point(row: dict, profiles) -> tuple[DecodePoint, str]:
    """The row's cell traced once, its phases as the speed model's input, and its GPU's vendor."""
    cell = Cell("gpt", row["size"], "infer", row["technique"], row["gpu"], 1, "projected",
                prompt_len=PROMPT_TOKENS, gen_len=NEW_TOKENS).resolve(profiles)
    trace = project(cell).trace
    profile = cell.profile.per_device()
    phases = tuple(op_arrays(trace, profile, trace.tf32, (phase,)) for phase in PHASES)
    point = DecodePoint(label=f"{row['label']} ({row['set']})", model=row["size"], tokens_s=float(row["value"]),
                        gen_len=NEW_TOKENS, phases=phases, constants=constants_for(profile, decode=None))
    return point, profile.vendor


def priors(point: DecodePoint) -> dict[str, float]:
    gpu = point.constants.gpu
    return {STREAM: gpu.stream_bandwidth_efficiency, **{name: getattr(gpu, name) for name, _, _ in SHARES}}


def error(point: DecodePoint, values: dict[str, float]) -> float:
    return projected_tokens_s(point, values) / point.tokens_s - 1


def summary(name: str, errors: list[float]) -> str:
    if not errors:
        return f"{name}: no rows"
    absolute = [abs(e) for e in errors]
    return (f"{name}: n={len(errors)}, median |error| {statistics.median(absolute):.1%}, worst {max(absolute):.1%}, "
            f"mean signed {statistics.mean(errors):+.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store the fit in {DECODE_FIT_FILE.name}")
    args = parser.parse_args(argv)
    profiles = load_profiles()
    frame = pd.read_csv(DATA)
    rows = []
    for index, row in enumerate(frame.to_dict("records"), start=1):
        print(f"[{index}/{len(frame)}] tracing {row['label']} on {row['gpu']}", flush=True)
        point, vendor = decode_point(row, profiles)
        rows.append((row, point, vendor))
    fit_points = [p for row, p, vendor in rows if row["set"] == "fit" and vendor == FITTED_VENDOR]
    start = {name: priors(fit_points[0])[name] for name in parameter_names(fit_points)}
    fitted = fit(fit_points, start)
    left_out = held_out_errors(fit_points, start)

    print("\nbatch-1 decode tokens/s, projected / published - 1 (prior: the constants before any decode fit; fitted: "
          "with the fit; held out: fit rows left out by model, held-out rows never fitted)")
    print(f"{'row':44} {'GPU':16} {'published':>9} {'prior':>8} {'fitted':>8} {'held out':>9}")
    held, amd = [], []
    for row, point, vendor in rows:
        values = fitted if vendor == FITTED_VENDOR else {}
        prior, now = error(point, {}), error(point, values)
        out = left_out.get(point.label, now)
        if vendor != FITTED_VENDOR:
            amd.append(now)
        elif row["set"] != "fit":
            held.append(now)
        print(f"{point.label:44} {row['gpu']:16} {point.tokens_s:9.1f} {prior:+8.1%} {now:+8.1%} {out:+9.1%}")
    print()
    print(summary("fit rows, in sample", [error(p, fitted) for p in fit_points]))
    print(summary("fit rows, leave one model out", list(left_out.values())))
    print(summary("held-out rows (NVIDIA, never fitted)", held))
    print(summary("AMD rows (AMD priors, nothing fitted)", amd))
    print("fitted: " + ", ".join(f"{name} = {value:.3f} (prior {start[name]:.3f})" for name, value in fitted.items()))
    caveats = sorted({str(row["caveat"]) for row, _, _ in rows if isinstance(row["caveat"], str)})
    print("caveats:\n  " + "\n  ".join(caveats))
    if args.write:
        write(fitted, fit_points, left_out, held, frame)
    return 0


def write(fitted: dict[str, float], points: list[DecodePoint], left_out: dict[str, float], held: list[float],
          frame) -> None:
    absolute = [abs(e) for e in left_out.values()]
    document = {
        "decode_fit": {"date": datetime.now(UTC).date().isoformat(), "status": "fitted", "rows": len(points),
                       "held_out_median_abs_error": round(statistics.median(absolute), 4),
                       "held_out_worst_abs_error": round(max(absolute), 4),
                       # the NVIDIA rows of published_decode.csv the fit never saw (gpt-fast's, torchao's H100)
                       "held_out_rows": len(held),
                       "held_out_rows_median_abs_error": round(statistics.median(abs(e) for e in held), 4),
                       "held_out_rows_worst_abs_error": round(max(abs(e) for e in held), 4),
                       "method": "least squares on log(projected / published tokens/s); held-out = leave one model out",
                       # the training fit it was fitted with (speed_fit.toml): refit this after refitting that
                       "training_fit_digest": training_fit_digest(),
                       "sources": sorted(set(frame.loc[frame["set"] == "fit", "source"]))},
        "gpu": {FITTED_VENDOR: {**{name: round(value, 4) for name, value in fitted.items()}, "decode_fitted": True}}}
    header = ("# Written by benchmarks/decode_calibration.py --write: a served decoder's streaming constants,\n"
              "# fitted on the published decodes named in [decode_fit] (the training fit of speed_fit.toml in use).\n")
    DECODE_FIT_FILE.write_text(header + tomli_w.dumps(document))
    print(f"wrote {DECODE_FIT_FILE}")


if __name__ == "__main__":
    raise SystemExit(main())
