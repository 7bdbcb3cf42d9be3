"""The report's serving section: generation rows (time to first token, decode per token, KV cache) and
the serving fit matrix (harness/serve_matrix.py) as a table and a chart, with the guide's C1 judged on it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from reports import format as fmt

# Column -> (header, formatter) for generation rows.
GENERATION_COLUMNS = [
    ("size", "size", fmt.text), ("technique", "technique", fmt.text), ("gpu", "GPU", fmt.text),
    ("source", "source", fmt.text), ("status", "status", fmt.text), ("batch_size", "batch", fmt.text),
    ("seq_len", "prompt", fmt.text), ("gen_len", "generated", fmt.text),
    ("ttft_ms", "time to first token (ms)", lambda v: fmt.number(v, 2)),
    ("decode_ms_per_token_p50", "decode p50 (ms)", lambda v: fmt.number(v, 2)),
    ("decode_ms_per_token_p90", "decode p90 (ms)", lambda v: fmt.number(v, 2)),
    ("decode_tokens_s", "decode tokens/s", lambda v: fmt.number(v, 0)),
    ("prefill_tokens_s", "prefill tokens/s", lambda v: fmt.number(v, 0)),
    ("params_bytes", "weights", fmt.bytes_), ("kv_cache_bytes", "KV cache", fmt.bytes_),
    ("peak_reserved_bytes", "peak reserved", fmt.bytes_),
    ("decode_bandwidth_util", "decode bandwidth use", fmt.percent),
    ("usd_per_million_tokens", "USD / M generated tokens", fmt.usd),
]

MATRIX_COLUMNS = [
    ("size", "size", fmt.text), ("gpu", "GPU", fmt.text), ("weights", "weights", fmt.text),
    ("decode_tokens_s_b1", "decode tokens/s, batch 1", lambda v: fmt.number(v, 0)),
    ("decode_bandwidth_util_b1", "bandwidth use, batch 1", fmt.percent),
    ("decode_tokens_s_max", "decode tokens/s, largest batch", lambda v: fmt.number(v, 0)),
    ("usd_per_million_tokens_max", "USD / M tokens, largest batch", fmt.usd),
    ("usd_per_hour", "USD / GPU-hour", fmt.usd), ("price_date", "price date", fmt.text),
]


def generation_rows(frame: pd.DataFrame) -> dict | None:
    """The generation rows (served decoders' inference) as a table; None where there are none."""
    if "gen_len" not in frame:
        return None
    rows = frame[frame["gen_len"].notna()].sort_values(["size", "technique", "gpu", "source"], kind="stable")
    if rows.empty:
        return None
    return {"headers": [h for _, h, _ in GENERATION_COLUMNS],
            "rows": [{"cells": [f(row[c]) if c in row else fmt.EMPTY for c, _, f in GENERATION_COLUMNS],
                      "status": str(row["status"]), "reason": fmt.text(row["reason"] or row["notes"])}
                     for _, row in rows.iterrows()]}


def reprice_matrix(matrix: pd.DataFrame, prices: dict) -> pd.DataFrame:
    """The serving matrix costed at `prices` (harness/prices.py), as every other cost in the report is: each
    row's USD per million tokens from its replica's generated tokens a second (every GPU of it rented), or, in a
    matrix written before those were kept, its cost scaled by the new hourly price over the one it was costed at
    (none where it had no price); a GPU without a price has none."""
    matrix = matrix.copy()
    old = pd.to_numeric(matrix["usd_per_hour"], errors="coerce") if "usd_per_hour" in matrix else float("nan")
    new = matrix["gpu"].map(lambda g: prices[g].per_device if g in prices else float("nan")).astype(float)
    gpus = pd.to_numeric(matrix["gpus"], errors="coerce").fillna(1) if "gpus" in matrix else 1
    for column in [c for c in matrix.columns if c.startswith("usd_per_million_tokens")]:
        scaled = pd.to_numeric(matrix[column], errors="coerce") * new / old
        tokens = column.replace("usd_per_million_tokens", "generated_tokens_s")
        if tokens in matrix:
            rate = pd.to_numeric(matrix[tokens], errors="coerce")
            scaled = scaled.where(rate.isna(), new * gpus / 3600 / rate * 1e6)
        matrix[column] = scaled
    matrix["usd_per_hour"] = new
    matrix["price_date"] = matrix["gpu"].map(lambda g: prices[g].date if g in prices else None)
    return matrix


def matrix_section(matrix: pd.DataFrame, c1_verdict: str | None) -> dict | None:
    """The serving fit matrix as a table (largest batch per context first), a chart, and C1's verdict."""
    if matrix is None or matrix.empty:
        return None
    # A context past every size's own (32k for 4k-context models) is a column of dashes: left out, each row's note
    # says why.
    batches = [c for c in matrix.columns if c.startswith("max_batch_")]
    batches = [c for c in batches if c == batches[0] or pd.to_numeric(matrix[c], errors="coerce").notna().any()]
    # A tensor-parallel replica's rows (serve-matrix --tp) name their GPUs; a matrix of one GPU each does not.
    replicas = [("gpus", "GPUs per replica", fmt.text)] if "gpus" in matrix and (matrix["gpus"] > 1).any() else []
    columns = MATRIX_COLUMNS[:2] + replicas + [MATRIX_COLUMNS[2]] + [
        (c, f"largest batch at {c.removeprefix('max_batch_')}", _batch) for c in batches] + MATRIX_COLUMNS[3:]
    rows = [{"cells": [ranged(row, c, f) if c in row else fmt.EMPTY for c, _, f in columns], "status": "ok",
             "reason": fmt.text(row["notes"]) if "notes" in row and not fmt.missing(row["notes"]) else ""}
            for _, row in matrix.iterrows()]
    figure = {"name": "serve-matrix", "svg": fit_chart(matrix, batches[0]),
              "title": f"Largest batch per GPU at {batches[0].removeprefix('max_batch_')} tokens (projected)"}
    return {"headers": [h for _, h, _ in columns], "rows": rows, "figure": figure,
            "c1": c1_verdict, "context": batches[0].removeprefix("max_batch_"),
            "identity": 3 + len(replicas)}  # size, GPU, [GPUs per replica,] weights: left of the reason


# The matrix's speed and cost columns, and the batch (b1, max) whose speed range (serve_matrix.py) they take.
RANGED = {"decode_tokens_s_b1": "b1", "decode_tokens_s_max": "max", "generated_tokens_s_b1": "b1",
          "usd_per_million_tokens_b1": "b1", "usd_per_million_tokens_max": "max"}


def speed_range(row, batch: str) -> tuple[float, float] | None:
    """(slowest, fastest) factors on the row's speed at `batch` (b1 or max), None where the matrix has none."""
    low, high = row.get(f"speed_factor_low_{batch}"), row.get(f"speed_factor_high_{batch}")
    if fmt.missing(low) or fmt.missing(high):
        return None
    return float(low), float(high)


def ranged(row, column: str, formatter) -> str:
    """A matrix cell, with its range where it is a speed or cost whose projection carries one: a cost is
    dearest at the slowest speed."""
    text = formatter(row[column])
    factors = speed_range(row, RANGED[column]) if column in RANGED and not fmt.missing(row[column]) else None
    if not factors:
        return text
    low, high = (1 / factors[1], 1 / factors[0]) if column.startswith("usd") else factors
    return f"{text} ({formatter(float(row[column]) * low)} - {formatter(float(row[column]) * high)})"


def _batch(value) -> str:
    if fmt.missing(value):
        return fmt.EMPTY
    return "does not fit" if int(value) == 0 else str(int(value))


def fit_chart(matrix: pd.DataFrame, column: str) -> str:
    """Size x GPU heat maps of the largest batch at one context, one panel per weight precision, as inline
    SVG (matplotlib's SVG backend escapes the text it draws)."""
    from reports.charts import plt, svg_of

    if "gpus" in matrix:  # a tensor-parallel replica is a column of its own: `4x h100-sxm`
        matrix = matrix.assign(gpu=[gpu if count == 1 else f"{int(count)}x {gpu}"
                                    for gpu, count in zip(matrix["gpu"], matrix["gpus"].fillna(1), strict=True)])
    weights = list(dict.fromkeys(matrix["weights"]))
    sizes, gpus = list(dict.fromkeys(matrix["size"])), list(dict.fromkeys(matrix["gpu"]))
    # Each panel: a row per size, room below for the GPU names written at an angle.
    panel = 0.45 * len(sizes) + 1.6
    figure, axes = plt.subplots(len(weights), 1, figsize=(max(6.0, 0.6 * len(gpus) + 2), panel * len(weights)),
                                squeeze=False)
    for axis, weight in zip(axes[:, 0], weights, strict=True):
        part = matrix[matrix["weights"] == weight].pivot_table(index="size", columns="gpu", values=column,
                                                                aggfunc="first").reindex(index=sizes, columns=gpus)
        values = part.astype(float).to_numpy()
        # Red where it does not fit; from yellow (batch 1) to green (the panel's largest batch) on a log scale,
        # so a card that holds batch 70 reads apart from one that holds 3; blank where not tabulated.
        largest = np.log(max(2.0, np.nanmax(values, initial=2.0)))
        shade = np.where(values > 0, 0.5 + 0.5 * np.log(np.where(values > 0, values, 1.0)) / largest,
                         np.where(values == 0, 0.0, np.nan))
        axis.imshow(shade, cmap="RdYlGn", vmin=-0.1, vmax=1.1, aspect="auto")
        for (i, j), value in pd.DataFrame(values).stack(future_stack=True).items():
            axis.text(j, i, "-" if value != value else ("OOM" if value == 0 else f"{int(value)}"),
                      ha="center", va="center", fontsize=7)
        axis.set_yticks(range(len(sizes)), sizes, fontsize=8)
        axis.set_xticks(range(len(gpus)), gpus, fontsize=7, rotation=45, ha="right")
        axis.set_title(f"{weight} weights: largest batch at {column.removeprefix('max_batch_')} tokens (projected)",
                       fontsize=9)
    figure.tight_layout()
    return svg_of(figure)
