"""The report's answer: for each workload, model size and mode, the GPU + stack to rent or buy.

Three picks among the cells that fit: the cheapest GPU-hour (the smallest outlay that runs it at all),
the fastest (samples/s) and the best value (fewest USD per million samples). A projected pick carries
its interval from the ledger (harness/ledger.py), a measured one its run-to-run noise, so two picks
whose ranges overlap read as a tie rather than a verdict.
"""

from __future__ import annotations

import pandas as pd

from harness.advise import row_memory_left, row_memory_left_worst
from harness.prices import tokens_per_sample
from reports import format as fmt
from reports.cells import gpu_cells
from reports.serving import ranged, reprice_matrix

IDENTITY = ["workload", "size", "mode"]


def candidates(frame: pd.DataFrame, capacities: dict[str, int]) -> pd.DataFrame:
    """Cells on a GPU profile (not the CPU) that ran or would run (`ok`, not projected to OOM) with a
    throughput, measured cells replacing their projected twins, with memory left and throughput bounds."""
    if not len(frame):
        return frame
    rows = gpu_cells(frame, capacities)
    rows = rows[rows["status"] == "ok"]
    rows = rows[pd.to_numeric(rows["throughput_samples_s"], errors="coerce").fillna(0) > 0]
    rows = (rows[~rows["fits"].eq(False).fillna(False)] if "fits" in rows else rows).copy()
    rows["throughput_low"], rows["throughput_high"] = throughput_bounds(rows)
    rows["memory_left_bytes"] = [row_memory_left(row, capacities[row["gpu"]]) for _, row in rows.iterrows()]
    rows["memory_left_worst_bytes"] = [row_memory_left_worst(row, capacities[row["gpu"]])
                                       if row["source"] == "projected" else None for _, row in rows.iterrows()]
    rows["devices"] = pd.to_numeric(rows["world_size"], errors="coerce").fillna(1).astype(float)
    return rows


