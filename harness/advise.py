"""OOM advice: when a cell does not fit, the stacks that make it fit, ranked by the step time they
cost; when it fits, the largest batch and the GPUs on which it still fits for less (by the hour, or per
sample at the largest batch each GPU holds).

Memory left is the device's visible memory less the peak the caching allocator reserves and what
lives outside it (the CUDA context), the same test the projection's `fits` applies. The report ranks
stacks found in its rows the same way (`rank_fixes`).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed

import pandas as pd

from suites.techniques.accumulation import DEFAULT_MICRO_BATCHES

GIB = 2**30

# Stacks tried for a cell that does not fit, cheapest in engineering first. Full fine-tuning keeps the
# model and its training (cpu-offload: FSDP2's offload policy on one GPU, projected as a world of one, --dp 1,
# its parameters, gradients and optimizer state in host memory); the adapter stacks train less of it, and the
# advice says so. Where none fits, each is tried again in micro-batches (+grad-accumulation).
TRAIN_STACKS = ("amp-bf16", "amp-fp16", "checkpointing", "amp-bf16+checkpointing",
                "amp-bf16+selective-checkpointing", "amp-bf16+grad-accumulation", "amp-bf16+optim-8bit",
                "amp-bf16+checkpointing+optim-8bit", "amp-bf16+checkpointing+optim-4bit",
                "amp-bf16+checkpointing+optim-offload", "cpu-offload+amp-bf16+checkpointing",
                "lora+amp-bf16+checkpointing",
                "qlora+amp-bf16+checkpointing")  # QLoRA computes in bf16 (Dettmers et al. 2023), as LoRA here does
INFER_STACKS = ("bf16-weights", "fp16-weights", "bf16-weights+kv-int8", "bf16-weights+group-quant",
                "bf16-weights+group-quant-int4", "bf16-weights+group-quant-int4+kv-int8")
CHANGES_TRAINING = {"lora": "trains adapters only", "qlora": "trains adapters on 4-bit frozen weights",
                    "grad-accumulation": f"same global batch in {DEFAULT_MICRO_BATCHES} micro-batches",
                    "cpu-offload": "FSDP2 on one GPU, --dp 1: parameters and optimizer state in host memory"}


def memory_left(reserved, overhead, capacity, allocated=None, fits=None) -> float | None:
    """Bytes left on the device at the cell's peak (negative: short by), None where unknown. A cell the
    projection says fits although its reserved peak does not (the caching allocator frees its cache and
    retries: harness/project/memory.py) has what its live bytes leave."""
    values = [pd.to_numeric(v, errors="coerce") for v in (reserved, overhead, capacity, allocated)]
    if pd.isna(values[0]) or pd.isna(values[2]):
        return None
    room = float(values[2]) - (0.0 if pd.isna(values[1]) else float(values[1]))
    left = room - float(values[0])
    if left < 0 and fits is True and not pd.isna(values[3]):
        return room - float(values[3])
    return left


def row_memory_left(row, capacity) -> float | None:
    """`memory_left` of a results row (a dict or a pandas row; `fits` may be missing or NA)."""
    fits = row.get("fits")
    fits = None if fits is None or pd.isna(fits) else bool(fits)
    return memory_left(row.get("peak_reserved_bytes"), row.get("device_overhead_bytes"), capacity,
                       row.get("peak_allocated_bytes"), fits)


def row_memory_left_worst(row, capacity) -> float | None:
    """Bytes left at the high end of a projected row's reserved-memory interval (harness/ledger.py): what
    `row_memory_left` leaves, less the interval's reach above the projected reserved figure; None where
    either is unknown (a measured row has no interval). Below zero, a cell projected to fit may not."""
    left = row_memory_left(row, capacity)
    high, reserved = (pd.to_numeric(row.get(k), errors="coerce") for k in ("peak_reserved_high_bytes",
                                                                           "peak_reserved_bytes"))
    if left is None or pd.isna(high) or pd.isna(reserved):
        return None
    return left - max(0.0, float(high) - float(reserved))


def gib(value: float, signed: bool = False) -> str:
    return f"{value / GIB:{'+' if signed else ''},.1f} GiB"


def fix_line(stack: str, target: dict, fix: dict, reference: float | None = None) -> str:
    """`amp-bf16+checkpointing (projected): reserves 41.0 GiB less, +28% step time, fits with 6.0 GiB left`; the fix's
    `source` (measured or projected) is named wherever the fix carries one."""
    parts = [stack + (f" ({fix['source']})" if fix.get("source") else "") + ":"]
    if target.get("reserved") is not None and fix.get("reserved") is not None:
        change = fix["reserved"] - target["reserved"]
        parts.append(f"reserves {gib(abs(change))} {'less' if change < 0 else 'more'},")
    if target.get("step_ms") and fix.get("step_ms"):
        parts.append(f"{fix['step_ms'] / target['step_ms'] - 1:+.0%} step time,")
    elif fix.get("step_ms") and reference:
        # A cell that does not fit has no step time of its own: compare with the fastest fix instead.
        versus = "the fastest" if fix["step_ms"] == reference else \
            f"{fix['step_ms'] / reference - 1:+.0%} vs the fastest"
        parts.append(f"{fix['step_ms']:,.0f} ms per step ({versus}),")
    elif fix.get("step_ms"):
        parts.append(f"{fix['step_ms']:,.0f} ms per step,")
    if fix.get("tokens_s"):  # a served cell: what serving is priced on, as the tensor-parallel line says it
        usd = f", ${fix['usd_tokens']:,.2f} per million tokens" if fix.get("usd_tokens") else ""
        parts.append(f"{fix['tokens_s']:,.1f} generated tokens/s{usd},")
    parts.append(f"fits with {gib(fix['left'])} left" + uncertain_fit(fix.get("worst"))
                 + (RETRYING if fix.get("retrying") else ""))
    notes = [note for name, note in CHANGES_TRAINING.items() if name in [t.partition(":")[0] for t in stack.split("+")]]
    kept = f"kept from yours: {', '.join(fix['kept'])}" if fix.get("kept") else ""
    notes += [kept] if kept else []
    return " ".join(parts) + (f" ({'; '.join(notes)})" if notes else "")


# What a fit that holds only through the caching allocator's cache-freeing retries adds to "fits".
RETRYING = (", and only by the allocator freeing its cache and retrying every step (slow; a smaller batch, "
            "--max-batch, avoids it)")


def uncertain_fit(worst: float | None) -> str:
    """What to add to "fits" when the high end of the projection's reserved-memory interval does not fit."""
    return "" if worst is None or worst >= 0 else \
        f", but may not: short by {gib(-worst)} at its error bar's high end"


