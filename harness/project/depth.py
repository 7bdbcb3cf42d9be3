"""Depth extrapolation: a deep model of identical blocks is traced at two small depths and projected to
its own, since memory, FLOPs and bytes are affine in the number of identical layers. GPT-3 175B thus
projects in about a second. The workload names its depth key (Traits.depth_key).
"""

from __future__ import annotations

import re
from dataclasses import astuple

from harness.cell import ResolvedCell
from harness.project.op_costs import OpShape
from harness.project.trace import BACKWARD_MIDDLE, StepTrace, traced
from suites.techniques.offload import HostTraffic

# Models deeper than this are traced at TRACE_DEPTHS layers and extrapolated.
EXTRAPOLATE_ABOVE = 4
TRACE_DEPTHS = (2, 3)


def traced_to_depth(cell: ResolvedCell, profile, depths: tuple[int, ...] = ()) -> tuple[StepTrace, StepTrace,
                                                                                       tuple[int, ...]]:
    """(the cell's step trace, the trace whose allocation log stands for it, the depths extrapolated
    from): traced whole, or at TRACE_DEPTHS and extrapolated to the cell's depth. `depths`: extrapolate from
    these (another batch's), so that two batches' logs line up event for event (batch_model.py)."""
    depth = cell.workload.depth(cell.spec)
    if depth is None or depth <= EXTRAPOLATE_ABOVE:
        trace = traced(cell, profile)
        return trace, trace, ()
    low, high = depths or TRACE_DEPTHS
    trace_low = traced(cell.with_spec(cell.workload.with_depth(cell.spec, low)), profile)
    trace_high = traced(cell.with_spec(cell.workload.with_depth(cell.spec, high)), profile)
    if not depths and moment_switched(trace_low, trace_high):
        # A phase peaked at different moments at the two depths: a line through them joins two moments and
        # can take a category negative. One layer deeper (still below the cell's depth) the moment has settled.
        low, high, trace_low = high, high + 1, trace_high
        trace_high = traced(cell.with_spec(cell.workload.with_depth(cell.spec, high)), profile)
    return _extrapolated_trace(trace_low, trace_high, low, high, depth), trace_high, (low, high)


# Bytes by which a category may shrink between the traced depths at the same moment: rounding, not a switch.
_SHRINK_TOLERANCE = 2**20


def moment_switched(a: StepTrace, b: StepTrace) -> bool:
    """Whether a phase's peak falls at a different moment in the deeper trace `b` than in `a`. At the same
    moment every category grows (or stays) with each added layer; a category that shrinks, or that is held
    at one depth and absent at the other, marks a different moment (say mid-forward at one depth and the
    optimizer's state at the other). A switch beyond the deeper traced depth cannot show here: what keeps
    it from happening is that each phase is one part of the step (trace.py's phases)."""
    for phase in set(a.phase_at_peak) & set(b.phase_at_peak) - {BACKWARD_MIDDLE}:
        at_a, at_b = a.phase_at_peak[phase], b.phase_at_peak[phase]
        for category in set(at_a) | set(at_b):
            x, y = at_a.get(category, 0), at_b.get(category, 0)
            if y < x - max(_SHRINK_TOLERANCE, 0.01 * x) or (min(x, y) == 0 and max(x, y) > _SHRINK_TOLERANCE):
                return True
    return False


def _extrapolate(a: float, b: float, depth_a: int, depth_b: int, depth: int) -> float:
    return a + (b - a) * (depth - depth_a) / (depth_b - depth_a)


def _extrapolated_trace(a: StepTrace, b: StepTrace, low: int, high: int, depth: int) -> StepTrace:
    """A trace at `depth` layers from traces at `low` and `high`: every total is affine in the depth."""

    def lin(x: float, y: float) -> float:
        return _extrapolate(x, y, low, high, depth)

    # Each phase's peak is affine in the depth, the step's peak (their maximum) is not: the phase that
    # peaks can change between the traced depths and the real one (the optimizer step's share grows). The
    # middle blocks' backward peaks at neither end of its span, and never above both ends (trace.py).
    phases = [p for p in b.phase_peaks if p in a.phase_peaks and p != BACKWARD_MIDDLE] or [None]
    peaks = {p: lin(a.phase_peaks[p], b.phase_peaks[p]) if p else lin(a.peak_bytes, b.peak_bytes) for p in phases}
    top = max(phases, key=lambda p: peaks[p])
    at_a, at_b = (a.phase_at_peak[top], b.phase_at_peak[top]) if top else (a.at_peak, b.at_peak)
    return StepTrace(
        peak_bytes=round(peaks[top]),
        at_peak={k: round(lin(at_a.get(k, 0), at_b.get(k, 0))) for k in set(at_a) | set(at_b)},
        params_bytes=round(lin(a.params_bytes, b.params_bytes)), grads_bytes=round(lin(a.grads_bytes, b.grads_bytes)),
        optimizer_bytes=round(lin(a.optimizer_bytes, b.optimizer_bytes)),
        activations_bytes=round(lin(a.activations_bytes, b.activations_bytes)), events=[],
        ops=_extrapolated_ops(a.ops, b.ops, lin), precision=b.precision, tf32=b.tf32,
        compiled=b.compiled, allocator=b.allocator,
        notes=_notes_at_depth(a.notes, b.notes, lin, high)
        + [f"extrapolated from traces at {low} and {high} layers to {depth}"],
        untraced=b.untraced,
        param_count=round(lin(a.param_count, b.param_count)), gen_len=b.gen_len,
        kv_cache_bytes=round(lin(a.kv_cache_bytes, b.kv_cache_bytes)),
        gathered_bytes=round(lin(a.gathered_bytes, b.gathered_bytes)),
        weight_cast_bytes=round(lin(a.weight_cast_bytes, b.weight_cast_bytes)),
        phase_peaks={p: round(v) for p, v in peaks.items() if p},
        phase_at_peak={p: {k: round(lin(a.phase_at_peak[p].get(k, 0), b.phase_at_peak[p].get(k, 0)))
                           for k in set(a.phase_at_peak[p]) | set(b.phase_at_peak[p])}
                       for p in phases if p and p in a.phase_at_peak and p in b.phase_at_peak},
        host=HostTraffic(*(round(lin(x, y)) for x, y in zip(astuple(a.host), astuple(b.host), strict=True)))
        if a.host and b.host else None)