def throughput_bounds(rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Each row's throughput range (samples/s): a projected row's from its step-time interval, a measured
    one's from its step-to-step noise (coefficient of variation); NaN where the row has neither."""
    throughput = pd.to_numeric(rows["throughput_samples_s"], errors="coerce").astype(float)
    p50 = pd.to_numeric(rows["step_time_ms_p50"], errors="coerce").astype(float)
    low = pd.to_numeric(rows.get("step_time_ms_low"), errors="coerce").astype(float)
    high = pd.to_numeric(rows.get("step_time_ms_high"), errors="coerce").astype(float)
    cv = pd.to_numeric(rows.get("step_time_cv"), errors="coerce").astype(float)
    measured_rows = rows["source"] == "measured"
    # Samples per step are fixed, so throughput scales with 1 / step time: the slow end of the step
    # interval is the low end of the throughput's.
    # Noise past 100% would make the slow end zero or negative: no lower bound then.
    return ((throughput * p50 / high).where(~measured_rows, throughput * (1 - cv).where(cv < 1)),
            (throughput * p50 / low).where(~measured_rows, throughput * (1 + cv)))


def _ranked(rows: pd.DataFrame, by: str, ascending: bool) -> pd.DataFrame:
    """`rows` best first by `by` (faster first among equals)."""
    return rows.dropna(subset=[by]).sort_values([by, "throughput_samples_s"], ascending=[ascending, False],
                                                kind="stable")


def _pick(rows: pd.DataFrame, by: str, ascending: bool):
    """The best row by `by`, among those that fit at the high end of their memory interval where any does
    (a pick the report must flag "may not fit" is offered only where no sure one exists)."""
    ranked = _ranked(rows, by, ascending)
    if "memory_left_worst_bytes" in ranked:
        worst = pd.to_numeric(ranked["memory_left_worst_bytes"], errors="coerce")
        sure = ranked[worst.isna() | (worst >= 0)]
        ranked = sure if len(sure) else ranked
    return None if ranked.empty else ranked.iloc[0]


# How a passed-over row beats the pick, per pick.
BETTER = {"cheapest": "cheaper", "fastest": "faster", "value": "better value"}


def _passed_over(rows: pd.DataFrame, by: str, ascending: bool, pick, name: str, language: bool) -> str:
    """Where a better row was passed over because it may not fit (`_pick`), what it offers and why it is not the
    pick, so a pick slower or dearer than another pick in its row is explained; empty otherwise."""
    ranked = _ranked(rows, by, ascending)
    if pick is None or ranked.empty or ranked.iloc[0].name == pick.name:
        return ""
    better = ranked.iloc[0]
    shown = describe(better, language)
    offer = {"cheapest": f"${float(better['usd_per_hour']) * float(better['devices']):,.2f} an hour",
             "fastest": shown["speed"].split(" (")[0], "value": shown["cost"].split(" (")[0]}[name]
    worst = -float(better["memory_left_worst_bytes"])
    return (f"{BETTER[name]}: {shown['gpu']} with {better['technique']} ({offer}), but it may not fit: its interval "
            f"reaches {fmt.bytes_(worst)} past the memory")


def _bounds(row) -> tuple[float, float] | None:
    """The throughput range of a candidate, None where it has none (or a lower end at or below zero)."""
    low, high = row["throughput_low"], row["throughput_high"]
    if fmt.missing(low) or fmt.missing(high) or float(low) <= 0:
        return None
    return float(low), float(high)


def _ties(rows: pd.DataFrame, pick, per: str, comparable: dict[str, str] | None = None,
          ratio_error: float | None = None) -> int:
    """Other cells within reach of the pick: `per` is `speed` (throughput) or `cost` (USD per sample, the inverse
    of throughput at each one's price), so no verdict between them. Two projections on GPUs whose speed constants
    one fit shares (`comparable`: the fit's key per GPU) err together, so their intervals overlap far more than
    their ratio is in doubt: they tie where they differ by less than the projection's held-out error on such
    ratios (`ratio_error`, benchmarks/cross_gpu_ratios.py). Other pairs tie where their ranges overlap."""
    mine = _bounds(pick)
    count = 0
    for index, row in rows.iterrows():
        if index == pick.name:
            continue
        if per == "cost" and (fmt.missing(row["usd_per_million_samples"]) or
                              fmt.missing(pick["usd_per_million_samples"])):
            continue
        if ratio_error is not None and _shared_fit(pick, row, comparable or {}):
            column = "usd_per_million_samples" if per == "cost" else "throughput_samples_s"
            ours, theirs = float(pick[column]), float(row[column])
            count += max(ours, theirs) <= (1 + ratio_error) * min(ours, theirs)
            continue
        theirs = _bounds(row)
        if mine is None or theirs is None:
            continue
        if per == "cost":
            scale = lambda r: float(r["usd_per_million_samples"]) * float(r["throughput_samples_s"])  # noqa: E731
            mine_cost = (scale(pick) / mine[1], scale(pick) / mine[0])
            theirs_cost = (scale(row) / theirs[1], scale(row) / theirs[0])
            count += theirs_cost[0] <= mine_cost[1] and mine_cost[0] <= theirs_cost[1]
        else:
            count += theirs[0] <= mine[1] and mine[0] <= theirs[1]
    return count


def _shared_fit(first, second, comparable: dict[str, str]) -> bool:
    """Whether two rows are projections on two GPUs costed by one fitted set of speed constants (two stacks on one
    GPU are not what the ratio check measured)."""
    keys = {comparable.get(str(first["gpu"])), comparable.get(str(second["gpu"]))}
    return (first["source"] == second["source"] == "projected" and first["gpu"] != second["gpu"]
            and len(keys) == 1 and None not in keys)


def describe(row, language: bool, ties: int = 0) -> dict:
    """One pick as the report shows it: what to run, how fast, at what cost, with its range."""
    throughput = float(row["throughput_samples_s"])
    bounds = _bounds(row)
    usd = row["usd_per_million_samples"]
    # Language models read in tokens (generated tokens for a served decoder), the rest in samples.
    tokens = tokens_per_sample(row) if language else None
    # A served decoder is costed per generated token (its prompt's prefill in the time): said so, as a training
    # row's tokens are every token of the sequence.
    generated = row.get("mode") == "infer" and not fmt.missing(row.get("gen_len"))
    scale, unit = (tokens, "generated tokens" if generated else "tokens") if tokens else (1.0, "samples")
    cost = "no price known"
    if not fmt.missing(usd):
        cost = f"{fmt.usd(float(usd) / scale)} / M {unit}"
        if bounds:
            cost += f" ({fmt.usd(float(usd) * throughput / bounds[1] / scale)} - " \
                    f"{fmt.usd(float(usd) * throughput / bounds[0] / scale)})"
    devices = int(row["devices"])
    gpus = f"{devices} x {row['gpu']}" if devices > 1 else str(row["gpu"])
    speed = f"{fmt.rate(throughput * scale)} {unit}/s"
    if bounds:
        speed += f" ({fmt.rate(bounds[0] * scale)} - {fmt.rate(bounds[1] * scale)}, " + \
            ("run-to-run noise" if row["source"] == "measured" else "projection interval") + ")"
    return {
        "gpu": gpus, "stack": str(row["technique"]), "source": str(row["source"]),
        "batch": fmt.text(row["batch_size"]), "speed": speed, "cost": cost,
        "price": (str(row.get("price_label")) + _stale(row.get("price_date"))) if not fmt.missing(usd) else "",
        "left": _left(row),
        "basis": _pairs(row) if bounds and row["source"] != "measured" else "", "note": None,
        "ties": (f"{ties} other{'s' if ties != 1 else ''} too close to call"
                 + (f": no clear winner at this error bar ({NARROWS[row['source'] == 'measured']})"
                    if ties >= CLEAR_TIES else "")) if ties else "",
    }


# From this many picks within a pick's range, the answer is a shortlist, not a winner.
CLEAR_TIES = 5
# What narrows a range: for a projection, measured twins; for a measurement, more repeats.
NARROWS = {False: "measured twins narrow it", True: "more repeats narrow it"}


def _pairs(row) -> str:
    """What a projected pick's interval rests on: the ledger's basis (harness/ledger.py: how many measured
    cells, of which kind), where the row has one."""
    basis = row.get("interval_basis")
    step = next((part.removeprefix("step time: ") for part in str(basis).split("; ")
                 if part.startswith("step time: ")), None) if not fmt.missing(basis) else None
    return step or ""


def number_bases(answers: list[dict]) -> list[str]:
    """What the picks' projection intervals rest on, each told once under the table: every pick gets the number
    (`note`) of its basis in the returned list, rather than the sentence in every cell."""
    bases: dict[str, int] = {}
    for answer in answers:
        for pick in answer["picks"].values():
            if pick and pick.get("basis"):
                pick["note"] = bases.setdefault(pick["basis"], len(bases) + 1)
    return list(bases)


def _stale(day) -> str:
    """`; 2.6 years old: re-check, prices have moved since` for a price past harness/prices.STALE_AFTER_DAYS,
    else nothing."""
    from datetime import date

    from harness.gpu_profile import price_day
    from harness.prices import Price, age_text

    if price_day(day) is None:
        return ""
    age, _, warning = age_text(Price("", 0.0, day, ""), date.today()).partition(": ")
    return f"; {age} old: {warning}" if warning else ""


def _left(row) -> str:
    """Memory left at the peak; where the projection's interval reaches past the memory, that it may not fit."""
    left, worst = row["memory_left_bytes"], row.get("memory_left_worst_bytes")
    if fmt.missing(worst) or float(worst) >= 0:
        return f"{fmt.bytes_(left)} left"
    return f"{fmt.bytes_(left)} left, but may not fit: its interval reaches {fmt.bytes_(-float(worst))} past the memory"


def answers(frame: pd.DataFrame, capacities: dict[str, int], comparable: dict[str, str] | None = None,
            ratio_error: float | None = None) -> list[dict]:
    """Per workload, size and mode: the cheapest, fastest and best-value picks; where there is none, why.
    `comparable` and `ratio_error`: which projections err together and by how much their ratios do (`_ties`)."""
    rows = candidates(frame, capacities)
    result = []
    if not len(frame):
        return result
    for (workload, size, mode), group in frame.groupby(IDENTITY, sort=False):
        if not set(group["gpu"]) & set(capacities):
            continue  # only CPU cells: nothing to buy from them
        fitting = rows[(rows["workload"] == workload) & (rows["size"] == size) & (rows["mode"] == mode)]
        language = bool(len(fitting)) and any(tokens_per_sample(row) for _, row in fitting.iterrows())
        priced = fitting.assign(hourly=fitting["usd_per_hour"] * fitting["devices"]) if len(fitting) else fitting
        picks = {
            "cheapest": _pick(priced, "hourly", True) if len(priced) else None,
            "fastest": _pick(fitting, "throughput_samples_s", False) if len(fitting) else None,
            "value": _pick(fitting, "usd_per_million_samples", True) if len(fitting) else None,
        }
        per = {"cheapest": None, "fastest": "speed", "value": "cost"}
        # Where nothing fits, the next step: what else one GPU can do, else how many GPUs it takes.
        why = (f"nothing tried fits one GPU: headroom advise --workload {workload} --size {size} --mode {mode} "
               f"--gpu GPU tries more stacks; headroom project ... --min-gpus counts the GPUs it takes"
               if not len(fitting) else "no GPU it fits on has a price")
        tried = group[group["gpu"].isin(capacities)]
        # GPUs it fits on that no pick can weigh (no price): named, so their absence is not read as a verdict.
        unpriced = sorted(set(fitting["gpu"][pd.to_numeric(fitting["usd_per_hour"], errors="coerce").isna()])) \
            if len(fitting) and "usd_per_hour" in fitting else []
        by = {"cheapest": (priced, "hourly", True), "fastest": (fitting, "throughput_samples_s", False),
              "value": (fitting, "usd_per_million_samples", True)}
        described = {name: describe(row, language, _ties(fitting, row, per[name], comparable, ratio_error)
                                    if per[name] else 0)
                     | {"passed": _passed_over(*by[name], row, name, language)}
                     if row is not None else None for name, row in picks.items()}
        result.append({
            "workload": str(workload), "size": str(size), "mode": str(mode),
            "picks": described,
            "why": why, "fitting": len(fitting), "tried": len(tried), "unpriced": unpriced,
            "params": pd.to_numeric(group["param_count"], errors="coerce").max() if "param_count" in group else None,
        })
    # Smallest model first within each workload (as the fit matrix orders them), workloads as they came.
    order = {name: index for index, name in enumerate(dict.fromkeys(a["workload"] for a in result))}
    return sorted(result, key=lambda a: (order[a["workload"]], _or_inf(a["params"]), a["size"], a["mode"]))


def _or_inf(value) -> float:
    return float("inf") if fmt.missing(value) else float(value)


def cost_charts(frame: pd.DataFrame, capacities: dict[str, int]) -> list[dict]:
    """Per workload and mode: USD per million samples (tokens for language models) of the cheapest stack on
    each GPU, for every size, as a chart (see reports/charts.py: cost_dots)."""
    from reports.charts import cost_dots

    rows = candidates(frame, capacities)
    charts = []
    if not len(rows):
        return charts
    rows = rows.dropna(subset=["usd_per_million_samples"])
    # Every chart colours a size alike: the report's sizes, smallest model first.
    params = pd.to_numeric(rows["param_count"], errors="coerce") if "param_count" in rows else pd.Series(0, rows.index)
    palette = list(rows.assign(params=params).sort_values("params", kind="stable")["size"].astype(str).unique())
    for (workload, mode), group in rows.groupby(["workload", "mode"], sort=False):
        language = group["usd_per_million_tokens"].notna().all()
        column = "usd_per_million_tokens" if language else "usd_per_million_samples"
        best = group.sort_values(column, kind="stable").groupby(["size", "gpu"], sort=False).head(1)
        points = []
        for _, row in best.iterrows():
            cost, throughput = float(row[column]), float(row["throughput_samples_s"])
            low, high = row["throughput_low"], row["throughput_high"]
            ranged = not fmt.missing(low) and not fmt.missing(high) and float(low) > 0
            points.append({"gpu": str(row["gpu"]), "size": str(row["size"]), "cost": cost,
                           "low": cost * throughput / float(high) if ranged else None,
                           "high": cost * throughput / float(low) if ranged else None,
                           "measured": str(row["source"]) == "measured"})
        unit = "tokens" if language else "samples"
        title = f"{workload} {mode}: USD per million {unit} on each GPU"
        charts.append({"name": f"cost-{workload}-{mode}", "title": title,
                       "svg": cost_dots(points, title, unit, palette)})
    return charts


def _stream(row, column: str, rate) -> str:
    """What the fastest stream's pick says of its speed: generated tokens a second with the prefill, and the
    decode's own rate beside it, or the decode's alone from an older matrix."""
    if column == "decode_tokens_s_b1":
        return f"{rate(row, column)} tokens/s for one stream (decode)"
    return (f"{rate(row, column)} tokens/s for one stream, its prompt's prefill included "
            f"(decode {rate(row, 'decode_tokens_s_b1')})")


def serving_answers(matrix: pd.DataFrame | None, prices: dict) -> list[dict]:
    """Per served size (harness/serve_matrix.py: its decode, compiled or eager, at its first context): the best value
    (fewest USD per million generated tokens at the largest batch that fits), the fastest single stream (its
    generated tokens a second, prefill included), and the cheapest GPU-hour that holds the model, each with its
    weights' precision. The matrix's costs are taken again at `prices` (its rows say which hourly price they were
    costed at)."""
    if matrix is None or matrix.empty:
        return []
    batch = next((c for c in matrix.columns if c.startswith("max_batch_")), None)
    rows = matrix[pd.to_numeric(matrix[batch], errors="coerce").fillna(0) >= 1].copy() if batch else matrix[:0]
    rows = reprice_matrix(rows, prices)
    for column in ("usd_per_million_tokens_max", "decode_tokens_s_b1", "decode_tokens_s_max"):
        if column not in rows:  # an older or hand-made matrix: that figure is unknown
            rows[column] = float("nan")
    rows["usd"] = pd.to_numeric(rows["usd_per_million_tokens_max"], errors="coerce").astype(float)
    # A tensor-parallel replica (serve-matrix --tp) costs its GPUs' hours together and is named by them.
    gpus = pd.to_numeric(rows["gpus"], errors="coerce").fillna(1) if "gpus" in rows else pd.Series(1, rows.index)
    rows["hourly"] = rows["usd_per_hour"] * gpus
    rows["replica"] = [gpu if count == 1 else f"{int(count)}x {gpu}" for gpu, count in zip(rows["gpu"], gpus,
                                                                                              strict=True)]
    rows["price"] = [(prices[gpu].label + (f" each, {int(count)} GPUs" if count > 1 else "")) if gpu in prices else ""
                     for gpu, count in zip(rows["gpu"], gpus, strict=True)]
    context = batch.removeprefix("max_batch_") if batch else ""
    # `headroom serve-matrix` compiles the decode unless told --eager: the heading says which was costed.
    techniques = matrix["technique"].dropna() if "technique" in matrix else []
    decode = " and ".join(sorted({"compiled" if "compile" in str(t).split("+") else "eager" for t in techniques}))
    result = []
    for size in dict.fromkeys(matrix["size"]):
        fitting = rows[rows["size"] == size]

        def entry(row, what: str, at: str = "max") -> dict | None:
            """The pick's figures, its cost at the largest batch or (`at` "b1") for one stream."""
            if row is None:
                return None
            cost, column = "no price known", f"usd_per_million_tokens_{at}"
            if column in row and not fmt.missing(row[column]):
                cost = ranged(row, column, fmt.usd) + " / M tokens" + (" for one stream" if at == "b1" else "")
            return {"gpu": str(row["replica"]), "weights": str(row["weights"]), "what": what, "cost": cost,
                    "price": row["price"]}

        def rate(row, column: str) -> str:
            return ranged(row, column, lambda v: fmt.number(v, 0))

        value = _pick(fitting.assign(throughput_samples_s=fitting["decode_tokens_s_max"]), "usd", True)
        # The fastest stream is the one whose whole answer comes soonest: its prompt's prefill and its decode
        # together (int4's tinygemm decodes fastest but prefills slowest). A matrix from before
        # generated_tokens_s_* has the decode alone.
        stream = "generated_tokens_s_b1" if fitting.get("generated_tokens_s_b1", pd.Series()).notna().any() \
            else "decode_tokens_s_b1"
        fastest = _pick(fitting.assign(throughput_samples_s=0.0), stream, False) if len(fitting) else None
        cheapest = _pick(fitting.assign(throughput_samples_s=fitting["decode_tokens_s_max"]), "hourly", True)
        result.append({"size": str(size), "context": context, "decode": decode, "picks": {
            "cheapest": entry(cheapest, f"largest batch {int(cheapest[batch])}" if cheapest is not None else ""),
            "fastest": entry(fastest, _stream(fastest, stream, rate) if fastest is not None else "", "b1"),
            "value": entry(value, f"{rate(value, 'decode_tokens_s_max')} tokens/s at batch "
                           f"{int(value[batch])}" if value is not None else "")}})
    return result
