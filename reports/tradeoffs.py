"""The report's trade-off sections: which size and stack fits on which GPU (fit matrix), where a step's
memory goes under each stack (breakdown), and what each stack's memory costs in speed (Pareto front).

A cell fits when its peak reserved memory (what the caching allocator holds, the figure that runs out)
is within the profile's visible memory; the memory left is that difference, negative when short.
"""

from __future__ import annotations

import pandas as pd

from harness.advise import row_memory_left, row_memory_left_worst
from reports import charts
from reports import format as fmt
from reports.answer import throughput_bounds
from reports.cells import gpu_cells

# The memory categories of a row, in the order a step builds them up; allocator overhead is what the
# caching allocator holds beyond the tensors' bytes (reserved - allocated).
CATEGORIES = [("parameters", "params_bytes"), ("gradients", "grads_bytes"), ("optimizer", "optimizer_bytes"),
              ("KV cache", "kv_cache_bytes"), ("activations", "activations_bytes"),
              ("temporaries", "temporaries_bytes")]
# The GPUs a breakdown is drawn on when none was measured, most familiar first.
REFERENCE_GPUS = ("h100-sxm", "a100-sxm4-80gb", "h200", "l4", "a10")


def _cells(frame: pd.DataFrame, capacities: dict[str, int]) -> pd.DataFrame:
    """Single-device cells on GPU profiles that ran or were judged (ok or oom), measured rows standing in
    for their projected twins (reports/cells.py)."""
    rows = gpu_cells(frame, capacities, single_device=True)
    return rows[rows["status"].isin(["ok", "oom"])]


def fit_matrices(frame: pd.DataFrame, capacities: dict[str, int]) -> list[dict]:
    """Per workload and mode: size x stack rows, GPU columns, memory left (or short) in each cell."""
    rows = _cells(frame, capacities)
    matrices = []
    for (workload, mode), group in rows.groupby(["workload", "mode"], sort=False):
        group = group.assign(left=[row_memory_left(row, capacities[row["gpu"]]) for _, row in group.iterrows()],
                             worst=[row_memory_left_worst(row, capacities[row["gpu"]]) if row["source"] == "projected"
                                    else None for _, row in group.iterrows()])
        order = group.groupby("size")["params_bytes"].max().astype(float).sort_values().index
        gpus = sorted(group["gpu"].unique(), key=lambda g: (capacities[g], g))
        labels, left, marginal = [], [], []
        for size in order:
            part = group[group["size"] == size]
            # One row per stack and batch: what fits depends on the batch, so the label says it.
            for technique, batch in dict.fromkeys(zip(part["technique"], part["batch_size"], strict=True)):
                same = (part["technique"] == technique) & (part["batch_size"] == batch)
                by_gpu = part[same].drop_duplicates("gpu").set_index("gpu")
                cells, status, worst = by_gpu["left"], by_gpu["status"], by_gpu["worst"]
                labels.append(f"{size} b{fmt.number(batch, 0)} / {technique}")
                # An OOM without a figure (a measured cell that died) is short by an unknown amount.
                left.append([float("-inf") if status.get(gpu) == "oom" and fmt.missing(cells.get(gpu)) else
                             None if fmt.missing(cells.get(gpu)) else float(cells[gpu]) for gpu in gpus])
                # Fits as projected, but not at the high end of the projection's interval.
                marginal.append([not fmt.missing(cells.get(gpu)) and float(cells[gpu]) >= 0
                                 and not fmt.missing(worst.get(gpu)) and float(worst[gpu]) < 0 for gpu in gpus])
        fits = sum(value is not None and value >= 0 for row in left for value in row)
        may_not = sum(flag for row in marginal for flag in row)
        judged = sum(value is not None for row in left for value in row)
        sources = " and ".join(sorted(set(group["source"])))
        title = f"{workload} {mode}: fits on which GPU ({sources})"
        matrices.append({"name": f"fit-{workload}-{mode}", "title": title, "fits": fits, "judged": judged,
                         "marginal": may_not, "svg": charts.fit_heatmap(labels, gpus, left, title, marginal)})
    return matrices


def _reference_rows(group: pd.DataFrame) -> tuple[str, str, pd.DataFrame, str]:
    """The size and GPU a workload's breakdown is drawn for, and why: measured rows where there are (a GPU
    that was there), else the largest size with the most stacks on the GPU with the most rows."""
    measured = group[group["source"] == "measured"]
    pool = measured if len(measured) else group
    ok = pool[pool["status"] == "ok"]
    pool = ok if len(ok) else pool
    counts = pool.groupby(["size", "gpu"]).size()
    sizes = pool.groupby("size")["params_bytes"].max().astype(float)
    size = max(sizes.index, key=lambda name: (counts[name].max(), sizes[name]))
    gpus = counts[size]
    # A GPU people know the figures of reads best; failing those, the one with the most stacks.
    known = [gpu for gpu in REFERENCE_GPUS if gpus.get(gpu, 0) == gpus.max()]
    gpu = known[0] if known else max(gpus.index, key=lambda name: (gpus[name], name))
    fitting = "run" if len(ok) else "were tried"
    why = (f"the GPU these {size} cells were measured on" if len(measured) else
           f"the largest size with the most stacks that {fitting}, on "
           + (f"the most familiar GPU where as many {fitting} as anywhere" if known else
              f"the GPU where the most {fitting}"))
    # Every stack on that size and GPU, measured cells standing in for their projected twins (_cells).
    return size, gpu, group[(group["size"] == size) & (group["gpu"] == gpu)], why