def rank_fixes(target: dict, fixes: list[dict]) -> list[str]:
    """The fixes that fit, fastest first (memory left breaks ties), as advice lines; those whose reserved-memory
    interval reaches past the card (`worst` < 0), or that fit only by the allocator's retries, after every one
    that fits surely. Each dict: stack, reserved, step_ms, left, optionally worst (bytes left at the interval's
    high end), retrying, tokens_s and usd_tokens (a served cell's), kept (techniques kept from the asked stack)."""
    fitting = [fix for fix in fixes if fix.get("left") is not None and fix["left"] >= 0]
    fitting.sort(key=lambda f: ((f.get("worst") or 0) < 0 or bool(f.get("retrying")),
                                f["step_ms"] if f.get("step_ms") else float("inf"), -f["left"]))
    steps = [fix["step_ms"] for fix in fitting if fix.get("step_ms")]
    reference = min(steps) if steps else None
    return [fix_line(fix["stack"], target, fix, reference) for fix in fitting]


def _project_one(request, profiles):
    from harness.project.query import projected_rows

    return projected_rows(request, profiles)[0]


def project_all(requests: list, profiles, progress: Callable[[str], None], workers: int | None = None) -> list:
    """The projected row of each request, in order. Each is seconds of tracing on one core and they are
    independent, so they run in parallel processes (spawned: a forked child of a process whose torch has
    started its thread pools can hang), one per core; `workers=1` runs them here, one after another."""
    # The cores this process may use (a container's cpuset), not the host's count.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    workers = min(len(requests), workers or cores or 1)
    label = [f"{r.technique} on {r.gpu}" + (" (largest batch)" if r.max_batch else "") for r in requests]
    if workers <= 1:
        results = []
        for request, name in zip(requests, label, strict=True):
            progress(f"projecting {name}")
            results.append(_project_one(request, profiles))
        return results
    progress(f"projecting {len(requests)} cells in {workers} processes")
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(_project_one, request, profiles): name for request, name in zip(requests, label,
                                                                                               strict=True)}
        for done, future in enumerate(as_completed(futures), 1):
            progress(f"{done}/{len(requests)}: projected {futures[future]}")
        return [future.result() for future in futures]


