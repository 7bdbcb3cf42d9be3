"""Group-wise weight-only quantisation (guide T9): int8 / int4 weights with one scale per group.

`group-quant` / `group-quant-int4` store Linear weights only as int8 / int4 with one scale per group
of G input weights (Frantar et al. 2022, GPTQ, arXiv:2210.17323; torchao's weight-only configs),
dequantising on the fly: through torchao where it runs, else a hand-written packed layout. A mixture of
experts' batched expert matrices are stored the same way, per expert (groupquant_experts.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from suites.techniques.base import Phase, Run, Technique, Unsupported
from suites.techniques.quantization import INT8_MAX, _bytes, _inference_only, _replace, tied_layers, tied_note

# Weight-only group quantisation: bits -> default group size (inputs sharing one scale). int4 uses 32,
# llama.cpp's Q4_0 block and the finest of torchao's int4 group sizes (32-256); int8 rounds 16x finer,
# so it takes 128, the group size GPTQ and AWQ checkpoints usually ship with. Smaller groups follow
# outliers more closely at the cost of more scales (fp32 here: 1 bit per weight at 32, 0.25 at 128).
GROUP_SIZES = {8: 128, 4: 32}
INT4_MAX = 7  # symmetric int4 uses -7..7 so both signs get the same step (code -8 stays unused)


# ---------------------------------------------------------------------------------------------------
# group-quant: weight-only int8 / int4 with per-group scales.


def _group_size(in_features: int, bits: int) -> int | None:
    """The default group size, or the whole row when a layer is narrower; None if groups cannot tile it."""
    group = min(GROUP_SIZES[bits], in_features)
    if in_features % group or (bits == 4 and group % 2):
        return None
    return group


# The hand-written layer's forward is one custom op, so the projection's trace sees what a fused weight-only
# kernel does (int4 tinygemm, Marlin, a compiled one-row decode): read the packed integer weight and its
# scales, dequantise in registers, multiply; its FLOPs and bytes are counted from its operands
# (harness/project/trace.py). The body is the reference arithmetic: dequantise the whole weight, then matmul,
# as torchao's per-group int8 layer also runs eagerly (rows say what that leaves out: _unfused_note).
@torch.library.custom_op("headroom::weight_only_linear", mutates_args=())
def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bits: int,
                       group_size: int) -> torch.Tensor:
    out_features = weight.shape[0]
    in_features = weight.shape[1] * (2 if bits == 4 else 1)
    return F.linear(x, dequantize(weight, scales, bits, group_size, out_features, in_features).to(x.dtype))


@weight_only_linear.register_fake
def _weight_only_linear_fake(x, weight, scales, bits, group_size):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


# The same arithmetic under another name: what a projection traces where the GPU would run torchao's int4
# tinygemm (tinygemm_stand_in), so the speed model can cost that kernel's own rate: tinygemm multiplies at a
# small fraction of a bf16 GEMM's rate whatever the row count (harness/project/speed_constants.toml,
# tinygemm_efficiency), where other weight-only kernels (Marlin, cuBLAS after a dequantise) do not.
@torch.library.custom_op("headroom::tinygemm_linear", mutates_args=())
def tinygemm_linear(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bits: int,
                    group_size: int) -> torch.Tensor:
    return weight_only_linear(x, weight, scales, bits, group_size)


@tinygemm_linear.register_fake
def _tinygemm_linear_fake(x, weight, scales, bits, group_size):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def int_weight(weight: torch.Tensor, bits: int, out_features: int, in_features: int) -> torch.Tensor:
    """The integer weight [..., out, in] as int8 (int4 values unpacked from two per byte); leading
    dimensions are a batch of matrices (a mixture's experts)."""
    if bits == 8:
        return weight
    low = (weight & 0x0F).to(torch.int8) - 8
    high = (weight >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).reshape(*weight.shape[:-2], out_features, in_features)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, out_features: int,
               in_features: int) -> torch.Tensor:
    lead = weight.shape[:-2]
    groups = int_weight(weight, bits, out_features, in_features).reshape(*lead, out_features, -1, group_size)
    return (groups.to(scales.dtype) * scales[..., None]).reshape(*lead, out_features, in_features)


