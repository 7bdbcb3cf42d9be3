"""Trace one step on fake tensors: where memory goes, in what order, and what each op costs.

The model, batch and optimizer are built under `FakeTensorMode` on the CPU device (autograd on
fake `cuda` tensors aborts without a GPU), so no real memory is used and any size traces in
seconds. A warm-up step creates the optimizer state; the second step is measured by PyTorch's
`MemTracker` (categories: parameters, gradients, optimizer state, activations, temporaries), which
we extend to log every storage allocation and free in order, rounded as the target's allocator
rounds (CUDA: 512 bytes), for the allocator model and the peak; autocast casts by the target's op
lists (autocast_policy.py). A dispatch mode counts each op's FLOPs (`torch.utils.flop_counter`'s
formulas), bytes touched and kernels launched, op by op, for the speed model (speed_model.py).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from harness.cell import ResolvedCell
from harness.measure.tensors import leaves, nbytes
from harness.project.autocast_policy import cuda_autocast_policy
from harness.project.lean_import import import_mem_tracker
from suites.step import Step
from suites.techniques import Run, Stack
from suites.techniques.offload import HostTraffic
from suites.workloads.base import count_parameters

_mem_tracker = import_mem_tracker()
MemTracker, _UpdateType = _mem_tracker.MemTracker, _mem_tracker._UpdateType

# CUDA's caching allocator rounds every request up to a multiple of 512 bytes (PyTorch CUDA notes,
# reference/calibration.md); the CPU allocator reports the requested size.
CUDA_ROUNDING = 512

CATEGORY = {"Parameter": "params", "Buffer": "params", "Gradient": "grads", "Optstate": "optimizer",
            "Activation": "activations", "Temp": "temporaries", "Other": "activations"}


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
    backward) or `inference` (no autograd). `aligned`: a GEMM whose every dimension is a multiple of
    the tensor cores' granule (8 elements of 16 bits, 16 of 8 bits); others run slower kernels
    (NVIDIA's Matrix Multiplication Background guide; GPT-2's vocabulary of 50,257 is the known case)."""

    phase: str
    op_class: str
    dtype: str
    flops: float
    bytes: float
    kernels: int = 1
    issuer: str = "python"
    aligned: bool = True
    fused: bool = False  # an elementwise op inside a compiled kernel: no launch or host cost of its own


@dataclass
class StepTrace:
    """What one traced step allocated and computed (bytes already rounded for the target)."""

    peak_bytes: int
    at_peak: dict[str, int]
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    # ("alloc", id, bytes) / ("free", id, 0), in order, from the parameters through a warm-up step
    # and the traced step
    events: list[tuple[str, int, int]]
    # every traced op by its shape -> how many times it ran; phases: forward, backward, optimizer
    ops: dict[OpShape, int] = field(default_factory=dict)
    baseline_bytes: int = 0  # live before the tracked step (params, optimizer state, batch)
    precision: str = "fp32"
    tf32: bool = False  # fp32 matmuls on TF32 tensor cores (the `tf32` technique)
    compiled: bool = False  # torch.compile'd, replayed as CUDA graphs (the `compile` technique)
    allocator: str = "native"  # the CUDA allocator setting the stack chose (alloc-expandable, alloc-async)
    notes: list[str] = field(default_factory=list)
    # library workspaces -> allocator setting -> peak reserved, filled by the allocator model
    reserved: dict[tuple[int, ...], dict[str, int]] = field(default_factory=dict)
    phase_peaks: dict[str, int] = field(default_factory=dict)  # step phase -> its peak (bytes)
    phase_at_peak: dict[str, dict[str, int]] = field(default_factory=dict)  # ... and the breakdown there
    # Where in `events` each thread that runs matmuls ran its first one (the warm-up's forward, then in
    # training its backward, which CUDA runs on autograd's device thread): a cuBLAS handle takes its
    # workspace from the caching allocator there, after that matmul's output.
    first_matmul_at: tuple[int, ...] = ()
    measured_from: int = 0  # where in `events` the measured step starts (its peak is `peak_bytes`)
    # Compute the trace could not see (modules' `untraced_compute`): the roofline cannot time the step.
    untraced: tuple[str, ...] = ()
    param_count: int = 0  # parameters of the model the stack built (as a measured row counts them)
    # A served decoder's generation (generation_trace.py): ops in phases prefill, decode_first and
    # decode_last; its KV cache's bytes and the bytes of tables a decode step reads one row of.
    gen_len: int | None = None
    kv_cache_bytes: int = 0
    gathered_bytes: int = 0
    host: HostTraffic | None = None  # an offloaded optimizer's host side (suites/techniques/offload.py)

    @property
    def costs(self) -> dict[tuple[str, str, str], OpCost]:
        """(phase, op class, dtype) -> the summed cost of its ops."""
        out: dict[tuple[str, str, str], OpCost] = defaultdict(OpCost)
        for shape, count in self.ops.items():
            cost = out[(shape.phase, shape.op_class, shape.dtype)]
            cost.count += count
            cost.flops += shape.flops * count
            cost.bytes += shape.bytes * count
        return dict(out)

    @property
    def flops(self) -> float:
        return sum(shape.flops * count for shape, count in self.ops.items())


