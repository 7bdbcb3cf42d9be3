"""The guide's claims C1-C16 (docs/GUIDE.md) judged on the report's rows: the claim, what headroom found,
the rows it rests on, and a verdict (supported, contradicted and by how much, or not measurable here
and why). Claims judged elsewhere (C1 serving matrix, C4 fragmentation probe, C6/C9 accuracy) arrive
as their verdict text; the parallelism claims C11-C14 in reports/claims_parallel.py; the rest here, from
the results frame.
"""

from __future__ import annotations

import pandas as pd
from scipy.stats import binomtest

from suites.techniques.accumulation import DEFAULT_MICRO_BATCHES

GB = 1e9  # the guide quotes decimal GB
# The GPUs the guide's claims are about, in the order a judgement prefers them when nothing was
# measured on a GPU (the claims date from the A100 era).
PREFERRED_GPUS = ("a100-sxm4-80gb", "a100-pcie-80gb", "h100-sxm", "a10")

CLAIMS = {
    "C1": "one A100 80 GB holds an FP16 model of only about 13 B parameters",
    "C2": "training memory is parameters (FP16: 2 B/param), Adam's state (16 B/param in FP32) and activations",
    "C3": "GPT-3 175B training: parameters 350 GB, optimizer state 2,800 GB, activations about 500 GB at batch 1024",
    "C4": "fragmentation wastes 30-50% of GPU memory",
    "C5": "mixed precision cuts ResNet-50 training memory by 40% and speeds it up 1.5x",
    "C6": "layer sharing on BERT-base costs 1.2% accuracy",
    "C7": "checkpointing costs 20-30% more compute time",
    "C8": "batch 32 x 4 accumulation steps peaks only about 10% above batch 32",
    "C9": "INT8 BERT loses under 0.5% accuracy",
    "C10": "on MI250X, 2:4 sparsity gives 1.6x speed and halves memory",
    "C11": "2-way tensor parallelism takes a GPT-3 layer's memory from 350 GB to 175 GB",
    "C12": "sequence parallelism saves 40% memory on T5-XXL at sequence length 1024",
    "C13": "its tensor-parallel sample (input chunked per rank, the local output repeated world-size times) "
           "computes a column-parallel layer",
    "C14": "strategy by size: <1B mixed precision + checkpointing; 1-10B tensor parallelism + quantisation; "
           ">10B 3D parallelism",
    "C15": "for training an A100 80GB beats an H100 80GB; for inference a T4 is better value than an A10",
    "C16": "sharing and mixed precision alone solve about 80% of memory problems",
}


def _numbers(frame: pd.DataFrame, column: str) -> pd.Series:
    return pd.to_numeric(frame[column], errors="coerce").astype(float) if column in frame else \
        pd.Series(float("nan"), index=frame.index)


def single_gpu_cells(frame: pd.DataFrame, capacities: dict, twins: bool = False) -> pd.DataFrame:
    """Single-device rows on GPU profiles, measured rows replacing projected twins unless `twins`
    (reports/cells.py)."""
    from reports.cells import gpu_cells

    return gpu_cells(frame, capacities, single_device=True, twins=twins)


def _pairs(rows: pd.DataFrame, technique: str, against: str = "baseline") -> pd.DataFrame:
    """`technique` rows joined with the `against` row of the same workload, size, mode, GPU and batch."""
    key = ["workload", "size", "mode", "gpu", "batch_size", "source"]
    left = rows[rows["technique"] == technique]
    right = rows[rows["technique"] == against]
    return left.merge(right, on=key, suffixes=("", "_ref"))


def _prefer(pairs: pd.DataFrame) -> pd.DataFrame:
    """Measured pairs where there are; else the pairs on the first preferred GPU present."""
    if not len(pairs):
        return pairs
    measured = pairs[pairs["source"] == "measured"]
    if len(measured):
        return measured
    for gpu in PREFERRED_GPUS:
        if (pairs["gpu"] == gpu).any():
            return pairs[pairs["gpu"] == gpu]
    return pairs[pairs["gpu"] == pairs["gpu"].iloc[0]]