# A figure with thousands separators (bytes, parameter counts) in a technique's note.
_COUNT = re.compile(r"\d{1,3}(?:,\d{3})+")


# A whole number in a note (with or without thousands separators), or a decimal one.
_NUMBER = re.compile(r"\d[\d,]*\d(?:\.\d+)?|\d(?:\.\d+)?")


def _notes_at_depth(low: list[str], high: list[str], lin, depth: int) -> list[str]:
    """The techniques' notes at the real depth: a note written at both traced depths in the same words, whose
    counts differ, has each count extrapolated as the trace's totals are (parameters, bytes and blocks are
    affine in the depth); any other note keeps the deeper trace's counts and says so."""
    if len(low) != len(high):
        return [_at_traced_depth(note, depth) for note in high]
    return [b if a == b else _note_extrapolated(a, b, lin) or f"[{depth}-layer trace] {b}"
            for a, b in zip(low, high, strict=True)]


def _note_extrapolated(a: str, b: str, lin) -> str | None:
    words_a, words_b = _NUMBER.split(a), _NUMBER.split(b)
    counts_a, counts_b = _NUMBER.findall(a), _NUMBER.findall(b)
    if words_a != words_b or len(counts_a) != len(counts_b):
        return None
    counts = []
    for x, y in zip(counts_a, counts_b, strict=True):
        if x != y and ("." in x or "." in y):
            return None  # a ratio or a size in GiB: not affine in the depth
        value = y if x == y else round(lin(int(x.replace(",", "")), int(y.replace(",", ""))))
        counts.append(value if isinstance(value, str) else f"{value:,}" if "," in y or value >= 10_000
                      else str(value))
    return "".join(word + count for word, count in zip(words_b, [*counts, ""], strict=True))


def _at_traced_depth(note: str, depth: int) -> str:
    """A technique's note as the extrapolated row shows it: its counts are the traced model's (a
    technique wrote them while applied to `depth` layers), so the note says so rather than contradict the
    row's own figures for the whole model."""
    return f"[{depth}-layer trace] {note}" if _COUNT.search(note) else note


def _extrapolated_ops(a: dict[OpShape, int], b: dict[OpShape, int], lin) -> dict[OpShape, int]:
    """Op counts at the target depth: an op of a layer keeps its shape and its count is affine in the
    depth; ops whose shape grows with the depth (the optimizer's foreach ops over every parameter) are
    extrapolated per (phase, class, dtype, issuer, alignment) as totals and kept as one op of the average shape."""
    out: dict[OpShape, int] = {}
    for shape in set(a) & set(b):
        count = round(lin(a[shape], b[shape]))
        if count > 0:
            out[shape] = count
    totals: dict[tuple[str, str, str, str, bool, bool, bool, int], list[list[float]]] = {}
    for index, ops in enumerate((a, b)):
        for shape, count in ops.items():
            if shape in a and shape in b:
                continue
            kind = (shape.phase, shape.op_class, shape.dtype, shape.issuer, shape.aligned, shape.fused, shape.tinygemm,
                    shape.weight_bits)
            group = totals.setdefault(kind, [[0.0] * 4, [0.0] * 4])[index]
            for position, value in enumerate((count, shape.flops * count, shape.bytes * count, shape.kernels * count)):
                group[position] += value
    for (phase, op_class, dtype, issuer, aligned, fused, tinygemm, weight_bits), (x, y) in totals.items():
        count, flops, moved, kernels = (max(0.0, lin(u, v)) for u, v in zip(x, y, strict=True))
        if round(count) > 0:
            shape = OpShape(phase, op_class, dtype, flops / count, moved / count, max(1, round(kernels / count)),
                            issuer, aligned, fused, tinygemm=tinygemm, weight_bits=weight_bits)
            out[shape] = out.get(shape, 0) + round(count)
    return out