def memory_row(record) -> dict:
    """The memory fields of a projected record that `row_memory_left_worst` reads."""
    return {key: getattr(record, key, None) for key in ("peak_reserved_bytes", "peak_reserved_high_bytes",
                                                       "device_overhead_bytes", "peak_allocated_bytes", "fits")}


def _summary(record, capacity) -> dict:
    row = memory_row(record)
    left = row_memory_left(row, capacity)
    # Fits by its live bytes though its reserved peak does not: the allocator frees its cache and retries.
    plain = memory_left(record.peak_reserved_bytes, record.device_overhead_bytes, capacity)
    return {"stack": record.technique, "reserved": record.peak_reserved_bytes, "step_ms": record.step_time_ms_p50,
            "left": left, "worst": row_memory_left_worst(row, capacity),
            "retrying": left is not None and left >= 0 and plain is not None and plain < 0,
            "status": record.status, "reason": record.reason, "batch": record.batch_size,
            "usd": record.usd_per_million_samples,
            **({"tokens_s": record.tokens_per_s, "usd_tokens": record.usd_per_million_tokens}
               if record.gen_len and record.mode == "infer" else {})}


def built_on(candidate: str, asked: str) -> tuple[str, list[str]]:
    """`candidate` with the asked stack's techniques it neither holds nor replaces (one of an exclusive group the
    candidate uses): `+compile` or `+optim-fused` stay in every suggestion; the stack's canonical name and
    what was kept. The candidate alone where the two do not stack."""
    from suites.techniques import parse_stack

    mine = parse_stack(candidate).techniques
    held = {t.id.partition(":")[0] for t in mine}
    groups = {t.exclusive for t in mine if t.exclusive}
    kept = [t.id for t in parse_stack(asked).techniques
            if t.id.partition(":")[0] not in held and (t.exclusive is None or t.exclusive not in groups)]
    try:
        return parse_stack("+".join([candidate, *kept])).name, kept
    except ValueError:
        return parse_stack(candidate).name, []


@dataclasses.dataclass
class Advice:
    gpu: str
    target: dict
    lines: list[str]  # what to do, best first
    headline: str


