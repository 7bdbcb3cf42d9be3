"""The technique contract: a named, checkable transform of a training or inference run.

A technique says whether it can run on a GPU profile for a workload (`check` -> None or the reason),
and `apply` changes the `Run` (model structure, step settings, environment). Stacks such as
`amp-bf16+checkpointing` apply their techniques in phase order, the order torchtitan documents:
structure -> compression -> parallelism -> checkpointing -> compile -> data parallel -> step level
-> runtime.
"""

from __future__ import annotations

import contextlib
import enum
import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:  # profiles are a contract; only their type is needed here
    from harness.profiles import GpuProfile
    from suites.workloads.base import SizeSpec, Workload


class _TorchaoEnumNotice(logging.Filter):
    """Drops the notice torch >= 2.13 logs on every import of torchao 0.18 (it registers Enums as pytree
    constants, which torch now supports natively): a deprecation inside torchao that the user of a technique
    (fp8, NF4, low-bit optimizers, group-quant) can do nothing about, printed on every `headroom project`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_TorchaoEnumNotice())


class Phase(enum.IntEnum):
    """Where in the build a technique acts; a stack applies lower phases first."""

    STRUCTURE = 0      # sharing, low-rank, pruning: change the model's shape
    COMPRESS = 1       # quantisation, sparsity, fp8 modules: act on the final weights, so after STRUCTURE
    PARALLEL = 2       # tensor / sequence / expert parallelism
    CHECKPOINT = 3     # activation recomputation wraps the (possibly parallelised) blocks
    COMPILE = 4
    DATA_PARALLEL = 5  # FSDP / DDP wrap last among model transforms
    STEP = 6           # autocast, loss scaling, accumulation: how a step runs
    RUNTIME = 7        # allocator and environment settings, fixed before the device starts


def output_bytes(run: Run) -> int:
    """Bytes per element of what a layer outputs: autocast's dtype where the run has one, else fp32. The
    residual stream and the norms' outputs stay fp32 under autocast (CUDA's autocast lists run layer_norm
    in fp32), so collectives of those count 4 bytes whatever this says."""
    return torch.finfo(run.autocast_dtype).bits // 8 if run.autocast_dtype is not None else 4


class Unsupported(Exception):
    """Raised by `apply` when the run cannot take the technique; becomes an `unsupported` row."""


def default_optimizer(params) -> torch.optim.Optimizer:
    """AdamW with the multi-tensor (foreach) implementation, which is PyTorch's default on CUDA: its
    step holds a temporary the size of all parameters (the sqrt of exp_avg_sq for the whole group).
    Asked for explicitly so the CPU, where the default is the per-tensor loop, and the projection's
    fake-tensor trace on the CPU run the same step a GPU would."""
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


@dataclass
class Run:
    """Everything a stack may change about one cell before it is measured.

    Attributes:
        workload, size, mode, profile: what is run where (read-only for techniques).
        model: the nn.Module (techniques may replace or rewrap it).
        batch_size: samples per optimizer step.
        micro_batches: the batch is split into this many forward/backward passes per step.
        autocast_dtype: dtype for torch.autocast, None for full precision.
        tf32: fp32 matmuls and convolutions on TF32 tensor cores (`torch.backends.*.allow_tf32`).
        loss_scaling: dynamic loss scaling (GradScaler) for fp16.
        precision: label recorded in the row (`fp32`, `bf16-mixed`, ...).
        optimizer_factory: parameters -> optimizer (AdamW by default, as in nanoGPT and torchtitan).
        kv_cache: how a served decoder stores its KV cache (`native`: the activations' dtype; `int8`).
        compiled: the model runs through torch.compile (the `compile` technique).
        input_dtype: floating inputs are cast to it before inference (a model held in 16 bits).
        memory_format: 4-D floating inputs (images) are laid out in it before each step (`channels-last`).
        data_parallel: ranks the global batch is split over (data-parallel and sharded stacks).
        data_rank: this rank's index among those `data_parallel` ranks (None: its global rank); tensor-parallel
            ranks of one group share it and so their slice.
        sequence_parallel: tensor parallelism also shards the sequence between its regions (norms,
            dropout, the residual stream), set by `sequence-parallel` before `tensor-parallel` applies.
        pipeline: this rank's pipeline stage runner (`pipeline-parallel`), which then runs the train step.
        pipeline_stages: the stages `pipeline-parallel:p=P` asks for, declared before the stack applies (None:
            no pipeline, or its stages are whatever ranks the others leave).
        pipelined: the stack has a pipeline, declared before the stack applies (with or without its stages).
        mesh: the device mesh the stack's parallel techniques share: 2-D (`dp`, `tp`) where tensor
            parallelism runs in groups smaller than the world, 3-D (`pp`, `dp`, `tp`) where pipelines of
            such groups also run side by side (None: each builds a 1-D one).
        recomputed: the stack checkpoints whole blocks, declared before it applies (their forward runs twice).
        comm_bytes_per_step: bytes each rank sends per step for a parallel stack (ring algorithms).
        vocabulary_comm: (embedding, head) bytes of that which tensor parallelism's vocabulary-parallel
            embedding and head send, on its slice of the batch: a pipeline moves them to its end stages.
        norm_gradient_comm: bytes of that which sequence parallelism's norms' gradient all-reduces send, for
            the whole model: a pipeline counts its stage's.
        placed: a parallel technique put the model on its devices (FSDP2 offload keeps shards on the host),
            so measurement must not move it.
        allocator: the CUDA caching allocator's setting (`native`, `expandable_segments`, `cudaMallocAsync`).
        env: environment variables the cell process must have before the device starts.
        loss_context: a context the training step computes the loss and runs the backward in
            (tensor parallelism's loss_parallel: the cross-entropy over logits sharded by vocabulary).
        notes: facts worth recording in the row's reason/notes.
    """

    workload: Workload
    size: SizeSpec
    mode: str
    profile: GpuProfile
    model: nn.Module
    batch_size: int
    micro_batches: int = 1
    autocast_dtype: torch.dtype | None = None
    tf32: bool = False
    loss_scaling: bool = False
    precision: str = "fp32"
    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = default_optimizer
    kv_cache: str = "native"
    compiled: bool = False
    input_dtype: torch.dtype | None = None
    memory_format: torch.memory_format | None = None
    allocator: str = "native"
    data_parallel: int = 1
    data_rank: int | None = None
    mesh: Any = None
    pipeline: Any = None
    pipeline_stages: int | None = None
    pipelined: bool = False
    sequence_parallel: bool = False
    recomputed: bool = False
    comm_bytes_per_step: int | None = None
    vocabulary_comm: tuple[int, int] = (0, 0)
    norm_gradient_comm: int = 0
    placed: bool = False
    env: dict[str, str] = field(default_factory=dict)
    loss_context: Callable[[], Any] = contextlib.nullcontext
    notes: list[str] = field(default_factory=list)


Check = Callable[["GpuProfile", "Workload", str], "str | None"]


@dataclass(frozen=True)
class Technique:
    """One technique of the guide.

    Attributes:
        id: canonical id used in stacks (`amp-bf16`).
        phase: where it acts in a stack.
        changes_numerics: False when loss and gradients must equal the baseline's (tested).
        summary: one line for `headroom techniques`.
        check: (profile, workload, mode) -> None, or the specific reason it cannot run there.
        apply: transforms the Run in place; raises Unsupported for run-specific limits.
        exclusive: techniques sharing a group cannot be stacked (two precisions, say).
        guide: the guide's id (T1...).
        order: position within the phase (lower first): sparsity masks the float weights (0) before
            quantisation stores them (1) or fp8 swaps the layers (2).
        post_training: it compresses a trained model for deployment (quantisation, pruning, low-rank,
            2:4, served weights and cache), so accuracy is measured on the trained baseline it is applied
            to, not by training with it from scratch.
        fine_tune: its recipe fine-tunes after applying it (pruning and low-rank recover, 2:4 retrains
            with its mask, QAT fine-tunes with fake quantisation); only for post-training techniques.
        configure: for a technique with options (`lora:r=16`), {option: text} -> the variant with them
            (ValueError naming a bad option); None for a technique without options.
        requires: the id of a technique it works through, which the stack must hold too
            (`sequence-parallel` shards what `tensor-parallel` leaves whole).
        declare: run before any technique of the stack applies, to set what those applied earlier must know
            (`pipeline-parallel`'s stage count, which tensor parallelism's device mesh is cut by).
        trace_key: profile -> what of a GPU profile changes the model it builds for a trace beyond the host-or-GPU
            split (int4's tinygemm layers from compute capability 8.0, 2:4's sparse kernels): projections share
            one trace between GPUs only where it agrees. None where the trace is the same on every GPU.
    """

    id: str
    phase: Phase
    changes_numerics: bool
    summary: str
    check: Check
    apply: Callable[[Run], None]
    exclusive: str | None = None
    guide: str = ""
    order: int = 0
    post_training: bool = False
    fine_tune: bool = False
    configure: Callable[[dict[str, str]], Technique] | None = None
    requires: str | None = None
    declare: Callable[[Run], None] | None = None
    trace_key: Callable[[object], Hashable] | None = None

    def __post_init__(self) -> None:
        if self.fine_tune and not self.post_training:
            raise ValueError(f"technique {self.id!r}: fine_tune applies to post-training techniques only")


def choice_option(technique: str, option: str, choices, options: dict[str, str], meaning: str = "") -> str:
    """A technique's one option taking one of `choices` (`selective-checkpointing:mm=alternate`), checked:
    ValueError naming what was wrong and an example."""
    listed = " or ".join(choices)
    unknown = set(options) - {option}
    if unknown:
        raise ValueError(f"{technique} takes one option, {option} ({listed}{': ' + meaning if meaning else ''}), "
                         f"not {', '.join(sorted(unknown))}")
    if options[option] not in choices:
        raise ValueError(f"{technique}: {option} must be {listed}, got {options[option]!r} "
                         f"(e.g. {technique}:{option}={list(choices)[-1]})")
    return options[option]


def always(profile: GpuProfile, workload: Workload, mode: str) -> str | None:
    """A check for techniques that run everywhere."""
    return None


def train_only(name: str) -> Check:
    """A check for techniques that only change the backward pass."""

    def check(profile: GpuProfile, workload: Workload, mode: str) -> str | None:
        if mode != "train":
            return f"{name} only affects training (an inference step has no backward pass or optimizer step)"
        return None

    return check