def _where(pairs: pd.DataFrame) -> str:
    sources = sorted(set(pairs["source"]))
    return (f"{len(pairs)} {'/'.join(sources)} pair{'s' if len(pairs) != 1 else ''} on "
            f"{', '.join(sorted(set(pairs['gpu'])))} ({', '.join(sorted(set(pairs['size'])))})")


def _sources(rows: pd.DataFrame) -> str:
    """`measured`, `projected` or `measured/projected`: what the figures of a judgement rest on."""
    return "/".join(sorted(set(rows["source"])))


def _measured_first(rows: pd.DataFrame) -> pd.DataFrame:
    """The measured rows where there are any, else all (projected): a median never mixes the two."""
    measured = rows[rows["source"] == "measured"]
    return measured if len(measured) else rows


def _judged(claim: str, found: str, rows: str, verdict: str) -> dict:
    return {"id": claim, "claim": CLAIMS[claim], "found": found, "rows": rows, "verdict": verdict}


VERDICTS = ("supported", "contradicted", "inconclusive", "consistent", "exceeded", "not measur", "no verdict")


def _from_text(claim: str, text: str | None, rows: str, missing: str) -> dict:
    """A verdict judged by another section: its text, and the verdict words that open its parts
    (`supported: ...`, or `ptq-int8: supported (...); qat-int8: ...` for one verdict per technique)."""
    if not text:
        return _judged(claim, missing, "none", "not measurable here")
    found = []
    for part in text.split("; "):
        head, _, rest = part.partition(": ")
        for candidate in (part, rest):
            word = next((w for w in VERDICTS if candidate.startswith(w)), None)
            if word:
                phrase = candidate.split(":")[0].split(" (")[0]
                found.append(phrase if candidate is part else f"{head}: {phrase}")
                break
    verdict = "; ".join(dict.fromkeys(found)) if found else text.split(":")[0]
    return _judged(claim, text, rows, verdict)


def judge_c2(rows: pd.DataFrame) -> dict:
    train = rows[(rows["mode"] == "train") & (rows["status"].isin(["ok", "oom"]))]
    plain = train[train["technique"].isin(["baseline", "amp-bf16", "amp-fp16"])]
    plain = _measured_first(plain[_numbers(plain, "param_count") > 0])
    if not len(plain):
        return _judged("C2", "no full-training rows with parameter counts", "none", "not measurable here")
    per_param = lambda frame, name: (_numbers(frame, name) / _numbers(frame, "param_count")).median()  # noqa: E731
    optimizer, params = per_param(plain, "optimizer_bytes"), per_param(plain, "params_bytes")
    found = f"AdamW holds {optimizer:.1f} B/param" + (" (two fp32 moments)" if abs(optimizer / 8 - 1) < 0.1 else "")
    found += f"; parameters take {params:.1f} B/param"
    mixed = plain[plain["technique"].str.startswith("amp")]
    verdict = "supported" if abs(optimizer / 16 - 1) < 0.1 else \
        f"contradicted: Adam's state is {16 / optimizer:.1f}x smaller than stated" if optimizer < 16 else \
        f"contradicted: Adam's state is {optimizer / 16:.1f}x larger than stated"
    if abs(optimizer / 16 - 1) >= 0.1:
        found += "; 16 B/param is the whole mixed-precision state (2 + 2 + 12 in the ZeRO paper's count), not Adam's"
    if len(mixed):
        held = per_param(mixed, "params_bytes")
        if held > 3:
            found += (f"; under mixed precision {held:.1f} B/param: fp32 master weights (2 B/param holds only where "
                      "the weights themselves are 16-bit, as served with bf16-weights)")
        verdict += "; FP16 parameters at 2 B/param: " + ("supported" if abs(held / 2 - 1) < 0.1 else
                                                         f"not in mixed-precision training ({held:.1f} B/param)")
    return _judged("C2", found, f"{len(plain)} {_sources(plain)} training rows (baseline, amp-*)", verdict)