def memory_sections(frame: pd.DataFrame, capacities: dict[str, int]) -> list[dict]:
    """Per workload and mode: stacked memory bars per stack and the speed-vs-memory Pareto chart."""
    rows = _cells(frame, capacities)
    sections = []
    for (workload, mode), group in rows.groupby(["workload", "mode"], sort=False):
        size, gpu, chosen, why = _reference_rows(group)
        chosen = chosen.drop_duplicates("technique")
        sources = set(chosen["source"])
        source = "measured" if sources == {"measured"} else "projected" if sources == {"projected"} else \
            "measured and projected"
        numbers = {name: pd.to_numeric(chosen[column], errors="coerce").astype(float).fillna(0).tolist()
                   for name, column in CATEGORIES}
        reserved = pd.to_numeric(chosen["peak_reserved_bytes"], errors="coerce").astype(float).fillna(0)
        # The categories are each one's bytes at the step's peak; what the allocator holds beyond them
        # fills the bar up to peak reserved (never below zero where they overlap in time).
        parts = pd.DataFrame(numbers).sum(axis=1).to_numpy()
        numbers["allocator overhead"] = (reserved.to_numpy() - parts).clip(min=0).tolist()
        numbers = {name: values for name, values in numbers.items() if any(values)}
        stacks = chosen["technique"].astype(str).tolist()
        title = f"{workload} {size} {mode} on {gpu} ({source}): where memory goes"
        section = {"name": f"memory-{workload}-{mode}", "title": title, "why": f"drawn for {why}",
                   "svg": charts.memory_bars(stacks, numbers, title, capacities.get(gpu)), "pareto": None}
        speed = chosen[chosen["status"] == "ok"]
        # Language models read in tokens, as the answer and the cost charts give them; the rest in samples.
        tokens = pd.to_numeric(speed.get("tokens_per_s"), errors="coerce").astype(float)
        unit = "tokens/s" if len(speed) and tokens.notna().all() else "samples/s"
        speed = speed.assign(speed=tokens if unit == "tokens/s" else
                             pd.to_numeric(speed["throughput_samples_s"], errors="coerce").astype(float),
                             memory=pd.to_numeric(speed["peak_reserved_bytes"], errors="coerce").astype(float))
        speed = speed.dropna(subset=["speed", "memory"])
        if len(speed) >= 2:
            points = [{"label": str(r["technique"]), "memory": r["memory"], "speed": r["speed"],
                       "front": not ((speed["memory"] <= r["memory"]) & (speed["speed"] >= r["speed"])
                                     & ((speed["memory"] < r["memory"]) | (speed["speed"] > r["speed"]))).any(),
                       **bounds} for (_, r), bounds in zip(speed.iterrows(), _ranges(speed), strict=True)]
            ptitle = f"{workload} {size} {mode} on {gpu} ({source}): speed against memory"
            section["pareto"] = {"name": f"pareto-{workload}-{mode}", "title": ptitle,
                                 "svg": charts.pareto_scatter(points, ptitle, unit),
                                 "front": ", ".join(p["label"] for p in sorted(points, key=lambda p: p["memory"])
                                                    if p["front"])}
        sections.append(section)
    return sections


def _ranges(speed: pd.DataFrame) -> list[dict]:
    """Each stack's error bars for the Pareto chart: speed from its throughput range (projection interval or
    measured noise, in the chart's unit), memory from a projection's peak-reserved interval (a measured
    peak is one reading); None where a row has no range."""
    low, high = throughput_bounds(speed)
    # The chart may read in tokens/s: the range scales with the point, samples per token being fixed.
    scale = speed["speed"] / pd.to_numeric(speed["throughput_samples_s"], errors="coerce").astype(float)
    projected = speed["source"] == "projected"
    memory_low, memory_high = (pd.to_numeric(speed.get(column, pd.Series(float("nan"), index=speed.index)),
                                             errors="coerce").astype(float).where(projected)
                               for column in ("peak_reserved_low_bytes", "peak_reserved_high_bytes"))
    return [{"speed_low": _number(a * k), "speed_high": _number(b * k), "memory_low": _number(c),
             "memory_high": _number(d)}
            for a, b, k, c, d in zip(low, high, scale, memory_low, memory_high, strict=True)]


def _number(value) -> float | None:
    return None if fmt.missing(value) else float(value)