def quantize_rows(weight: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(integer weight, fp32 scales) of a float weight [..., out, in]: symmetric, zero point 0, one scale per
    group of `group_size` consecutive inputs of each row; int4 is packed two to a byte (offset binary)."""
    *lead, in_features = weight.shape
    groups = weight.reshape(*lead, in_features // group_size, group_size)
    qmax = INT8_MAX if bits == 8 else INT4_MAX
    scale = (groups.abs().amax(dim=-1) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.clamp(torch.round(groups / scale[..., None]), -qmax, qmax).to(torch.int8)
    q = q.reshape(*lead, in_features)
    if bits == 4:
        nibbles = (q + 8).to(torch.uint8)  # offset binary: -7..7 -> 1..15
        q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # [..., out, in / 2] bytes
    return q, scale


class GroupQuantLinear(nn.Module):
    """A Linear whose weight is stored as int8, or int4 packed two to a byte, with one fp32 scale per
    group of `group_size` consecutive inputs of each output row (symmetric, zero point 0).

    Written by hand because torchao's CPU int4 layouts keep one value per byte (IntxWeightOnlyConfig
    unpacks to int8) and its packed int4 kernels are CUDA-only; the forward dequantises the weight and
    runs a float matmul (one custom op: see weight_only_linear).
    """

    kernel = staticmethod(weight_only_linear)  # the custom op its forward runs (a tinygemm stand-in's differs)

    def __init__(self, module: nn.Linear, bits: int, group_size: int, scale_dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self.bits, self.group_size = bits, group_size
        q, scale = quantize_rows(module.weight.detach().float(), bits, group_size)
        self.register_buffer("weight", q)
        # [out, in / group_size], in the weights' dtype: fp32 for an fp32 model, 16-bit when the model is
        # served in 16 bits (bf16-weights), as GPTQ/AWQ checkpoints store fp16 scales.
        # (A projection's stand-in for tinygemm keeps fp32 scales whatever the weights' dtype: tinygemm_stand_in.)
        self.register_buffer("scales", scale.to(scale_dtype or module.weight.dtype))
        self.register_buffer("bias", module.bias.detach().clone() if module.bias is not None else None)

    @property
    def quantised_parameters(self) -> int:
        """The parameters the integer weight stands for (suites/workloads/base.py, count_parameters)."""
        return self.out_features * self.in_features + (self.bias.numel() if self.bias is not None else 0)

    def int_weight(self) -> torch.Tensor:
        """The integer weight [out, in] as int8 (int4 values unpacked)."""
        return int_weight(self.weight, self.bits, self.out_features, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.weight, self.scales, self.bits, self.group_size, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x, self.weight, self.scales, self.bits, self.group_size)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}, "
                f"group_size={self.group_size}")


class Bf16Input(nn.Module):
    """Casts the input to bf16 for a layer whose kernel takes bf16 only (torchao's int4 tinygemm)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x.to(torch.bfloat16)).to(x.dtype)


@functools.cache
def _torchao():
    """torchao's quantize_ API, or None with the reason it is unavailable."""
    # (torch's notice about torchao's pytree Enums is filtered out in suites/techniques/base.py.)
    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except Exception as exc:  # not installed, or built for another torch: the fallback takes over
        return None, f"torchao unavailable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
    return (torchao.__version__, quantize_, Int8WeightOnlyConfig, Int4WeightOnlyConfig, PerGroup), ""


def _traced(run: Run) -> bool:
    """Whether the model is made of fake tensors (the projection traces the step under FakeTensorMode)."""
    return any(is_fake(p) for p in run.model.parameters())


def _target_device(run: Run) -> torch.device:
    """The device the cell will run on (as harness/cell.py picks it), if this process can reach it."""
    if run.profile.vendor != "cpu" and torch.cuda.is_available() and not _traced(run):
        return torch.device("cuda")
    return torch.device("cpu")


# torchao 0.18 Int4TilePackedTo4dTensor.from_hp pads in_features to a multiple of 1024 and
# out_features to one of ntile_size = 8 before packing.
TINYGEMM_IN_MULTIPLE = 1024
TINYGEMM_OUT_MULTIPLE = 8


def _torchao_layer(module: nn.Linear, bits: int, group: int, device: torch.device) -> nn.Module | None:
    """The layer quantised by torchao on `device`, or None where torchao cannot do it there.

    int8: Int8WeightOnlyConfig with PerGroup granularity (runs on CPU and CUDA). int4: the tinygemm
    layout (Int4WeightOnlyConfig, tile_packed_to_4d), whose packing and kernel exist only on CUDA with
    compute capability >= 8.0 and only for bf16, so the layer gets a bf16 island. A two-row forward on
    the device proves the kernel runs before the layer is used.
    """
    api, _ = _torchao()
    if api is None:
        return None
    _, quantize_, Int8Config, Int4Config, PerGroup = api
    dtype = module.weight.dtype  # fp32, or 16-bit under bf16-weights / fp16-weights
    if bits == 4:
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
            return None
        if module.in_features % TINYGEMM_IN_MULTIPLE or module.out_features % TINYGEMM_OUT_MULTIPLE:
            # tinygemm would zero-pad the weight (and every input) to these multiples: a 768-wide layer
            # would hold 1024 columns. The hand-written layout keeps the true size, as the projection does.
            return None
        dtype = torch.bfloat16
    try:  # older torchao spells these configs differently: any failure here means the fallback
        config = (Int4Config(group_size=group, int4_packing_format="tile_packed_to_4d") if bits == 4
                  else Int8Config(granularity=PerGroup(group)))
        layer = nn.utils.skip_init(nn.Linear, module.in_features, module.out_features,
                                   bias=module.bias is not None, device=device, dtype=dtype)
        with torch.no_grad():
            layer.weight.copy_(module.weight)
            if module.bias is not None:
                layer.bias.copy_(module.bias)
        quantize_(layer, config)
        wrapped = Bf16Input(layer) if bits == 4 else layer
        with torch.inference_mode():
            wrapped(torch.zeros(2, module.in_features, device=device, dtype=dtype))
    except Exception:  # a shape or device the kernel does not take: the hand-written layer takes over
        return None
    return wrapped


def _tinygemm_device(profile) -> bool:
    """Whether `profile`'s GPU runs torchao's int4 tinygemm: an NVIDIA GPU of compute capability 8.0 or newer."""
    capability = profile.cc_tuple
    return profile.vendor == "nvidia" and capability is not None and capability >= (8, 0)


def _tinygemm_target(run: Run, module: nn.Linear) -> bool:
    """Whether the cell's GPU would run `module` through torchao's int4 tinygemm (_torchao_layer): a GPU that
    has it, a layer it takes unpadded, torchao importable. (A torchao too old for the tile-packed config would
    fall back to the hand-written layer when run: not foreseen here.)"""
    return (_tinygemm_device(run.profile) and _torchao()[0] is not None
            and module.in_features % TINYGEMM_IN_MULTIPLE == 0 and module.out_features % TINYGEMM_OUT_MULTIPLE == 0)


class TinygemmStandIn(GroupQuantLinear):
    """The hand-written layer, traced as the tinygemm kernel it stands for (tinygemm_linear)."""

    kernel = staticmethod(tinygemm_linear)


def tinygemm_stand_in(module: nn.Linear, group: int) -> nn.Module:
    """What a projection traces for a layer a GPU runs through tinygemm (fake tensors cannot run torchao's
    packing): the same int4 weight in the hand-written layout, the matmul in bf16 on a bf16 island as
    Bf16Input runs the real layer, the bias in bf16 as torchao's layer holds it. Torchao keeps a bf16 scale and
    a bf16 zero point per group (scale_and_zero: 5 bits a weight at group 32); the stand-in's one fp32 scale per
    group is those 4 bytes, which the weight-only op reads as the kernel does. Without it an fp32 model's int4
    prefill was costed at the fp32 rate. Its op is tinygemm_linear, which the speed model costs at tinygemm's rate."""
    layer = TinygemmStandIn(module, 4, group, scale_dtype=torch.float32)
    if layer.bias is not None:
        layer.bias = layer.bias.to(torch.bfloat16)
    return Bf16Input(layer)


def _group_quant(bits: int) -> Callable[[Run], None]:
    def apply(run: Run) -> None:
        device = _target_device(run)
        # A traced (fake-tensor) run takes the hand-written layout, whose bytes match torchao's to a few per
        # group where torchao does not pad (see TINYGEMM_IN_MULTIPLE): torchao's quantized weights are
        # frozen Parameters, which MemTracker cannot hook.
        traced = _traced(run)
        paths = {"torchao": 0, "torchao (traced as its bytes and bf16 matmul)": 0, "hand-written": 0}
        groups_used: dict[int, int] = {}
        before = after = skipped = 0
        from suites.techniques.expert import router_ids

        routers = router_ids(run.model)
        tied, kept_tied = tied_layers(run.model), []

        def convert(module: nn.Module) -> nn.Module | None:
            nonlocal before, after, skipped
            if id(module) in routers:
                return None
            if id(module) in tied:
                kept_tied.append(module)
                return None
            group = _group_size(module.in_features, bits)
            if group is None:
                skipped += 1
                return None
            if traced and bits == 4 and _tinygemm_target(run, module):
                new = tinygemm_stand_in(module, group)
                paths["torchao (traced as its bytes and bf16 matmul)"] += 1
            else:
                new = None if traced else _torchao_layer(module, bits, group, device)
                paths["torchao" if new is not None else "hand-written"] += 1
            if new is None:
                new = GroupQuantLinear(module, bits, group)
            groups_used[group] = groups_used.get(group, 0) + 1
            before += _bytes(module.parameters())
            after += _bytes([*new.parameters(), *new.buffers()])
            return new

        count = _replace(run.model, (nn.Linear,), convert)
        # A mixture of experts keeps its experts as batched matrices (one [E, in, out] Parameter per projection),
        # which the Linear path does not reach: quantised here the same way, per expert.
        from suites.techniques.groupquant_experts import quantise_experts

        matrices, matrices_kept, experts_before, experts_after = quantise_experts(run.model, bits)
        before, after = before + experts_before, after + experts_after
        if not count:
            raise Unsupported(f"no nn.Linear of {run.workload.name} has in_features divisible into int{bits} groups"
                              + (" and a weight of its own (not tied to the embedding)" if kept_tied else ""))
        api, why = _torchao()
        version = f"torchao {api[0]}" if api else why
        path = ", ".join(f"{n} {name}" for name, n in paths.items() if n)
        where = {8: "Int8WeightOnlyConfig(PerGroup)", 4: "Int4WeightOnlyConfig tinygemm (CUDA, bf16)"}[bits]
        sizes = ", ".join(f"{g} ({n} layers)" for g, n in sorted(groups_used.items(), reverse=True))
        kept = f"; {skipped} layers kept fp32 (in_features not divisible into groups)" if skipped else ""
        kept += tied_note(len(kept_tied))
        if matrices_kept:
            kept += f"; {matrices_kept} MoE expert matrices kept in their dtype (inputs not divisible into groups)"
        experts = (f" and {matrices} MoE expert matrices (hand-written, per expert; the {len(routers)} routers "
                   "kept)") if matrices else ""
        run.notes.append(
            f"group-quant int{bits} weight-only, group size {sizes} (default {GROUP_SIZES[bits]}; a narrower "
            f"row is one group); {count} Linear layers: {path}{experts} [torchao path: {where}; {version}; "
            f"hand-written: packed int{bits} + scales in the weights' dtype, one op that dequantises and "
            f"multiplies]; {before:,} -> {after:,} bytes{kept}")
        # Traced, every layer but tinygemm's stand-in takes the hand-written layout (torchao's int8 layer among them).
        unfused = paths["hand-written"] if traced else 0
        if (unfused or matrices) and traced and run.profile.vendor != "cpu":
            run.notes.append(_unfused_note(unfused, matrices, bits))

    return apply


def _unfused_note(layers: int, expert_matrices: int, bits: int) -> str:
    """What the projection of `layers` weight-only matmuls on a GPU leaves out. It costs each as one kernel
    reading the packed weight, as tinygemm, Marlin, or Inductor's fusion of a one-row decode's dequantise into
    its matmul run them (gpt-fast #114: with coordinate-descent tuning); run eagerly, or with more rows,
    torchao's per-group int8 layer and the hand-written one dequantise the whole weight before every matmul
    (torchao's Int8Tensor linear: `dequantize()` then `torch.mm`), several passes over it at 16 or 32 bits."""
    experts = f" and {expert_matrices} MoE expert matrices" if expert_matrices else ""
    return (f"{layers} int{bits} weight-only matmuls{experts} projected as one kernel reading the packed weight "
            "(the fused kernel a compiled one-row decode can reach); run eagerly, or compiled without that fusion, "
            "they first dequantise the whole weight (several passes over it, not costed here): measured steps can "
            "be slower")


def _check_group(name: str):
    inference = _inference_only(
        name, "integer weights get no gradients, and weight-only quantisation stores a trained model "
              "(train the fp32 model, or use qat-int8)")

    def check(profile, workload, mode):
        reason = inference(profile, workload, mode)
        if reason:
            return reason
        if workload.traits.convolutional:
            return (f"{name} quantises nn.Linear weights (as torchao's weight-only configs do); "
                    f"{workload.name}'s weights are nearly all in convolutions, so only its classifier would change")
        return None

    return check


GROUP_QUANT = Technique(
    id="group-quant", phase=Phase.COMPRESS, order=1, changes_numerics=True, guide="T9",
    summary=f"weight-only int8 with one scale per {GROUP_SIZES[8]} inputs (torchao, else hand-written)",
    check=_check_group("group-quant"), apply=_group_quant(8), exclusive="quantization",
    post_training=True)

GROUP_QUANT_INT4 = Technique(
    id="group-quant-int4", phase=Phase.COMPRESS, order=1, changes_numerics=True, guide="T9",
    summary=f"weight-only int4 with one scale per {GROUP_SIZES[4]} inputs (torchao tinygemm on CUDA, "
            "else packed nibbles)",
    check=_check_group("group-quant-int4"), apply=_group_quant(4), exclusive="quantization",
    post_training=True, trace_key=_tinygemm_device)

TECHNIQUES = (GROUP_QUANT, GROUP_QUANT_INT4)