class _NoHook:
    """A removable handle for a hook never installed."""

    def remove(self) -> None:
        return None


_NO_HOOK = _NoHook()


class _RecordingMemTracker(MemTracker):
    """MemTracker that also keeps the ordered allocation log and per-category totals with rounding.

    MemTracker exposes categories and a peak but not the order of allocations, which the caching
    allocator model needs; `_update_snap` is its single choke point for every change, so we log there.
    """

    def __init__(self, rounding: int) -> None:
        super().__init__()
        self.rounding = rounding
        self.live: dict[int, tuple[int, str]] = {}
        self.categories: dict[str, int] = defaultdict(int)  # category -> live bytes
        self.total = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self.events: list[tuple[str, int, int]] = []
        # id(winfo) -> the key its allocation is logged under. An id is reused once its object is collected,
        # and when that happens depends on the whole process's garbage collection: keys numbered in order
        # make the log the same in every process (the fragmentation probe tells transient tensors apart by key).
        self.keys: dict[int, int] = {}
        self.next_key = 0
        # The peak of each step phase, with its breakdown: peaks of different phases grow at different
        # rates with depth, so depth extrapolation extrapolates each and takes the largest.
        self.phase = "forward"
        self.phase_peaks: dict[str, int] = {}
        self.phase_at_peak: dict[str, dict[str, int]] = {}

    def _rounded(self, nbytes: int) -> int:
        return math.ceil(nbytes / self.rounding) * self.rounding if self.rounding > 1 else nbytes

    def _set(self, key: int, size: int, category: str) -> None:
        old_size, old_category = self.live.get(key, (0, category))
        self.categories[old_category] -= old_size
        self.categories[category] += size
        self.live[key] = (size, category)
        self.total += size - old_size

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed=old_mem_consumed, old_reftype=old_reftype)
        if u_type == _UpdateType.ADD:
            self.keys[id(winfo)] = self.next_key
            self.next_key += 1
        key = self.keys.pop(id(winfo), -1) if u_type == _UpdateType.DEL else self.keys.get(id(winfo), -1)
        category = CATEGORY.get(getattr(winfo.reftype, "value", str(winfo.reftype)), "temporaries")
        if u_type == _UpdateType.ADD:
            size = self._rounded(winfo.mem_consumed)
            self._set(key, size, category)
            self.events.append(("alloc", key, size))
        elif u_type == _UpdateType.DEL:
            if key in self.live:
                self._set(key, 0, category)
                del self.live[key]
            self.events.append(("free", key, 0))
        elif u_type == _UpdateType.REF and key in self.live:
            self._set(key, self.live[key][0], category)
        elif u_type == _UpdateType.SIZE:
            size = self._rounded(winfo.mem_consumed)
            self._set(key, size, category)
            self.events.append(("free", key, 0))
            self.events.append(("alloc", key, size))
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = self.by_category()
        if self.total > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.total
            self.phase_at_peak[self.phase] = self.by_category()

    def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
        # MemTracker puts gradient hooks on every parameter of a module, and a frozen one (requires_grad
        # False: a frozen layer, an adapter's base weight) raises on `register_hook`. It has no gradient
        # to track, so it is entered as hooked already, with handles whose removal does nothing.
        handles = getattr(self, "_param_to_grad_hook_handles", None)
        if handles is not None:
            for param in module.parameters():
                if not param.requires_grad and handles.get(param) is None:
                    handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def _update_peak_stats(self, peak_state) -> None:
        # MemTracker updates every tracked module's peak snapshot after each op (over a weak
        # dictionary of all modules): about 40% of a trace's time, for per-module figures nothing
        # here reads. The step's peak and its breakdown come from the running totals above.
        return None

    def by_category(self) -> dict[str, int]:
        # Kept as running totals: the peaks are read after most allocations of a growing step.
        return {category: size for category, size in self.categories.items() if size}


