"""Plans: expand workloads x sizes x modes x technique stacks x GPUs into cells (harness/cell.py), and
decide what a `headroom run` measures and projects.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from harness.cell import MODES, Cell
from harness.profiles import GpuProfile, unknown_name
from suites.techniques import parse_stack, stack_names
from suites.workloads import WORKLOADS, get_workload
from suites.workloads.base import SCALES

# The default suite (`headroom run` / `nox -s bench` without --technique): the guide's first-line
# techniques, sized to finish in minutes on a CPU. `--technique all` runs every technique and recipe.
DEFAULT_STACKS = ("baseline", "amp-bf16", "amp-fp16", "checkpointing", "grad-accumulation")
# Sizes measured when --scale is not given: seconds per cell on a CPU, the canonical sizes on a GPU;
# GPUs this machine lacks are projected at the canonical sizes.
DEFAULT_LOCAL_SCALE = {True: "smoke", False: "standard"}  # keyed by "the local device is a CPU"
DEFAULT_PROJECTED_SCALE = "standard"
# A first run on a machine without a GPU measures smoke sizes, which answer no buyer's question; it also
# projects the sizes people quote and buy for (ResNet-50, BERT-base/-large, GPT-2 124M to GPT-3 175B
# shapes) onto every GPU profile, so its report says what fits where, how fast, for how much.
DAY_ONE_SCALES = ("standard", "large")


def expand(workloads: list[str], stacks: list[str], gpus: list[GpuProfile], modes: list[str],
           scale: str = "smoke", sizes: list[str] | None = None, batch_size: int | None = None,
           source: str = "measured", prompt_len: int | None = None, gen_len: int | None = None) -> list[Cell]:
    """Every combination, in a stable order. Sizes default to the workload's sizes at `scale`.

    Explicit `sizes` are kept for the workloads that define them; a size no requested workload
    defines is an error, as is an unknown scale, mode or stack (ValueError, one line). `prompt_len`
    and `gen_len` set the generation of the inference cells of served decoders.
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
                raise ValueError(unknown_name("size", size, sorted(known)) + f" for workloads {', '.join(workloads)}")
    served = prompt_len is not None or gen_len is not None
    if served and ("infer" not in modes or not any(w.serving for w in loaded)):
        raise ValueError("--prompt-len and --gen-len set the generation of a served decoder: they need --mode infer "
                         "and a decoder workload (gpt)")
    cells = []
    for workload in loaded:
        specs = [workload.sizes[s] for s in sizes if s in workload.sizes] if sizes else workload.sizes_at(scale)
        for spec in specs:
            for mode in modes:
                for stack in canonical:
                    lengths = ({"prompt_len": prompt_len, "gen_len": gen_len}
                               if served and mode == "infer" and workload.serving else {})
                    for gpu in gpus:
                        cells.append(Cell(workload.name, spec.name, mode, stack, gpu.id,
                                          batch_size or spec.batch_size, source, **lengths))
    return list(dict.fromkeys(cells))


@dataclass(frozen=True)
class RunPlan:
    """What a `headroom run` does: cells measured here, cells projected (every measured cell's twin,
    then the GPUs this machine lacks), and at which scales."""

    measured: list[Cell]
    projected: list[Cell]
    local: GpuProfile
    foreign: list[GpuProfile]
    scale: str
    projected_scale: str
    day_one: bool = False  # a first run on a CPU machine: every GPU profile projected at the quoted sizes

    @property
    def cells(self) -> list[Cell]:
        return self.measured + self.projected


