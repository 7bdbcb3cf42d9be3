"""Cells: one benchmark each, named (`Cell`, what a plan lists and a results folder keys on) and
resolved once (`ResolvedCell`, what measurement and projection both take).

A cell is the smallest unit that is run (in its own process), recorded and resumed. Resolving it
looks up its workload, size, technique stack and GPU profile and asks the stack whether it can run
there; nothing downstream looks a name up again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import asdict, dataclass

from harness.profiles import GpuProfile, unknown_name
from suites.techniques import Stack, parse_stack
from suites.workloads import get_workload
from suites.workloads.base import SizeSpec, Workload

MODES = ("train", "infer")
# Longest cell id: a file name holds 255 bytes, and the results store adds ".", ".json" and a temp suffix.
MAX_CELL_ID = 200


@dataclass(frozen=True)
class Cell:
    """One benchmark by name: what runs (workload, size, mode, stack, batch) and where (GPU profile id)."""

    workload: str
    size: str
    mode: str
    technique: str
    gpu: str
    batch_size: int
    source: str = "measured"  # or "projected": computed from a trace, no device needed
    # A served decoder's prompt and generated tokens per sequence (None: the size's defaults)
    prompt_len: int | None = None
    gen_len: int | None = None
    world_size: int = 1  # processes (ranks) the cell runs on, under torchrun

    @property
    def cell_id(self) -> str:
        """A filesystem-safe, unique and stable name: the key for resuming. One whose names needed
        characters replaced, or that is long (a user model's path), ends in a hash of the whole, so it
        stays unique and fits a file name (255 bytes, with the store's temp-file prefix and suffix)."""
        raw = f"{self.workload}__{self.size}__{self.mode}__{self.technique}__{self.gpu}__b{self.batch_size}"
        if self.prompt_len is not None or self.gen_len is not None:
            raw += f"__p{self.prompt_len or ''}g{self.gen_len or ''}"
        if self.world_size != 1:
            raw += f"__w{self.world_size}"
        if self.source != "measured":
            raw += f"__{self.source}"
        safe = re.sub(r"[^A-Za-z0-9_.+-]", "_", raw)
        if safe != raw or len(safe) > MAX_CELL_ID:
            # Characters replaced (a path in a user's workload name) could make two cells one file name:
            # the hash of the name as given keeps them apart.
            safe = f"{safe[:MAX_CELL_ID - 17]}__{hashlib.sha256(raw.encode()).hexdigest()[:15]}"
        return safe

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        served = "".join(f", {name} {value}" for name, value in (("prompt", self.prompt_len), ("gen", self.gen_len))
                         if value is not None)
        return (f"{self.workload} {self.size} {self.mode} {self.technique} on {self.gpu} (batch {self.batch_size}"
                f"{served}){' [projected]' if self.source == 'projected' else ''}")

    def resolve(self, profiles: dict[str, GpuProfile], spec: SizeSpec | None = None) -> ResolvedCell:
        """Look every name up once; ValueError (one line) for an unknown one. `spec` replaces the
        size's table entry (a sequence length the user chose, a depth traced for extrapolation)."""
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r} (valid: {', '.join(MODES)})")
        if self.gpu not in profiles:
            raise ValueError(unknown_name("GPU profile id", self.gpu, sorted(profiles)))
        workload = get_workload(self.workload)
        spec = spec or (workload.size(self.size) if self.size else workload.default_size())
        if self.mode == "infer":
            spec = served_spec(workload, spec, self.prompt_len, self.gen_len)
        elif self.prompt_len is not None or self.gen_len is not None:
            raise ValueError("--prompt-len and --gen-len describe generation: they need --mode infer")
        stack = parse_stack(self.technique)
        profile = profiles[self.gpu]
        # The names as the row records them: the stack's canonical spelling, the workload's own name.
        named = dataclasses.replace(self, technique=stack.name, workload=workload.name, size=spec.name)
        resolved = ResolvedCell(named, workload, spec, stack, profile, stack.check(profile, workload, self.mode))
        if self.source == "projected" and self.mode == "infer" and stack.parallel:
            # A served tensor-parallel group is projected (not measured): its rank's stack decides.
            from harness.project.served_parallel import served_verdict  # it builds on this module

            resolved = dataclasses.replace(resolved, unsupported=served_verdict(resolved))
        return resolved


def served_spec(workload: Workload, spec: SizeSpec, prompt_len: int | None = None,
                gen_len: int | None = None) -> SizeSpec:
    """`spec` as an inference cell runs it: a served decoder's prompt and generated tokens (the size's
    defaults, Workload.served, unless given), checked against its longest sequence; ValueError (one
    line) for lengths it cannot take, or for a workload that is not served token by token."""
    if workload.serving is None:
        if prompt_len is not None or gen_len is not None:
            raise ValueError(f"--prompt-len and --gen-len apply to decoders served token by token; {workload.name} "
                             "runs inference as one forward pass")
        return spec
    if spec.gen_len is not None and prompt_len is None and gen_len is None:
        return spec  # already served (a depth-extrapolated or searched copy)
    default = workload.served(dataclasses.replace(spec, gen_len=None))
    generated = gen_len if gen_len is not None else default.gen_len
    # Without a prompt length, the prompt is what the size's sequence leaves the generated tokens (its default
    # prompt plus its default generation, less those asked for), so --gen-len alone keeps the sequence whole.
    prompt = prompt_len if prompt_len is not None else default.seq_len + default.gen_len - generated
    if prompt_len is None and prompt < 1 <= generated:
        raise ValueError(f"--gen-len {generated} leaves no prompt in {spec.name}'s {prompt + generated}-token "
                         "sequence: give a shorter --gen-len, or --prompt-len")
    if prompt < 1 or generated < 2:
        raise ValueError(f"--prompt-len must be >= 1 and --gen-len >= 2 (the first token comes from the prompt, the "
                         f"rest from the cache), got {prompt} and {generated}")
    limit = workload.max_seq_len(spec)
    if limit is not None and prompt + generated > limit:
        raise ValueError(f"prompt {prompt} + generated {generated} tokens exceed {spec.name}'s longest sequence "
                         f"{limit}: shorten --prompt-len or --gen-len")
    return dataclasses.replace(spec, seq_len=prompt, gen_len=generated)


@dataclass(frozen=True)
class ResolvedCell:
    """A cell with its names looked up: the objects measurement, projection and the row builder use.

    Attributes:
        cell: the named cell (identity of the row).
        workload, spec, stack, profile: what the names stand for (`spec` may differ from the size
            table's entry, e.g. in sequence length).
        unsupported: the support verdict: None, or why the stack cannot run here.
    """

    cell: Cell
    workload: Workload
    spec: SizeSpec
    stack: Stack
    profile: GpuProfile
    unsupported: str | None = None

    @property
    def mode(self) -> str:
        return self.cell.mode

    @property
    def batch_size(self) -> int:
        return self.cell.batch_size

    @property
    def source(self) -> str:
        return self.cell.source

    def with_batch(self, batch_size: int) -> ResolvedCell:
        """The same cell at another batch."""
        return dataclasses.replace(self, cell=dataclasses.replace(self.cell, batch_size=batch_size))

    def with_spec(self, spec: SizeSpec) -> ResolvedCell:
        """The same cell with another size entry (another size, a traced depth, a chosen sequence length)."""
        return dataclasses.replace(self, cell=dataclasses.replace(self.cell, size=spec.name), spec=spec)