def advise(request, profiles, progress: Callable[[str], None] = lambda _: None, workers: int | None = None) -> Advice:
    """Project `request` (harness/project/query.py ProjectRequest, one GPU) and the advice for it; the stacks
    and GPUs it tries are projected in `workers` processes (default: one per core)."""
    from harness.profiles import resolve_gpus

    # An exact id wins over a family of the same name (`h200` is the SXM's id and the family of two).
    chosen = [profiles[request.gpu]] if request.gpu in profiles else resolve_gpus([request.gpu], profiles)
    if len(chosen) != 1:
        raise ValueError(f"advise answers for one GPU; {request.gpu!r} names {len(chosen)}: "
                         + ", ".join(p.id for p in chosen))
    profile = chosen[0]
    capacity = profile.per_device().capacity_bytes
    if profile.vendor == "cpu" or not capacity:
        raise ValueError(f"advise fits a model in a GPU's memory; {profile.id} has no memory size: pick a GPU profile")
    from suites.techniques import parse_stack

    if parse_stack(request.technique).parallel:
        count = "--tp N projects a group of N" if request.mode == "infer" else "--min-gpus counts how many it needs"
        raise ValueError(f"advise answers for one GPU; {request.technique} runs on several: headroom project "
                         f"--technique {request.technique} --gpu {profile.id} {count}")
    request = dataclasses.replace(request, gpu=profile.id)

    def project_each(changes: list[dict]) -> list:
        return project_all([dataclasses.replace(request, **c) for c in changes], profiles, progress, workers)

    def project(**changes):
        return project_each([changes])[0]

    record = project()
    if record.status not in ("ok", "oom"):
        raise ValueError(f"{request.technique} on {profile.id}: {record.status}: {record.reason}")
    target = _summary(record, capacity)
    if record.status == "oom" or (target["left"] is not None and target["left"] < 0):
        stacks, fixes = _tried_fixes(request, profile, capacity, project_each)
        lines = rank_fixes(target, [f for f in fixes if f["status"] == "ok"])
        unsupported = [f for f in fixes if f["status"] == "unsupported"]
        skipped = (f" ({len(unsupported)} unsupported on {profile.id}: "
                   + "; ".join(f["reason"] for f in unsupported) + ")") if unsupported else ""
        short = gib(-target["left"]) if target["left"] is not None else "unknown"
        smaller = None
        if not lines and not request.max_batch:  # none fits at this batch: does a smaller one?
            largest = project(max_batch=True, batch_size=None)
            if largest.status == "ok" and largest.batch_size and largest.batch_size < record.batch_size:
                smaller = largest.batch_size
                lines = [f"a smaller batch fits: at most {smaller} with {request.technique} (asked "
                         f"{record.batch_size}), {largest.throughput_samples_s or 0:,.1f} samples/s"]
        served = record.gen_len is not None and request.mode == "infer"
        several = "several (serving over a tensor-parallel group, below)" if served else \
            "several (headroom project --min-gpus)"
        headline = (f"projected: {request.technique} does not fit on {profile.id}: short by {short}; "
                    + (f"{len(lines)} of {len(stacks)} stacks tried make it fit{skipped} (fastest first; those that "
                       "may not fit, or fit only by the allocator's retries, last)" if lines and not smaller else
                       f"none of the {len(stacks)} stacks tried makes it fit{skipped}: "
                       + ("a smaller batch, " if smaller else "")
                       + f"a larger GPU or {several} is needed"))
        group = _served_over_a_group(request, profile, project_each, capacity) if served else []
        return Advice(profile.id, target, lines + group + _decode_mode(request, record), headline)
    speed = f", {record.step_time_ms_p50:,.0f} ms per step" if record.step_time_ms_p50 else ""
    if record.step_time_ms_p50 and record.step_time_ms_low and record.step_time_ms_high:
        speed += f" ({record.step_time_ms_low:,.0f} to {record.step_time_ms_high:,.0f} across its error bar)"
    cost = f", ${record.usd_per_million_samples:,.2f} per million samples" if record.usd_per_million_samples else ""
    return Advice(profile.id, target,
                  _when_it_fits(request, record, profile, profiles, project_each, capacity)
                  + _decode_mode(request, record),
                  f"projected: {request.technique} fits on {profile.id} with {gib(target['left'])} left"
                  f"{uncertain_fit(target['worst'])}{RETRYING if target['retrying'] else ''}{speed}{cost}")


def _tried_fixes(request, profile, capacity, project_each) -> tuple[list[str], list[dict]]:
    """The stacks tried for a cell that does not fit and their summaries: the candidates built on the asked
    stack, then, in training where none fits, each in micro-batches (+grad-accumulation). A parallel stack among
    them (cpu-offload) is projected as a world of one."""
    from suites.techniques import parse_stack

    asked = parse_stack(request.technique).name
    stacks, fixes = [], []
    rounds = [candidate_stacks(request.mode, profile)]
    if request.mode == "train":
        rounds.append([f"{s}+grad-accumulation" for s in rounds[0] if "grad-accumulation" not in s.split("+")])
    for candidates in rounds:
        built = {}
        for candidate in candidates:
            stack, kept = built_on(candidate, request.technique)
            if stack != asked and stack not in stacks:
                built[stack] = kept
        changes = [{"technique": s, **({"dp": 1} if parse_stack(s).parallel else {})} for s in built]
        for kept, result in zip(built.values(), project_each(changes), strict=True):
            fixes.append({**_summary(result, capacity), "kept": kept})
        stacks += list(built)
        if any(f["status"] == "ok" and f["left"] is not None and f["left"] >= 0 for f in fixes):
            break
    return stacks, fixes


