"""What each traced op costs, op by op, for the speed model (roofline.py): its FLOPs (PyTorch's
`torch.utils.flop_counter` formulas), the bytes it reads and writes, the kernels it launches and who
issues it, as a dispatch mode over a fake-tensor step (trace.py); in a compiled step, which elementwise
ops Inductor fuses.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from harness.measure.tensors import leaves, nbytes
from harness.project import fused_norms
from suites.workloads.moe import experts_touched


@dataclass
class OpCost:
    """Summed cost of one class of ops in one dtype."""

    count: int = 0
    flops: float = 0.0
    bytes: float = 0.0


@dataclass(frozen=True)
class OpShape:
    """One kind of op as the speed model costs it: its step phase, roofline class, dtype, FLOPs, bytes
    read + written and the GPU kernels it launches (a foreach op launches one per chunk of tensors).
    Ops of one shape (a layer's matmuls, repeated per layer) are kept once with a count.

    `issuer` is who issues it on the host, which sets its dispatch cost: `python` (a forward op
    recorded for autograd, a checkpoint's recomputation, the optimizer), `engine` (autograd's C++
    backward) or `inference` (no autograd). `aligned`: a GEMM whose operands' and result's leading
    dimensions are multiples of the tensor cores' granule (8 elements of 16 bits, 16 of 8 bits); others run
    slower kernels (NVIDIA's Matrix Multiplication Background guide; GPT-2's vocabulary of 50,257 is the
    known case; see _aligned).

    `nchw_bytes`, `nchw_tensors`: a convolution's 4-D operands and results not laid out channels-last,
    which a channels-innermost kernel (cuDNN's tensor-core convolutions, oneDNN) transposes around the
    convolution (suites/techniques/layout.py); 0 for every other op."""

    phase: str
    op_class: str
    dtype: str
    flops: float
    bytes: float
    kernels: int = 1
    issuer: str = "python"
    aligned: bool = True
    fused: bool = False  # an elementwise op inside a compiled kernel: no launch or host cost of its own
    nchw_bytes: float = 0.0
    nchw_tensors: int = 0
    tinygemm: bool = False  # torchao's int4 tinygemm matmul, costed at its own rate (speed_constants.toml)
    # A weight-only matmul's packed weight bits (8 or 4; 0 for every other op): a served decoder streams such
    # a weight slower than a bf16 one, as its kernel dequantises on the way (speed_constants.toml)
    weight_bits: int = 0


def op_class(name: str) -> str:
    """Roofline class of an aten op: where its efficiency factor comes from."""
    if "convolution" in name:
        return "conv"
    if "scaled_dot_product" in name:
        return "attention"
    if any(k in name for k in ("mm", "matmul", "linear", "baddbmm")):
        return "matmul"
    return "memory"


# `_unsafe_view` is a view that autograd does not track as one (matmul reshapes its mm's result with it: a
# PEFT adapter's or a bias-free Linear's 3-D output): its schema has no alias annotation, so `is_view` is
# False, but it returns the same storage, with no kernel (aten/src/ATen/native/TensorShape.cpp).
_NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default, torch.ops.aten._unsafe_view.default}
# Ops that take only another tensor's shape, dtype and device from it, never its data: an allocation reads
# and launches nothing; a fill writes its output only. (Costed as reading their input, a MoE layer's
# `weight.new_empty(0)` read every expert's weights at each decoded token.)
# `torch.empty` and its strided form are allocations too: a kernel's C++ asks for its output with them (eval-mode
# batch norm's empty statistics, one per layer of a ResNet), which costs the host no Python dispatch and the GPU
# no kernel.
_ALLOCATION = {getattr(torch.ops.aten, name).default for name in ("new_empty", "new_empty_strided", "empty_like",
                                                                   "empty_strided")} | {
    torch.ops.aten.empty.memory_format}
_FILL = {getattr(torch.ops.aten, name).default
         for name in ("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like")}
# Composite ops that run as one kernel on a GPU (fused_norms.py lends it to GPU targets' traces): costed
# whole there, not decomposed into the CPU's pieces; a CPU target runs the pieces.
_ONE_KERNEL = {getattr(torch.ops.aten, name) for name in ("_fused_rms_norm", "_fused_rms_norm_backward")
               if hasattr(torch.ops.aten, name)}


# The weight-only matmuls of suites/techniques/groupquant.py: one op each, reading the packed weight.
WEIGHT_ONLY_LINEARS = ("headroom.weight_only_linear", "headroom.tinygemm_linear")


# Training batch norm reads its input twice: a pass for the channel statistics, then the normalisation
# (PyTorch's CUDA kernels, aten/src/ATen/native/cuda/Normalization.cuh: batch_norm_stats, then
# batch_norm_elemt), and its backward reads the input and the output's gradient twice (batch_norm_backward_reduce,
# then batch_norm_backward_elemt): a channel's values over the whole batch do not fit on chip, so a reduction
# precedes every elementwise pass. (An eval-mode norm, with running statistics, reads its input once.)
# op -> the positions of the tensors read once more; `training`/`train` in its schema says which mode runs.
# (The projection traces on the CPU, so cuDNN's batch-norm ops, chosen on CUDA only, never reach this table.)
_TWO_PASS_NORMS = {
    "aten.native_batch_norm": (0,), "aten._native_batch_norm_legit": (0,), "aten.native_batch_norm_backward": (0, 1),
}


def second_pass_bytes(name: str, func, args, kwargs) -> int:
    """Bytes a training batch norm (or its backward) reads in its second pass over the data; 0 for others."""
    positions = _TWO_PASS_NORMS.get(name)
    if not positions:
        return 0
    names = [argument.name for argument in func._schema.arguments]
    flag = next((name for name in ("training", "train") if name in names), None)
    if flag is None:
        return 0
    index = names.index(flag)
    training = args[index] if index < len(args) else kwargs.get(flag, False)
    return sum(nbytes(args[i]) for i in positions if isinstance(args[i], torch.Tensor)) if training else 0


# PyTorch's multi_tensor_apply (the foreach kernels of the optimizer step) launches a kernel when a
# chunk list fills: at most 110..30 tensors (fewer with more lists per op; 64 is the middle) or 320
# blocks of 65,536 elements (aten/src/ATen/native/cuda/MultiTensorApply.cuh).
FOREACH_TENSORS_PER_KERNEL = 64
FOREACH_ELEMENTS_PER_KERNEL = 320 * 65536


def _issuer(phase: str) -> str:
    # Autograd's engine runs backward functions with grad mode off; a checkpoint's recomputation runs
    # forward code from Python with grad mode on, in the middle of the backward.
    if torch.is_inference_mode_enabled():
        return "inference"
    return "engine" if phase == "backward" and not torch.is_grad_enabled() else "python"


def _aligned(name: str, args, outputs, dtype: str) -> bool:
    """Whether a matmul's operands and result have their leading dimensions (the row stride of each matrix,
    as cuBLAS reads it) a multiple of the tensor-core granule. Since cuBLAS 11 tensor cores run any shape;
    what costs is a leading dimension off 16 bytes, which rules out vectorised loads (NVIDIA's Matrix
    Multiplication Background guide; GPT-2's 50,257-token head is the known case). A count of rows (the
    batch's tokens) is no leading dimension: an odd one wastes part of one tile, so a 511-token prompt is
    not costed as an unaligned GEMM."""
    if op_class(name) != "matmul" or dtype not in ("bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2"):
        return True
    granule = 16 if dtype in ("int8", "float8_e4m3fn", "float8_e5m2") else 8
    if name == "headroom.routed_expert_mm":  # its GEMMs are each expert's tokens by [in, out] (x's k is not one)
        return all(int(d) % granule == 0 for d in (args[0].shape[-1], *args[2].shape[-2:]))
    if name in WEIGHT_ONLY_LINEARS:  # x [..., in] by a packed weight [out, ...]: in and out
        return all(int(d) % granule == 0 for d in (args[0].shape[-1], args[1].shape[0]))
    matrices = [t for t in (*args, *outputs) if isinstance(t, torch.Tensor) and t.dim() >= 2]
    return all(ld is None or ld % granule == 0 for ld in map(_leading_dimension, matrices))


def _leading_dimension(matrix: torch.Tensor) -> int | None:
    """The row stride of `matrix`'s last two dimensions as a BLAS reads it (a transposed view's is the
    original's row length); None for a vector (a dimension of one or none: a GEMV, or a rank-1 adapter's
    output) or a broadcast (stride 0, which PyTorch copies before the GEMM), which have none to misalign."""
    rows, columns = matrix.shape[-2:]
    row_stride, column_stride = matrix.stride()[-2:]
    if rows <= 1 or columns <= 1 or not row_stride or not column_stride:
        return None
    return int(max(row_stride, column_stride))


def _nchw(tensors) -> list[torch.Tensor]:
    """The 4-D tensors among `tensors` not laid out channels-last (a channels-innermost kernel transposes
    each); one whose layouts coincide (a single channel, or 1x1 spatial) needs no transpose."""
    return [t for t in tensors if t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last)]


def foreach_kernels(args) -> int:
    """Kernels a foreach op launches on CUDA, from its first tensor list."""
    tensors = next((a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)), [])
    elements = sum(t.numel() for t in tensors)
    return max(1, math.ceil(len(tensors) / FOREACH_TENSORS_PER_KERNEL),
               math.ceil(elements / FOREACH_ELEMENTS_PER_KERNEL))


class _OpCostMode(TorchDispatchMode):
    """Counts FLOPs (PyTorch's flop formulas), bytes read + written and kernels of every op, by shape.

    `fused`: the model is torch.compile'd, whose Inductor fuses chains of elementwise ops into one kernel
    that keeps the intermediates in registers. An elementwise op's output is then written to memory only if
    something outside the chain needs it: a matmul, attention or convolution reads it, or it is still alive
    when its phase ends (saved for the backward, a gradient); one that dies inside the chain never is, and
    an elementwise op reads another's output for free. The optimizer step is not compiled."""

    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.ops: dict[OpShape, int] = defaultdict(int)
        self._phase = "forward"
        self.fused = fused
        # id -> (the tensor, its bytes, its dtype): written by an elementwise op of this phase, not yet stored.
        self._pending: dict[int, tuple[weakref.ref, int, str]] = {}

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        if phase != self._phase:
            self.flush()
        self._phase = phase

    def flush(self) -> None:
        """Store what the fused chains of this phase leave alive (saved tensors, gradients)."""
        for key in list(self._pending):
            self._store(key)

    def _in_registers(self, tensor: torch.Tensor) -> bool:
        entry = self._pending.get(id(tensor))
        return entry is not None and entry[0]() is tensor

    def _hold(self, tensors, dtype: str) -> None:
        for tensor in tensors:
            key = id(tensor)
            self._pending[key] = (weakref.ref(tensor, lambda _, key=key: self._pending.pop(key, None)),
                                  nbytes(tensor), dtype)

    def _store(self, key: int) -> None:
        """The fused chain stores this intermediate after all: one compiled kernel's output, launched from
        Inductor's wrapper (the engine's C++-level issue cost)."""
        ref, size, dtype = self._pending.pop(key)
        if ref() is not None:
            self.ops[OpShape(self._phase, "memory", dtype, 0.0, float(size), 1, "engine")] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        one_kernel = packet in _ONE_KERNEL and fused_norms.lent()
        if packet not in flop_registry and func.namespace != "prim" and not one_kernel:
            # Under inference_mode composite ops (linear, matmul) arrive whole; decompose them, as
            # FlopCounterMode does, so their matmuls are seen and counted.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if func.is_view or func in _NO_KERNEL or func in _ALLOCATION:
            return out  # views and metadata ops alias their input, allocations only reserve: no kernel, no bytes
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        name = str(packet)
        # One kernel per chunk of tensors (foreach ops, the fused optimizers); a fused norm is one kernel.
        multi_tensor = name.startswith(("aten._foreach_", "aten._fused_")) and packet not in _ONE_KERNEL
        if func.namespace == "prim" or (not outputs and not multi_tensor):
            return out  # metadata queries (device, sizes): no kernel; in-place foreach ops return None
        flops = 0.0
        inputs = [] if func in _FILL else [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # A wrapper subclass (torchao's fp8 training tensors, NF4 weights) is costed as the data it holds: its
        # matmul runs in its inner dtype (fp8 via _scaled_mm, below this mode) and reads its inner bytes.
        dtype = next((str(leaf.dtype).removeprefix("torch.") for t in (outputs if func in _FILL else inputs)
                      for leaf in leaves(t)
                      if leaf.is_floating_point()), "other")
        if packet is torch.ops.aten._int_mm:
            # int8 x int8 -> int32 GEMM (ptq-int8): FlopCounterMode has no formula for it, and its
            # operands are not floating point, so its dtype is named here.
            (m, k), n = args[0].shape, args[1].shape[1]
            flops, dtype = 2.0 * m * k * n, "int8"
        elif name in WEIGHT_ONLY_LINEARS:
            # (x [..., in], packed integer weight [out, ...], scales, bits, group): a GEMM of x by the
            # dequantised weight, in x's dtype; its bytes are the packed weight's, as the kernel reads them.
            flops = 2.0 * args[0].numel() * args[1].shape[0]
        elif name == "headroom.routed_expert_mm":
            # (x [T, k, in], chosen [T, k], weight, scales, bits, group) -> [T, k, out]: each token's k rows.
            flops = 2.0 * args[0].numel() * outputs[0].shape[-1]
        elif packet in flop_registry:
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
        elif "scaled_dot_product" in name and ("for_cpu" in name or func.namespace == "headroom"):
            flops = _cpu_attention_flops(name, args)
        fusing = self.fused and self.phase != "optimizer" and op_class(name) == "memory" and not multi_tensor
        if fusing:
            # Reads of the chain's intermediates are free; its outputs are held until someone needs them.
            moved = sum(nbytes(t) for t in inputs if not self._in_registers(t))
            self._hold(outputs, dtype)
        else:
            for t in inputs:  # a kernel outside the chain reads it: the chain must have stored it
                if self._in_registers(t):
                    self._store(id(t))
            moved = sum(nbytes(t) for t in inputs + outputs)
        if name == "headroom.routed_expert_mm":
            moved = _routed_expert_bytes(args, outputs[0])
        moved += second_pass_bytes(name, func, args, kwargs)
        kernels = foreach_kernels(args) if multi_tensor else 1
        nchw = _nchw(inputs + outputs) if op_class(name) == "conv" else []
        shape = OpShape(self.phase, op_class(name), dtype, float(flops), float(moved), kernels, _issuer(self.phase),
                        _aligned(name, args, outputs, dtype), fusing, float(sum(nbytes(t) for t in nchw)), len(nchw),
                        tinygemm=name == "headroom.tinygemm_linear",
                        weight_bits=int(args[3]) if name in WEIGHT_ONLY_LINEARS else 0)
        self.ops[shape] += 1
        return out


def _routed_expert_bytes(args, out: torch.Tensor) -> float:
    """A dropless MoE matmul's bytes: the tokens' rows in and out, and the weights (and scales) of the experts
    its tokens reach, as many as uniform routing touches on average (suites/workloads/moe.py)."""
    x, chosen, weight, scales = args[:4]
    tokens, top_k = chosen.shape
    share = experts_touched(weight.shape[0], top_k, tokens) / weight.shape[0]
    return nbytes(x) + nbytes(chosen) + nbytes(out) \
        + share * (nbytes(weight) + nbytes(scales))


def compiled_optimizer_ops(optimizer: torch.optim.Optimizer) -> dict[OpShape, int]:
    """torchao's low-bit AdamW step as it runs on a GPU: torch.compile fuses each parameter's update
    (dequantise the moments, update, requantise, apply) into one kernel that reads the parameter, its
    gradient and its quantised moments and writes the parameter and the moments back. The eager trace of
    that step would count each of its dozens of elementwise ops as a kernel of its own."""
    ops: dict[OpShape, int] = defaultdict(int)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            states = sum(nbytes(t) for t in optimizer.state[param].values() if isinstance(t, torch.Tensor))
            moved = 2 * nbytes(param) + nbytes(param.grad) + 2 * states
            ops[OpShape("optimizer", "memory", str(param.dtype).removeprefix("torch."), 0.0, float(moved))] += 1
    return ops


def _cpu_attention_flops(name: str, args) -> float:
    """The CPU fused attention ops (and headroom's int8-KV attention) have no flop formula registered;
    use the CUDA ones' formulas (same math) so a trace on the CPU device counts what the GPU's attention
    kernel would do. Grouped-query keys and values count per query head (each is read by its group)."""
    if "int8_kv" in name:  # (q, k, k_scale, v, v_scale, causal)
        tensors = (args[0], args[1], args[3])
    else:
        tensors = args[:3] if "backward" not in name else args[1:4]
    q, k, v = (tuple(t.shape) for t in tensors)
    k, v = (shape[:1] + q[1:2] + shape[2:] for shape in (k, v))
    if "backward" in name:
        return sdpa_backward_flop_count(tuple(args[0].shape), q, k, v)
    return sdpa_flop_count(q, k, v)