def plan_run(local: GpuProfile, gpus: list[GpuProfile] | None = None, workloads: list[str] | None = None,
             stacks: list[str] | None = None, modes: list[str] | None = None, scale: str | None = None,
             sizes: list[str] | None = None, batch_size: int | None = None,
             profiles: dict[str, GpuProfile] | None = None, require_device: bool = False,
             prompt_len: int | None = None, gen_len: int | None = None, world_size: int = 1) -> RunPlan:
    """The cells of a run on a machine whose device is `local`, asked for `gpus`.

    Every measured cell gets a projected twin (so the projection's error is known); GPUs this machine
    lacks are projected, at the canonical sizes unless `scale` or `sizes` say otherwise. With no `gpus`
    asked for, the local device is measured, and where it is a CPU every GPU of `profiles` (None: none)
    is projected at DAY_ONE_SCALES (unless `scale` or `sizes` are given). `require_device` refuses
    (ValueError) GPUs this machine lacks instead of projecting them. `stacks` ['all'] means every
    technique and recipe. `world_size` ranks run each measured cell of a parallel stack (torchrun) and are
    the GPUs its projections assume (harness/project/parallel.py)."""
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    day_one = (gpus is None and local.vendor == "cpu" and profiles is not None and not scale and not sizes
               and not require_device)
    if gpus is None:
        gpus = [local] + ([p for p in profiles.values() if p.vendor != "cpu"] if day_one else [])
    workloads = workloads or list(WORKLOADS)
    stacks = stack_names() if stacks == ["all"] else (stacks or list(DEFAULT_STACKS))
    modes = modes or list(MODES)
    local_scale = scale or DEFAULT_LOCAL_SCALE[local.vendor == "cpu"]
    foreign = [g for g in gpus if g.id != local.id]
    if foreign and require_device:
        raise ValueError(f"--require-device: no {', '.join(g.id for g in foreign)} on this machine "
                         f"(local device: {local.id}); run without it to project instead")
    lengths = {"prompt_len": prompt_len, "gen_len": gen_len}
    measured = expand(workloads, stacks, [g for g in gpus if g.id == local.id], modes, scale=local_scale,
                      sizes=sizes, batch_size=batch_size, **lengths)
    def on_ranks(cells: list[Cell]) -> list[Cell]:  # parallel stacks run on the ranks; the others on one device
        return [dataclasses.replace(c, world_size=world_size) if parse_stack(c.technique).parallel else c
                for c in cells]

    if world_size > 1 and measured and not any(c.world_size > 1 for c in on_ranks(measured)):
        raise ValueError(f"--world-size {world_size} runs parallel stacks (data-parallel, fsdp, tensor-parallel...) "
                         "on that many ranks, and no --technique asked for is one: add one, or drop --world-size")
    measured = on_ranks(measured)
    projected = [dataclasses.replace(c, source="projected") for c in measured]
    projected_scales = DAY_ONE_SCALES if day_one else (scale or DEFAULT_PROJECTED_SCALE,)
    if foreign:
        for projected_scale in projected_scales:
            projected += on_ranks(expand(workloads, stacks, foreign, modes, scale=projected_scale, sizes=sizes,
                                         batch_size=batch_size, source="projected", **lengths))
    return RunPlan(measured, projected, local, foreign, local_scale, "+".join(projected_scales), day_one)


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` -> (I, N) with 1 <= I <= N; ValueError (one line) otherwise."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard takes I/N (the I-th of N slices, e.g. 2/8), got {text!r}") from None
    if count < 1:
        raise ValueError(f"--shard {text}: N, the number of slices, must be at least 1")
    if not 1 <= index <= count:
        raise ValueError(f"--shard {text}: I must be between 1 and N ({count})")
    return index, count


def shard(plan: RunPlan, index: int, count: int) -> RunPlan:
    """The `index`-th (from 1) of `count` disjoint slices of the plan's cells; the slices together are the whole
    plan. Measured cells are dealt round-robin (every slice gets its share of the slow ones), each with its
    projected twin (a twin is matched within its run), then the other projected cells. Each slice writes its
    own results folder and `headroom report` merges them (a Slurm array: --shard $SLURM_ARRAY_TASK_ID/N)."""
    measured = plan.measured[index - 1::count]
    twins = {dataclasses.replace(c, source="projected") for c in plan.measured}
    others = [c for c in plan.projected if c not in twins]
    kept = {dataclasses.replace(c, source="projected") for c in measured} | set(others[index - 1::count])
    return dataclasses.replace(plan, measured=measured, projected=[c for c in plan.projected if c in kept])