def judge_c3(rows: pd.DataFrame) -> dict:
    big = rows[(rows["size"] == "gpt3-175b") & (rows["mode"] == "train")
               & rows["technique"].isin(["amp-bf16", "amp-fp16", "baseline"])]
    big = big[_numbers(big, "params_bytes") > 0]
    if not len(big):
        return _judged("C3", "no gpt3-175b training rows", "none",
                       "not measurable here: project it (headroom run --size gpt3-175b --gpu a100-sxm4-80gb)")
    row = big.sort_values("technique").iloc[0]
    number = lambda name: float(pd.to_numeric(row.get(name), errors="coerce"))  # noqa: E731  (NaN where unknown)
    batch, params, optimizer, activations = (number(n) for n in ("batch_size", "params_bytes", "optimizer_bytes",
                                                                "activations_bytes"))
    # Autocast keeps a 16-bit copy of every weight for the backward: activation memory that does not grow
    # with the batch (it is the intercept of activations against batch size), so it is not scaled.
    copies = 2 * number("param_count") if str(row["technique"]).startswith("amp-") else 0.0
    at_1024 = (activations - copies) * 1024 / batch + copies if batch > 0 else float("nan")
    found = (f"{row['technique']}: parameters {params / GB:,.0f} GB (fp32 master copy), "
             f"optimizer {optimizer / GB:,.0f} GB, gradients {number('grads_bytes') / GB:,.0f} GB; "
             f"activations {activations / GB:,.0f} GB at batch {batch:.0f}"
             + (f" ({copies / GB:,.0f} GB of them autocast's 16-bit weight copies, which do not grow with the batch)"
                if copies else "")
             + f", {at_1024 / GB / 1000:,.0f} TB scaled linearly to batch 1024 without checkpointing")
    # Each stated figure against the rows', within 10%: parameters 350 GB, optimizer 2,800 GB, activations
    # 500 GB at batch 1024, and the total above 3 TB.
    parts = {"parameters": (params, 350 * GB), "optimizer state": (optimizer, 2800 * GB),
             "activations at batch 1024": (at_1024, 500 * GB)}
    unknown = [name for name, (ours, _) in parts.items() if ours != ours]  # NaN: not in the row
    off = [f"{name} {_times(ours / stated)} the stated" for name, (ours, stated) in parts.items()
           if name not in unknown and abs(ours / stated - 1) > 0.1]
    verdict = ("supported" if not off else "contradicted: " + ", ".join(off)) + \
        (f"; {', '.join(unknown)} not measurable (not in the row)" if unknown else "")
    total = params + optimizer + number("grads_bytes") + at_1024
    if total == total:
        # The guide's "more than 3 TB in total" holds for any total above it; how far above says whether its
        # activation figure assumed checkpointing.
        verdict += (f"; the guide's 'more than 3 TB in total' holds: {total / 1e12:,.0f} TB here, "
                    f"{at_1024 / total:.0%} of it activations" if total > 3e12 else
                    f"; the guide's 'more than 3 TB in total' does not hold: {total / 1e12:,.1f} TB here")
    return _judged("C3", found, f"1 {row['source']} row ({row['technique']} on {row['gpu']})", verdict)


def _times(ratio: float) -> str:
    """A ratio to the precision it deserves: two figures below 10x, whole numbers above."""
    return f"{ratio:.2f}x" if ratio < 10 else f"{ratio:,.0f}x"


