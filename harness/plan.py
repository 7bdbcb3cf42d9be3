"""Plans: expand workloads x sizes x modes x technique stacks x GPUs into cells, and check support.

A cell is one benchmark: the smallest unit that is run (in its own process), recorded and resumed.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from harness.profiles import GpuProfile
from suites.techniques import Stack, parse_stack
from suites.workloads import get_workload
from suites.workloads.base import SCALES

MODES = ("train", "infer")
# The default suite (`headroom run` / `nox -s bench` without --technique): the guide's first-line
# techniques, sized to finish in minutes on a CPU. `--technique all` runs every technique and recipe.
DEFAULT_STACKS = ("baseline", "amp-bf16", "amp-fp16", "checkpointing", "grad-accumulation")


@dataclass(frozen=True)
class Cell:
    """One benchmark: what runs (workload, size, mode, stack, batch) and where (GPU profile id)."""

    workload: str
    size: str
    mode: str
    technique: str
    gpu: str
    batch_size: int
    source: str = "measured"  # or "projected": computed from a trace, no device needed

    @property
    def cell_id(self) -> str:
        """A filesystem-safe, unique and stable name: the key for resuming."""
        raw = f"{self.workload}__{self.size}__{self.mode}__{self.technique}__{self.gpu}__b{self.batch_size}"
        if self.source != "measured":
            raw += f"__{self.source}"
        return re.sub(r"[^A-Za-z0-9_.+-]", "_", raw)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def stack(self) -> Stack:
        return parse_stack(self.technique)

    def describe(self) -> str:
        return (f"{self.workload} {self.size} {self.mode} {self.technique} on {self.gpu} (batch {self.batch_size})"
                f"{' [projected]' if self.source == 'projected' else ''}")


def expand(workloads: list[str], stacks: list[str], gpus: list[GpuProfile], modes: list[str],
           scale: str = "smoke", sizes: list[str] | None = None, batch_size: int | None = None) -> list[Cell]:
    """Every combination, in a stable order. Sizes default to the workload's sizes at `scale`.

    Explicit `sizes` are kept for the workloads that define them; a size no requested workload
    defines is an error, as is an unknown scale, mode or stack (ValueError, one line).
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r} (valid: {', '.join(SCALES)})")
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r} (valid: {', '.join(MODES)})")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch size must be a positive integer, got {batch_size}")
    canonical = [parse_stack(text).name for text in stacks]
    loaded = [get_workload(name) for name in workloads]
    if sizes:
        known = {s for w in loaded for s in w.sizes}
        for size in sizes:
            if size not in known:
                valid = ", ".join(sorted(known))
                raise ValueError(f"unknown size {size!r} for workloads {', '.join(workloads)} (valid: {valid})")
    cells = []
    for workload in loaded:
        specs = [workload.sizes[s] for s in sizes if s in workload.sizes] if sizes else workload.sizes_at(scale)
        for spec in specs:
            for mode in modes:
                for stack in canonical:
                    for gpu in gpus:
                        cells.append(Cell(workload.name, spec.name, mode, stack, gpu.id,
                                          batch_size or spec.batch_size))
    return list(dict.fromkeys(cells))


def support_reason(cell: Cell, profile: GpuProfile) -> str | None:
    """Why this cell cannot run on its profile (from the stack's checks), or None."""
    return cell.stack.check(profile, get_workload(cell.workload), cell.mode)