# Tensor-parallel groups tried for a served model that one GPU cannot hold: within one 8-GPU node.
SERVING_GROUPS = (2, 4, 8)


def _served_over_a_group(request, profile, project_each, capacity) -> list[str]:
    """The smallest tensor-parallel group of `profile` GPUs that serves the asked stack (each rank holding 1/t
    of the weights and KV cache, harness/project/served_parallel.py), with its speed and cost; a line saying
    none does where even 8 do not."""
    stack = "tensor-parallel" + ("" if request.technique == "baseline" else f"+{request.technique}")
    results = project_each([{"technique": stack, "tp": t} for t in SERVING_GROUPS])
    for ranks, result in zip(SERVING_GROUPS, results, strict=True):
        left = row_memory_left(memory_row(result), capacity)
        if result.status == "ok" and left is not None and left >= 0:
            speed = f", {result.tokens_per_s:,.1f} generated tokens/s" if result.tokens_per_s else ""
            cost = f", ${result.usd_per_million_tokens:,.2f} per million tokens at {ranks} GPUs' price" \
                if result.usd_per_million_tokens else ""
            return [f"{ranks} GPUs serve it: --technique {stack} --tp {ranks} holds 1/{ranks} of the weights and "
                    f"cache on each {profile.id}, {gib(left)} left per GPU{speed}{cost} (the collectives at NCCL's "
                    "latency model, not fitted: benchmarks/tp_decode_validation.py)"]
    why = [f"{ranks}: {result.reason}" for ranks, result in zip(SERVING_GROUPS, results, strict=True)
           if result.status == "unsupported"]
    groups = ", ".join(str(t) for t in SERVING_GROUPS[:-1]) + f" or {SERVING_GROUPS[-1]}"
    return [f"no tensor-parallel group of {groups} {profile.id} GPUs serves {request.technique} at this batch and "
            "context" + (f" ({'; '.join(why)})" if why else "")]


def _decode_mode(request, record) -> list[str]:
    """For a served decoder's cells: which decode the step times are, since servers run a compiled one."""
    if not record.gen_len or "compile" in request.technique.split("+"):
        return []
    return ["step times are eager decode (each token's ops issued from Python); servers replay a compiled one as "
            "CUDA graphs: add +compile to the stack, or see headroom serve-matrix, for that speed"]


def candidate_stacks(mode: str, profile) -> list[str]:
    """The stacks to try on `profile`: in fp16 where it has no bf16 (T4, V100), as people run them there."""
    stacks = TRAIN_STACKS if mode == "train" else INFER_STACKS
    if not profile.has("bf16"):
        stacks = [s.replace("amp-bf16", "amp-fp16").replace("bf16-weights", "fp16-weights") for s in stacks]
    return list(dict.fromkeys(stacks))