def judge_ratio(claim: str, rows: pd.DataFrame, workloads: tuple, technique: str, stated_memory: float | None,
                stated_speed: float | None, tolerance: float) -> dict:
    """Memory saved and step-time change of `technique` against baseline on the same cells."""
    pairs = _prefer(_pairs(rows[rows["workload"].isin(workloads) & (rows["mode"] == "train")
                                & (rows["status"] == "ok")], technique))
    if not len(pairs):
        return _judged(claim, f"no {technique} rows beside a baseline", "none",
                       f"not measurable here: run {technique} with baseline on {', '.join(workloads)}")
    saved = (1 - _numbers(pairs, "peak_reserved_bytes") / _numbers(pairs, "peak_reserved_bytes_ref")).median()
    slower = (_numbers(pairs, "step_time_ms_p50") / _numbers(pairs, "step_time_ms_p50_ref")).median()
    found = f"{technique} saves {saved:.0%} of peak reserved memory; step time x{slower:.2f} (median)"
    parts = []
    if stated_memory is not None:
        parts.append("memory " + ("as stated" if abs(saved - stated_memory) <= tolerance
                                  else f"{saved:.0%} against {stated_memory:.0%}"))
    if stated_speed is not None:
        parts.append("speed " + ("as stated" if abs(slower - stated_speed) <= tolerance * stated_speed
                                 else f"x{slower:.2f} against x{stated_speed:.2f}"))
    matched = ["as stated" in p for p in parts]
    verdict = "supported" if all(matched) else \
        ("partly supported: " if any(matched) else "contradicted: ") + ", ".join(parts)
    if "measured" not in set(pairs["source"]):  # a projection's verdict: its step times carry wide intervals
        verdict += " (projected only)"
    return _judged(claim, found, _where(pairs), verdict)


def judge_c8(rows: pd.DataFrame) -> dict:
    accum = rows[(rows["technique"] == "grad-accumulation") & (rows["status"] == "ok")]
    base = rows[(rows["technique"] == "baseline") & (rows["status"] == "ok")]
    matches, sources = [], set()
    for _, row in accum.iterrows():
        micro = float(row["batch_size"]) / DEFAULT_MICRO_BATCHES
        same = base[(base["workload"] == row["workload"]) & (base["size"] == row["size"])
                    & (base["mode"] == row["mode"]) & (base["source"] == row["source"])
                    & (base["gpu"] == row["gpu"]) & (_numbers(base, "batch_size") == micro)]
        if len(same):
            matches.append(float(row["peak_reserved_bytes"]) / float(same.iloc[0]["peak_reserved_bytes"]) - 1)
            sources.add(row["source"])
    if not matches:
        return _judged("C8", "no baseline row at the accumulation's micro-batch beside a grad-accumulation row", "none",
                       "not measurable here: run baseline at a quarter of the batch beside grad-accumulation "
                       "(--batch-size)")
    growth = pd.Series(matches).median()
    verdict = "supported" if growth <= 0.15 else f"contradicted: peak grows {growth:.0%}, not 10%"
    return _judged("C8", f"peak {growth:+.0%} over the micro-batch alone (median of {len(matches)})",
                   f"{len(matches)} {'/'.join(sorted(sources))} pairs", verdict)


def judge_c10(rows: pd.DataFrame) -> dict:
    pairs = _pairs(rows[rows["status"] == "ok"], "sparsity-2to4")
    on_mi250x = pairs[pairs["gpu"] == "mi250x"]
    if not len(on_mi250x):
        # Projected MI250X rows may be in the report (fit matrices), but none pairs sparsity-2to4 with a baseline.
        found = ("no sparsity-2to4 row beside a baseline on the MI250X: its 2:4 sparse throughput is unverified "
                 "(gpu_profiles/mi250x.toml has none)")
        if len(pairs):
            pairs = _prefer(pairs)
            speed = (_numbers(pairs, "step_time_ms_p50_ref") / _numbers(pairs, "step_time_ms_p50")).median()
            memory = (_numbers(pairs, "peak_reserved_bytes") / _numbers(pairs, "peak_reserved_bytes_ref")).median()
            found += f"; elsewhere sparsity-2to4 runs x{speed:.2f} as fast in x{memory:.2f} the memory"
            return _judged("C10", found, _where(pairs), "not measurable here: no MI250X pair")
        return _judged("C10", found, "none", "not measurable here: no sparsity-2to4 rows")
    return judge_ratio("C10", rows[rows["gpu"] == "mi250x"], tuple(set(on_mi250x["workload"])), "sparsity-2to4",
                       0.5, 1 / 1.6, 0.1)


