"""The workload contract: what a benchmarked model must provide.

A workload is a module-level object with a size table, a builder with random initialisation (no
downloads), a batch maker, a loss, the containers of its repeated blocks (so techniques such as
checkpointing can wrap them without knowing the model), and analytic FLOPs per sample for MFU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = dict[str, torch.Tensor]

# Scales group sizes: `smoke` runs in seconds on a CPU (CI), `standard` holds the canonical sizes
# people quote, `large` holds sizes that mostly exist to be projected, `test` holds sizes for the suite's
# own tests (a tiny mixture of experts for multi-rank runs), which no default plan picks.
SCALES = ("smoke", "standard", "large", "test")
# A size that belongs to every scale: a user's model has the one size it was built at.
ANY_SCALE = "any"


@dataclass(frozen=True)
class SizeSpec:
    """One row of a workload's size table.

    Attributes:
        name: the id users type (`gpt2-124m`).
        scale: `smoke`, `standard`, `large`, `test`, or `any` (every scale).
        config: the model's hyper-parameters (layers, hidden size, ...), passed to the builder.
        batch_size: the default batch for this size.
        seq_len: tokens per sample for language models, None for vision.
        image_size: pixels per side for vision models, None for language models.
        canonical_params: the published parameter count this size must reproduce, or None.
        canonical_tolerance: allowed relative error against `canonical_params` (0 means exact).
        canonical_source: where `canonical_params` comes from.
        gen_len: tokens a served decoder generates per sequence after its `seq_len`-token prompt
            (inference of a workload with `serving`); None: the size's default (Workload.served).
    """

    name: str
    scale: str
    config: Mapping[str, Any]
    batch_size: int
    seq_len: int | None = None
    image_size: int | None = None
    canonical_params: int | None = None
    canonical_tolerance: float = 0.0
    canonical_source: str = ""
    gen_len: int | None = None


@dataclass(frozen=True)
class AttentionRoles:
    """Attribute names, inside an attention module, of its fused [q; k; v] projection (heads contiguous
    within each of q, k and v), its output projection and its head count: what head pruning rebuilds;
    `kv_groups` names its query heads per key/value head where it has grouped-query attention."""

    qkv: str = "qkv"
    out: str = "proj"
    heads: str = "n_head"
    kv_groups: str | None = None


# Tokens a served decoder generates per sequence unless told (`--gen-len`): a chat reply's length.
DEFAULT_GEN_LEN = 128


@dataclass(frozen=True)
class Serving:
    """How a decoder is served: a prompt is prefilled into a KV cache, then tokens are decoded one at a
    time from it (suites/generate.py runs the loop).

    Attributes:
        new_cache: (model, batch, context tokens, dtype, device, kind) -> a preallocated KV cache
            (suites/kv_cache.py; kind `native` or `int8`).
        forward: (model, tokens [B, S], cache, start position) -> next-token logits [B, vocab].
        gathered_bytes: model -> bytes of its tables a token reads one row of (embeddings), which a
            decode step does not stream from memory as it does the other weights.
    """

    new_cache: Callable[..., Any]
    forward: Callable[[nn.Module, torch.Tensor, Any, int], torch.Tensor]
    gathered_bytes: Callable[[nn.Module], int]


@dataclass(frozen=True)
class Pipelining:
    """How a workload's model is cut into pipeline stages (the `pipeline-parallel` technique):
    `stage(model, index, stages)` -> the module stage `index` runs (its share of the blocks, the
    embeddings on the first stage, the head on the last), with a `tied_parameters()` method naming what
    the first and last stages both hold and must sum the gradients of; `loss(output, target)` on the last
    stage's output; the batch keys of the first stage's input and of the last stage's target."""

    stage: Callable[[nn.Module, int, int], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    inputs: str = "input_ids"
    target: str = "labels"


@dataclass(frozen=True)
class MlpRoles:
    """Attribute names, inside an MLP module, of its expanding layer, its optional gate (SwiGLU) and
    its contracting layer: what neuron pruning rebuilds."""

    up: str = "up"
    down: str = "down"
    gate: str | None = None


@dataclass(frozen=True)
class VocabularyRoles:
    """Attribute names, on the model (or a pipeline stage of it), of its token embedding and its output
    head: what tensor parallelism shards over the vocabulary. `head` names a Linear where the model has its
    own; where it holds None, the head is tied to the embedding and the model's logits call the embedding's
    `gathered_logits(x)` when tensor parallelism gives it one (logits over the rank's vocabulary rows, sharded
    for loss parallelism or gathered from every rank)."""

    embedding: str = "wte"
    head: str | None = "lm_head"


@dataclass(frozen=True)
class ConvRoles:
    """A residual bottleneck's prunable convs: (conv, its norm, the conv that consumes its channels)."""

    pairs: tuple[tuple[str, str, str], ...] = (("conv1", "bn1", "conv2"), ("conv2", "bn2", "conv3"))


@dataclass(frozen=True)
class Traits:
    """What techniques and the projection need to know about a workload, declared by the workload, so
    nothing outside it branches on its name.

    Attributes:
        convolutional: its compute is mostly convolutions (cuDNN runs fp32 convolutions on TF32
            tensor cores; Linear-only techniques such as fp8 or 2:4 would touch only its classifier).
        batch_norm: it has BatchNorm layers, which need more than one sample per channel in training.
        uniform_blocks: its repeated blocks all have the same shape, so one can stand for all
            (cross-layer sharing).
        depth_key: the config key holding the number of repeated blocks, for depth extrapolation in
            projection; None where the model is not a stack of identical blocks.
        max_seq_key: the config key holding the longest sequence the model accepts (language models).
        attention, mlp, bottleneck: module roles for structured pruning; None where it has none.
        vocabulary: module roles of the token embedding and the head, sharded over the vocabulary by
            tensor parallelism; None where it has none (they stay whole on every rank).
        residual_entry: in a pre-norm model (norm, then attention or MLP, then the residual add), the
            module whose output starts the residual stream, from where sequence parallelism shards it;
            None where the model is not pre-norm.
        variable_length: it trains on a sequence length drawn per step (the fragmentation workload):
            measured and projected over its loop of lengths (suites/workloads/fragmentation.py).
    """

    convolutional: bool = False
    batch_norm: bool = False
    uniform_blocks: bool = False
    depth_key: str | None = None
    max_seq_key: str | None = None
    attention: AttentionRoles | None = None
    mlp: MlpRoles | None = None
    bottleneck: ConvRoles | None = None
    vocabulary: VocabularyRoles | None = None
    residual_entry: str | None = None
    variable_length: bool = False


@dataclass(frozen=True)
class Workload:
    """A benchmarked model with everything the harness needs to train, serve and account for it.

    Attributes:
        name: `resnet50`, `bert` or `gpt` (or a user's model: `model:pkg.mod:factory`, `hf:config.json`).
        kind: a description for people (`vision`, `encoder`, `decoder`); code reads `traits` instead.
        sizes: size id -> SizeSpec.
        build: size -> a freshly initialised nn.Module on the CPU, in float32.
        batch: (size, batch_size, generator) -> dict of input tensors on the CPU.
        loss: (model, batch) -> scalar training loss.
        forward: (model, batch) -> the inference output (logits).
        block_lists: model -> the nn.ModuleList / nn.Sequential containers of repeated blocks.
        forward_flops_per_sample: size -> analytic matmul/conv FLOPs of one forward pass per sample.
        train_flops_per_sample: size -> FLOPs of forward + backward per sample.
        accuracy_metric: name of the metric of its accuracy task (`top1`, `masked-byte-accuracy`, ...);
            the task itself (its data, model size and budget) is in suites/tasks.
        serving: how it is served token by token (decoders), or None: its inference is one forward.
        pipelining: how it is cut into pipeline stages, or None where it cannot be.
        traits: what techniques and the projection need to know about it (see `Traits`).
    """

    name: str
    kind: str
    sizes: Mapping[str, SizeSpec]
    build: Callable[[SizeSpec], nn.Module]
    batch: Callable[[SizeSpec, int, torch.Generator], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    forward: Callable[[nn.Module, Batch], torch.Tensor]
    block_lists: Callable[[nn.Module], list[nn.Module]]
    forward_flops_per_sample: Callable[[SizeSpec], float]
    train_flops_per_sample: Callable[[SizeSpec], float]
    accuracy_metric: str = ""
    serving: Serving | None = None
    pipelining: Pipelining | None = None
    traits: Traits = Traits()
    extra: Mapping[str, Any] = field(default_factory=dict)

    def size(self, name: str) -> SizeSpec:
        """The size called `name`; ValueError naming the valid ones otherwise."""
        try:
            return self.sizes[name]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(name, list(self.sizes), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            valid = ", ".join(self.sizes)
            raise ValueError(f"unknown size {name!r} for workload {self.name!r}{hint}; valid: {valid}") from None

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """Every repeated block of `model`, in order: its `block_lists` containers flattened (what FSDP
        shards one by one and what checkpointing or a trace's backward marks)."""
        return [block for container in self.block_lists(model) for block in container]

    def default_size(self) -> SizeSpec:
        """The size a question about the workload means when it names none: its first standard one."""
        return (self.sizes_at("standard") or list(self.sizes.values()))[0]

    def sizes_at(self, scale: str) -> list[SizeSpec]:
        """The sizes that belong to `scale` (a size of scale `any` belongs to all)."""
        return [s for s in self.sizes.values() if s.scale in (scale, ANY_SCALE)]

    def depth(self, size: SizeSpec) -> int | None:
        """The number of repeated blocks of `size`, or None if the model is not a uniform stack."""
        key = self.traits.depth_key
        return size.config.get(key) if key else None

    def with_depth(self, size: SizeSpec, layers: int) -> SizeSpec:
        """The same size with `layers` repeated blocks (for depth extrapolation)."""
        if self.traits.depth_key is None:
            raise ValueError(f"workload {self.name!r} declares no depth key: it cannot be extrapolated in depth")
        return dataclasses.replace(size, config={**size.config, self.traits.depth_key: layers})

    def max_seq_len(self, size: SizeSpec) -> int | None:
        """The longest sequence `size` accepts, or None (vision, or not declared)."""
        key = self.traits.max_seq_key
        return size.config.get(key) if key else None

    def served(self, size: SizeSpec) -> SizeSpec:
        """`size` as a served (inference) cell runs it: a decoder prefills a prompt and generates
        `gen_len` tokens; where the size says nothing, it generates DEFAULT_GEN_LEN (at most an eighth
        of its sequence) after a prompt that fills the rest, so the whole context is its `seq_len`.
        Sizes of workloads that are not served token by token are returned as they are."""
        if self.serving is None or size.seq_len is None or size.gen_len is not None:
            return size
        gen_len = max(2, min(DEFAULT_GEN_LEN, size.seq_len // 8))
        return dataclasses.replace(size, seq_len=size.seq_len - gen_len, gen_len=gen_len)

    def tokens_per_sample(self, size: SizeSpec, mode: str = "train") -> int | None:
        """Tokens one sample carries (language models; a variable-length training loop's mean), None for
        vision."""
        if self.traits.variable_length and size.seq_len and mode == "train":
            from suites.workloads.fragmentation import step_lengths  # it builds on this module

            lengths = step_lengths(size)
            return round(sum(lengths) / len(lengths))
        return size.seq_len


def count_parameters(model: nn.Module) -> int:
    """Unique parameters (tied weights counted once, as published counts do). A quantised layer keeps its
    weights as integer buffers: they count as the parameters they stand for (`quantised_parameters`), as
    torchao's quantised weights, which stay Parameters, count as theirs."""
    return sum(p.numel() for p in model.parameters()) + sum(
        getattr(module, "quantised_parameters", 0) for module in model.modules())