def op_class(name: str) -> str:
    """Roofline class of an aten op: where its efficiency factor comes from."""
    if "convolution" in name:
        return "conv"
    if "scaled_dot_product" in name:
        return "attention"
    if any(k in name for k in ("mm", "matmul", "linear", "baddbmm")):
        return "matmul"
    return "memory"


_NO_KERNEL = {torch.ops.aten.detach.default, torch.ops.aten.lift_fresh.default}


class _FirstMatmuls(TorchDispatchMode):
    """Notes the allocation log's length after the first matmul of each thread that runs them: the
    forward's, and in training the backward's (`thread` is switched at the step's marks)."""

    def __init__(self, events: list) -> None:
        super().__init__()
        self.events = events
        self.thread = "forward"
        self.at: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.thread not in self.at and op_class(str(func._overloadpacket)) == "matmul":
            self.at[self.thread] = len(self.events)
        return out


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


def _aligned(name: str, args, dtype: str) -> bool:
    """Whether a matmul's operands have every dimension a multiple of the tensor-core granule."""
    if op_class(name) != "matmul" or dtype not in ("bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2"):
        return True
    granule = 16 if dtype in ("int8", "float8_e4m3fn", "float8_e5m2") else 8
    dims = [d for t in args if isinstance(t, torch.Tensor) and t.dim() >= 2 for d in t.shape[-2:]]
    return all(int(d) % granule == 0 for d in dims)


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
        if func._overloadpacket not in flop_registry and func.namespace != "prim":
            # Under inference_mode composite ops (linear, matmul) arrive whole; decompose them, as
            # FlopCounterMode does, so their matmuls are seen and counted.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if func.is_view or func in _NO_KERNEL:
            return out  # views and metadata ops alias their input: no kernel, no bytes moved
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        packet = func._overloadpacket
        name = str(packet)
        multi_tensor = name.startswith(("aten._foreach_", "aten._fused_"))  # one kernel per chunk of tensors
        if func.namespace == "prim" or (not outputs and not multi_tensor):
            return out  # metadata queries (device, sizes): no kernel; in-place foreach ops return None
        flops = 0.0
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        # A wrapper subclass (torchao's fp8 training tensors, NF4 weights) is costed as the data it holds: its
        # matmul runs in its inner dtype (fp8 via _scaled_mm, below this mode) and reads its inner bytes.
        dtype = next((str(leaf.dtype).removeprefix("torch.") for t in inputs for leaf in leaves(t)
                      if leaf.is_floating_point()), "other")
        if packet is torch.ops.aten._int_mm:
            # int8 x int8 -> int32 GEMM (ptq-int8): FlopCounterMode has no formula for it, and its
            # operands are not floating point, so its dtype is named here.
            (m, k), n = args[0].shape, args[1].shape[1]
            flops, dtype = 2.0 * m * k * n, "int8"
        elif name == "headroom.weight_only_linear":
            # (x [..., in], packed integer weight [out, ...], scales, bits, group): a GEMM of x by the
            # dequantised weight, in x's dtype; its bytes are the packed weight's, as the kernel reads them.
            flops = 2.0 * args[0].numel() * args[1].shape[0]
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
        kernels = foreach_kernels(args) if multi_tensor else 1
        shape = OpShape(self.phase, op_class(name), dtype, float(flops), float(moved), kernels, _issuer(self.phase),
                        _aligned(name, args, dtype), fusing)
        self.ops[shape] += 1
        return out


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