# Two GPUs within 5% of each other are a tie: less than a projection's error (ledger intervals) and than
# run-to-run spread.
C15_TIE = 0.05


def judge_c15(rows: pd.DataFrame) -> dict:
    ok = rows[rows["status"] == "ok"]
    parts, verdicts, sources = [], [], set()
    for mode, first, second, guide in (("train", "a100-sxm4-80gb", "h100-sxm", "A100 80GB better"),
                                       ("infer", "t4", "a10", "T4 better value")):  # guide: `first` is better
        a = ok[(ok["mode"] == mode) & (ok["gpu"] == first)]
        b = ok[(ok["mode"] == mode) & (ok["gpu"] == second)]
        # Like with like: measured on both GPUs where both were measured, else projected on both.
        joined = _measured_first(a.merge(b, on=["workload", "size", "technique", "batch_size", "source"],
                                         suffixes=("", "_other")))
        if not len(joined):
            parts.append(f"{mode}: no rows of one source on both {first} and {second}")
            continue
        sources.add(joined["source"].iloc[0])
        speed = (_numbers(joined, "throughput_samples_s_other")
                 / _numbers(joined, "throughput_samples_s")).median()
        cost = (_numbers(joined, "usd_per_million_samples_other")
                / _numbers(joined, "usd_per_million_samples")).median()
        parts.append(f"{mode}: {second} runs x{speed:.2f} as fast as {first} at x{cost:.2f} its cost per sample "
                     f"(median of {len(joined)} {joined['source'].iloc[0]} cells)")
        # Training is judged on speed, serving on cost per sample: `second`'s figure over `first`'s.
        ratio, gain = (cost, "better value") if mode == "infer" else (1 / speed, "faster")
        if not ratio == ratio or ratio in (0, float("inf")):  # a GPU without a price or a throughput
            verdicts.append(f"{mode}: not measurable (no {'cost' if mode == 'infer' else 'speed'} on both GPUs)")
        elif abs(ratio - 1) <= C15_TIE:
            verdicts.append(f"{mode}: neither (within {C15_TIE:.0%}; guide: {guide})")
        else:
            winner = first if ratio > 1 else second
            verdicts.append(f"{mode} {'supported' if winner == first else 'contradicted'}: {winner} {gain} "
                            f"(guide: {guide})")
    return _judged("C15", "; ".join(parts), f"{'/'.join(sorted(sources)) or 'no'} cells on both GPUs",
                   "; ".join(verdicts) or "not measurable here")


