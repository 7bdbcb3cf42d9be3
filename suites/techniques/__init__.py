"""The technique registry and stack parsing.

A plain dict filled by explicit imports (no directory scanning, no class-path strings); a stack is
written `amp-bf16+checkpointing` and applied in phase order. `baseline` is the empty stack.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from suites.recipes import RECIPES
from suites.techniques import (
    accumulation,  # T6
    adapters,  # LoRA, QLoRA
    allocator,  # T18
    checkpointing,  # T5
    dynamic_sparsity,  # T12
    expert,  # T15: expert parallelism
    groupquant,  # T9
    layout,  # channels-last
    lowrank,  # T3
    offload,  # optimizer state in host memory
    optimizers,  # optimizer implementations
    parallel,  # T13, T16: data parallelism and sharding
    pipeline,  # T13: pipeline parallelism
    precision,  # T1
    pruning,  # T4
    quantization,  # T7-T8
    serving,  # T1 as served, KV-cache int8
    sharing,  # T2
    sparsity,  # T10-T12
    tensor_parallel,  # T13, T14: tensor and sequence parallelism
)
from suites.techniques.base import Phase, Run, Technique, Unsupported

# One module per family, each exporting TECHNIQUES; listed one per line.
FAMILIES = [
    precision,
    checkpointing,
    accumulation,
    sharing,
    lowrank,
    pruning,
    quantization,
    groupquant,
    sparsity,
    dynamic_sparsity,
    serving,
    layout,
    allocator,
    optimizers,
    offload,
    adapters,
    parallel,
    tensor_parallel,
    pipeline,
    expert,
]

BASELINE = "baseline"

TECHNIQUES: dict[str, Technique] = {}


def register(technique: Technique) -> None:
    """Add a technique; a second one with the same id is a programming error."""
    if technique.id in TECHNIQUES or technique.id == BASELINE:
        raise ValueError(f"technique id {technique.id!r} registered twice")
    TECHNIQUES[technique.id] = technique


for _family in FAMILIES:
    for _technique in _family.TECHNIQUES:
        register(_technique)


@dataclass(frozen=True)
class Stack:
    """Techniques in the order they are applied; `name` is the canonical spelling for records.

    A stack from a named recipe keeps the recipe's name, and lists the techniques it names that are
    not implemented (`missing`): such a stack checks as unsupported everywhere, with that reason.
    """

    techniques: tuple[Technique, ...]
    recipe: str | None = None
    missing: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.recipe or "+".join(t.id for t in self.techniques) or BASELINE

    @property
    def parallel(self) -> bool:
        """Whether it runs on several ranks (torchrun): a parallelism, data-parallel or sharding technique."""
        return any(t.phase in (Phase.PARALLEL, Phase.DATA_PARALLEL) for t in self.techniques)

    @property
    def changes_numerics(self) -> bool:
        return any(t.changes_numerics for t in self.techniques)

    def check(self, profile, workload, mode: str) -> str | None:
        """The first reason any technique cannot run here, or None."""
        if self.missing:
            return (f"recipe {self.recipe} needs {', '.join(self.missing)}, which headroom does not implement yet "
                    f"(parallel techniques have their own issue)")
        present = {t.id.partition(":")[0] for t in self.techniques}
        for technique in self.techniques:
            if technique.requires and technique.requires not in present:
                return f"{technique.id} works through {technique.requires}: add it to the stack"
            reason = technique.check(profile, workload, mode)
            if reason:
                return f"{technique.id}: {reason}"
        adapters = next((t.id for t in self.techniques if t.exclusive == "adapters"), None)
        if adapters and "tensor-parallel" in present:
            # Adapters wrap the blocks' Linear layers before parallelism applies (phase order), and
            # ColwiseParallel / RowwiseParallel shard plain Linear layers only (tensor_parallel.tp_modules).
            return (f"tensor-parallel: it shards plain Linear layers, and {adapters}'s adapters wrap them first; "
                    "fine-tune with adapters under fsdp or data-parallel instead")
        return None

    def apply(self, run: Run) -> Run:
        if self.missing:
            raise Unsupported(self.check(run.profile, run.workload, run.mode))
        for technique in self.techniques:
            if technique.declare is not None:
                technique.declare(run)
        for technique in self.techniques:
            technique.apply(run)
        return run


def _configured(technique: Technique, text: str) -> Technique:
    """The variant `name:key=value:key=value` asks for (colons, as commas separate stacks on the command
    line); ValueError (one line) for a technique without options or a malformed one."""
    if technique.configure is None:
        raise ValueError(f"technique {technique.id!r} takes no options; write it as {technique.id}")
    pairs = [item.partition("=") for item in text.split(":")]
    if any(not key or not sep or not value for key, sep, value in pairs):
        raise ValueError(f"options of {technique.id} are written key=value:key=value; got {text!r}")
    keys = [key.strip() for key, _, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"an option of {technique.id} is given twice in {text!r}")
    return technique.configure({key.strip(): value.strip() for key, _, value in pairs})


def technique_names() -> list[str]:
    return [BASELINE, *TECHNIQUES]


def stack_names() -> list[str]:
    """Everything `parse_stack` accepts as a single name: techniques and recipes."""
    return [*technique_names(), *RECIPES]


def parse_stack(text: str) -> Stack:
    """Parse `a+b+c` into a Stack in phase order.

    ValueError (one line) for unknown ids (with the closest names), repeats, `baseline` mixed with
    others, and self-contradictory stacks (two techniques of one exclusive group, e.g. two precisions).
    """
    text = text.strip()
    if not text:
        raise ValueError("empty technique stack; write e.g. 'baseline' or 'amp-bf16+checkpointing'")
    parts = [p.strip() for p in text.split("+")]
    if parts == [BASELINE]:
        return Stack(())
    if text in RECIPES:
        recipe = RECIPES[text]
        known = [name for name in recipe.techniques if name in TECHNIQUES]
        missing = tuple(name for name in recipe.techniques if name not in TECHNIQUES)
        return Stack(parse_stack("+".join(known)).techniques if known else (), recipe=text, missing=missing)
    for part in parts:
        if part in RECIPES:
            raise ValueError(f"recipe {part!r} is a whole stack and cannot be combined: {text!r}")
    techniques: list[Technique] = []
    for part in parts:
        if part == BASELINE:
            raise ValueError(f"'baseline' means no technique and cannot be stacked: {text!r}")
        part, configured, options = part.partition(":")
        if part not in TECHNIQUES:
            close = difflib.get_close_matches(part, stack_names(), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown technique {part!r} in stack {text!r}{hint} "
                             f"(valid: {', '.join(stack_names())})")
        technique = TECHNIQUES[part]
        if configured:
            technique = _configured(technique, options)
        if technique in techniques:
            raise ValueError(f"technique {part!r} appears twice in stack {text!r}")
        clash = next((t for t in techniques if t.exclusive and t.exclusive == technique.exclusive), None)
        if clash:
            raise ValueError(f"incompatible stack {text!r}: {clash.id} and {part} are both of one kind "
                             f"({technique.exclusive}), of which a stack takes one; pick one")
        techniques.append(technique)
    # Phase order, then order and id within a phase, so every spelling of a stack has one canonical name.
    techniques.sort(key=lambda t: (t.phase, t.order, t.id))
    return Stack(tuple(techniques))


__all__ = ["BASELINE", "RECIPES", "TECHNIQUES", "Phase", "Run", "Stack", "Technique", "Unsupported",
           "parse_stack", "register", "stack_names", "technique_names"]