def attention_backend(profile) -> SDPBackend | None:
    """The fused attention kernel PyTorch would pick on the target, as far as memory is concerned.

    Flash (sm80+) and memory-efficient attention (any CUDA GPU, ROCm) both keep O(S) state per head
    (output + logsumexp), as the CPU's fused flash kernel used in the trace does; only a device
    with neither would materialise the S x S score matrix (the math path).
    """
    if profile.vendor in ("nvidia", "amd") or profile.has("flash_attention"):
        return None  # let the CPU pick its fused kernel: same saved tensors
    return SDPBackend.MATH


@contextlib.contextmanager
def as_target_runs(profile, run: Run):
    """Inside, ops run as `profile` would run them: its attention kernel, and under autocast the target's
    autocast lists, not the host CPU's (ROCm uses CUDA's)."""
    backend = attention_backend(profile)
    with contextlib.ExitStack() as contexts:
        if backend:
            contexts.enter_context(sdpa_kernel(backend))
        if profile.vendor in ("nvidia", "amd") and run.autocast_dtype is not None:
            contexts.enter_context(cuda_autocast_policy())
        yield


def trace_step(run_factory, stack: Stack, profile, batch_factory) -> StepTrace:
    """Trace one steady-state step of the run `run_factory()` builds, as `profile` would run it."""
    rounding = 1 if profile.vendor == "cpu" else CUDA_ROUNDING
    notes = []
    # torch.compile cannot run on fake tensors (it crashes the process), so compiled functions run eagerly
    # here: the model's compile is skipped anyway (suites/step.py), torchao's low-bit optimizer step is not.
    with FakeTensorMode(allow_non_fake_inputs=False), torch.compiler.set_stance("force_eager"):
        run: Run = run_factory()
        stack.apply(run)
        if run.loss_scaling:
            # GradScaler reads its overflow flag (`.item()`), which fake tensors cannot answer; the
            # scaler's own memory is a few scalars, so the trace runs the step unscaled.
            run.loss_scaling = False
            notes.append("fp16 loss scaling not traced (a few scalars of state)")
        step = Step(run, torch.device("cpu"))
        batch = batch_factory()
        with as_target_runs(profile, run):
            # The log starts where a real process does, with the parameters and the batch, and goes
            # through a warm-up step (which creates the optimizer state) before the measured one: the
            # caching allocator's segments when the measured step starts are shaped by that history
            # (without it, the model's native reserved peak moves by -5% to +16% on the suite's models).
            tracker = _RecordingMemTracker(rounding)
            tracker.track_external(run.model, batch)
            first_matmuls = _FirstMatmuls(tracker.events)

            def between_forwards(name: str) -> None:
                if name == "forward_start":
                    # MemTracker keeps per-module stats for one call of each module, and accumulation
                    # (like the step after the warm-up) calls the model again: clear them (its
                    # categories and our log carry on).
                    tracker.reset_mod_stats()

            def warm_up_mark(name: str) -> None:
                between_forwards(name)
                first_matmuls.thread = {"forward_start": "forward", "forward_end": "backward"}.get(
                    name, first_matmuls.thread)

            with tracker, first_matmuls:
                step(batch, mark=warm_up_mark)
            if step.optimizer:
                tracker.track_external(step.optimizer)  # its state, created above, is now categorised
            baseline = tracker.total
            marks: dict[str, dict[str, int]] = {}

            costs = _OpCostMode(fused=run.compiled)
            phase_after = ({"forward_start": "forward", "forward_end": "backward", "backward_end": "optimizer"}
                           if run.mode == "train" else {})

            def mark(name: str) -> None:
                costs.phase = tracker.phase = phase_after.get(name, costs.phase)
                between_forwards(name)
                marks.setdefault(name, dict(tracker.by_category(), total=tracker.total))

            measured_from = len(tracker.events)
            tracker.peak = tracker.total
            tracker.at_peak = tracker.by_category()
            tracker.phase_peaks, tracker.phase_at_peak = {}, {}
            with tracker, costs:
                step(batch, mark=mark)
                costs.flush()
            end = tracker.by_category()
    ops = dict(costs.ops)
    if step.optimizer is not None and type(step.optimizer).__module__.startswith("torchao"):
        ops = {shape: n for shape, n in ops.items() if shape.phase != "optimizer"}
        ops.update(compiled_optimizer_ops(step.optimizer))
        notes.append("optimizer step traced eagerly (memory: its temporaries are an upper bound) and costed as "
                     "torchao's compiled step runs, one kernel per parameter")
    activations = marks["forward_end"]["total"] - marks["forward_start"]["total"] if run.mode == "train" else (
        tracker.peak - marks["forward_start"]["total"])
    return StepTrace(
        peak_bytes=tracker.peak, at_peak=tracker.at_peak, params_bytes=end.get("params", 0),
        grads_bytes=end.get("grads", 0) if run.mode == "train" else 0,
        optimizer_bytes=end.get("optimizer", 0), activations_bytes=activations, events=tracker.events,
        ops=ops, baseline_bytes=baseline, precision=run.precision, tf32=run.tf32,
        compiled=run.compiled, allocator=run.allocator,
        notes=notes + run.notes,
        phase_peaks=tracker.phase_peaks, phase_at_peak=tracker.phase_at_peak,
        first_matmul_at=tuple(first_matmuls.at.values()), measured_from=measured_from,
        param_count=count_parameters(run.model), host=getattr(step.optimizer, "traffic", None),
        untraced=tuple(sorted({m.untraced_compute for m in run.model.modules() if hasattr(m, "untraced_compute")})))