def judge_c16(rows: pd.DataFrame) -> dict:
    """Of the baseline training cells that do not fit but that some tried stack makes fit (a memory
    problem these rows solve) and on which mixed precision or sharing was tried alone, the share that alone
    solves (same batch, same source). A cell where neither was tried alone is no evidence either way."""
    train = rows[rows["mode"] == "train"]
    short = train[(train["technique"] == "baseline") & (train["status"] == "oom")]
    simple = {"amp-bf16", "amp-fp16", "param-sharing"}
    solvable, solved, untried = 0, 0, 0
    for _, row in short.iterrows():
        same = train[(train["workload"] == row["workload"]) & (train["size"] == row["size"])
                     & (train["gpu"] == row["gpu"]) & (train["source"] == row["source"])
                     & (train["batch_size"] == row["batch_size"])]
        # Tried alone means it ran: an unsupported or failed stack (no bf16 on a T4) says nothing of it.
        simple_only = pd.Series([set(str(t).split("+")) <= simple for t in same["technique"]], index=same.index)
        alone = same[simple_only & same["status"].isin(["ok", "oom"])]
        if not (same["status"] == "ok").any():
            continue
        if alone.empty:
            untried += 1
            continue
        solvable += 1
        solved += bool((alone["status"] == "ok").any())
    if not solvable:
        found = f"{len(short)} baseline training cells run out of memory and " + (
            f"{untried} of them fit under a tried stack, but mixed precision (amp-bf16 or amp-fp16) or param-sharing "
            "was not tried alone on any: add one of them to --technique" if untried else
            "no stack in these rows makes one fit")
        return _judged("C16", found, f"{len(short)} OOM baseline cells", "not measurable here")
    share = solved / solvable
    sharing = "param-sharing" in set(train["technique"])
    # A share of a handful of cells is uncertain: its 95% interval (Clopper-Pearson, which errs wide) says
    # whether 80% is ruled out.
    low, high = binomtest(solved, solvable).proportion_ci(method="exact")
    if abs(share - 0.8) <= 0.1:
        verdict = "supported"
    elif low <= 0.8 <= high:
        verdict = f"inconclusive: {share:.0%} of {solvable} cells (95% interval {low:.0%}-{high:.0%}, 80% inside)"
    else:
        verdict = f"contradicted: {share:.0%} of {solvable} cells (95% interval {low:.0%}-{high:.0%}), not 80%"
    verdict += "" if sharing else " (without param-sharing rows: mixed precision alone)"
    return _judged("C16", f"of {solvable} out-of-memory baseline training cells that some tried stack makes fit and "
                          f"on which mixed precision or sharing was tried alone, that alone makes {solved} fit "
                          f"({share:.0%}); {len(short) - solvable - untried} more do not fit under any stack tried"
                          + (f", {untried} had neither tried alone" if untried else ""),
                   f"{len(short)} OOM baseline cells", verdict)


def judge_claims(frame: pd.DataFrame, capacities: dict, c1: str | None = None, c4: str | None = None,
                 c6: str | None = None, c9: str | None = None) -> list[dict]:
    """Every claim C1-C16 with its finding and verdict, in order."""
    rows = single_gpu_cells(frame, capacities) if len(frame) else frame
    tiny = not len(rows)
    # C15 compares GPUs like with like, so it keeps the projected twins the measured rows replace in `rows`.
    with_twins = single_gpu_cells(frame, capacities, twins=True) if not tiny else rows
    multi_gpu = frame[_numbers(frame, "world_size") > 1] if len(frame) else frame
    if "rank" in multi_gpu:
        multi_gpu = multi_gpu[multi_gpu["rank"].isna()]
    from reports.claims_parallel import judge_c11, judge_c12, judge_c13, judge_c14  # they use this module's helpers

    judged = [
        _from_text("C1", c1, "the serving matrix", "no serving matrix in these results (headroom serve-matrix)"),
        judge_c2(rows) if not tiny else None,
        judge_c3(rows) if not tiny else None,
        _from_text("C4", c4, "the fragmentation probe", "no fragmentation probe in these results "
                                                        "(headroom fragmentation)"),
        judge_ratio("C5", rows, ("resnet50",), "amp-fp16", 0.40, 1 / 1.5, 0.1) if not tiny else None,
        _from_text("C6", c6, "accuracy.csv", "no accuracy rows (headroom run --accuracy)"),
        judge_ratio("C7", rows, ("bert", "gpt"), "checkpointing", None, 1.25, 0.05 / 1.25) if not tiny else None,
        judge_c8(rows) if not tiny else None,
        _from_text("C9", c9, "accuracy.csv", "no accuracy rows (headroom run --accuracy)"),
        judge_c10(rows) if not tiny else None,
        judge_c11(frame),
        judge_c12(),
        judge_c13(),
        judge_c14(rows, len(multi_gpu)) if not tiny else None,
        judge_c15(with_twins) if not tiny else None,
        judge_c16(rows) if not tiny else None,
    ]
    ids = list(CLAIMS)
    return [claim or _judged(ids[index], "no GPU rows in these results", "none", "not measurable here")
            for index, claim in enumerate(judged)]