def _when_it_fits(request, record, profile, profiles, project_each, capacity) -> list[str]:
    """What a fitting cell could do instead: the largest batch here, and GPUs that still hold it cheaper by
    the hour or per sample. Per sample, each GPU is compared at the largest batch it holds (as a buyer would
    run it), the asked batch where none larger fits or where --max-batch already asked for the largest."""
    lines = []
    mine = record.usd_per_million_samples
    if not request.max_batch:
        (largest,) = project_each([{"max_batch": True, "batch_size": None}])
        if largest.status == "ok" and largest.batch_size and largest.batch_size > record.batch_size:
            cost = f", ${largest.usd_per_million_samples:,.2f} per million samples" \
                if largest.usd_per_million_samples else ""
            lines.append(f"a larger batch fits: up to {largest.batch_size} (now {record.batch_size}), "
                         f"{largest.throughput_samples_s or 0:,.1f} samples/s{cost}")
            mine = _cheapest(mine, largest.usd_per_million_samples)
        elif largest.status == "ok" and largest.batch_size and largest.batch_size < record.batch_size:
            # Fits only through the allocator's retries: the largest batch that runs without them.
            lines.append(f"without the allocator's retries: batch {largest.batch_size} at most (now "
                         f"{record.batch_size}), {largest.throughput_samples_s or 0:,.1f} samples/s")
    price = profile.per_device().usd_per_hour
    if price is None:
        lines.append(f"no price is known for {profile.id}: which GPU is cheaper cannot be said "
                     "(headroom advise --prices FILE.csv compares at yours)")
        return lines
    needed = (record.peak_reserved_bytes or 0) + (record.device_overhead_bytes or 0)
    # Every priced GPU that could hold it: a dearer one by the hour can be cheaper per sample when it is faster.
    others = [p for p in profiles.values() if p.id != profile.id and p.vendor != "cpu" and p.usd_per_hour
              and (p.per_device().capacity_bytes or 0) >= needed * 0.95]
    found, holding = [], []
    for other, result in zip(others, project_each([{"gpu": other.id} for other in others]), strict=True):
        row, other_capacity = memory_row(result), other.per_device().capacity_bytes
        left = row_memory_left(row, other_capacity)
        if result.status == "ok" and left is not None and left >= 0:
            holding.append((other, result, left, row_memory_left_worst(row, other_capacity)))
    largest = [None] * len(holding) if request.max_batch else project_each(
        [{"gpu": other.id, "max_batch": True, "batch_size": None} for other, *_ in holding])
    for (other, result, left, worst), larger in zip(holding, largest, strict=True):
        if not (larger and larger.status == "ok" and larger.batch_size
                and larger.batch_size > result.batch_size and larger.usd_per_million_samples):
            larger = None
        best = _cheapest(result.usd_per_million_samples, larger.usd_per_million_samples if larger else None)
        found.append((best if best is not None else float("inf"), other, result, left, worst, larger))
    # Ranked, and said, per sample: cheaper by the hour is not cheaper per sample when it is slower, and a
    # dearer GPU by the hour is worth naming only where it is cheaper per sample.
    named = 0
    for best, other, result, left, worst, larger in sorted(found, key=lambda item: item[0]):
        hourly = other.per_device().usd_per_hour
        per_sample = mine and best != float("inf") and best < mine
        if hourly >= price and not per_sample:
            continue
        verdict = "" if not mine or best == float("inf") else \
            (" (cheaper per sample too)" if per_sample and hourly < price else
             " (dearer by the hour, cheaper per sample)" if per_sample else " (dearer per sample)")
        step = f", {result.step_time_ms_p50:,.0f} ms per step" if result.step_time_ms_p50 else ""
        usd = result.usd_per_million_samples
        cost = f", ${usd:,.2f} per million samples" if usd else ""
        if larger:
            cost += f"; up to batch {larger.batch_size}: ${larger.usd_per_million_samples:,.2f}"
        lines.append(f"{'a cheaper' if hourly < price else 'another'} GPU holds it: {other.id} (${hourly:,.2f}/h, "
                     f"{other.price_date}) at batch {result.batch_size} with {gib(left)} left{uncertain_fit(worst)}"
                     f"{step}{cost}{verdict}")
        named += 1
    if named and mine:
        lines.append(f"per sample, each GPU is compared at the largest batch it holds (here ${mine:,.2f} per million "
                     "samples); cheaper or dearer by the hour at the prices shown")
    if not lines:
        lines.append(f"no larger batch and no cheaper GPU profile with a price holds {request.technique}")
    return lines


def _cheapest(*costs) -> float | None:
    """The lowest of the known costs, None where none is known."""
    known = [cost for cost in costs if cost]
    return min(known) if known else None