def _trace_key(profile) -> tuple:
    """Profiles that trace identically share one trace: the rounding and attention path differ only
    between the host CPU and GPUs."""
    return ("cpu",) if profile.vendor == "cpu" else ("gpu",)


_TRACES: dict[tuple, StepTrace] = {}


def traced(cell: ResolvedCell, profile=None) -> StepTrace:
    """The step trace of a cell (on `profile`, default the cell's), computed once per process for all
    profiles that trace alike."""
    profile = profile or cell.profile
    workload, spec = cell.workload, cell.spec
    key = (workload.name, spec.name, tuple(sorted(spec.config.items())), spec.seq_len, spec.image_size,
           spec.gen_len, cell.stack.name, cell.mode, cell.batch_size, _trace_key(profile))
    if key not in _TRACES and cell.mode == "infer" and spec.gen_len is not None and workload.serving is not None:
        from harness.project.generation_trace import trace_generation  # it builds on this module

        _TRACES[key] = trace_generation(cell, profile)
    if key not in _TRACES:
        def run_factory() -> Run:
            return Run(workload=workload, size=spec, mode=cell.mode, profile=profile, model=workload.build(spec),
                       batch_size=cell.batch_size)

        def batch_factory():
            return workload.batch(spec, cell.batch_size, torch.Generator().manual_seed(0))

        _TRACES[key] = trace_step(run_factory, cell.stack, profile, batch_factory)
    return _TRACES[key]
