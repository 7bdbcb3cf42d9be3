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
import functools
import math
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from harness.cell import ResolvedCell
from harness.project.autocast_policy import cuda_autocast_policy
from harness.project.fused_norms import cuda_fused_rms_norm
from harness.project.lean_import import import_mem_tracker, quiet_module_tracking
from harness.project.op_costs import OpCost, OpShape, _OpCostMode, compiled_optimizer_ops, op_class
from harness.project.weight_casts import WeightCasts
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
    micro_batches: int = 1  # forward/backward passes per optimizer step (grad-accumulation)
    # A served decoder's generation (generation_trace.py): ops in phases prefill, decode_first and
    # decode_last; its KV cache's bytes and the weight bytes a decode step does not stream: tables it reads one
    # row of, and the experts its tokens do not reach (a mixture of experts, served dropless).
    gen_len: int | None = None
    kv_cache_bytes: int = 0
    gathered_bytes: int = 0
    host: HostTraffic | None = None  # an offloaded optimizer's host side (suites/techniques/offload.py)
    # Of the activations: autocast's copies of the weights that the backward keeps (weight_casts.py)
    weight_cast_bytes: int = 0

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
    """Inside, ops run as `profile` would run them: its attention kernel, its fused RMSNorm, and under
    autocast the target's autocast lists, not the host CPU's (ROCm uses CUDA's)."""
    backend = attention_backend(profile)
    with contextlib.ExitStack() as contexts:
        if backend:
            contexts.enter_context(sdpa_kernel(backend))
        if profile.vendor in ("nvidia", "amd"):
            contexts.enter_context(cuda_fused_rms_norm())
            if run.autocast_dtype is not None:
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

            with tracker, first_matmuls, quiet_module_tracking():
                step(batch, mark=warm_up_mark)
            if step.optimizer:
                tracker.track_external(step.optimizer)  # its state, created above, is now categorised
            baseline = tracker.total
            marks: dict[str, dict[str, int]] = {}

            costs = _OpCostMode(fused=run.compiled)
            phase_after = ({"forward_start": "forward", "forward_end": "backward", "backward_end": "optimizer"}
                           if run.mode == "train" else {})

            # Autocast's weight copies kept for the backward: counted over the (first) training forward.
            casts = WeightCasts(run.model.parameters(), rounding)
            counts_casts = run.mode == "train" and run.autocast_dtype is not None

            def mark(name: str) -> None:
                costs.phase = tracker.phase = phase_after.get(name, costs.phase)
                between_forwards(name)
                if name == "forward_start":
                    forward_started()
                    casts.counting = counts_casts and "forward_end" not in marks
                if name == "forward_end" and casts.counting:
                    casts.counting = False
                    marks["weight_casts"] = {"total": casts.live_bytes()}
                marks.setdefault(name, dict(tracker.by_category(), total=tracker.total))

            measured_from = len(tracker.events)
            tracker.peak = tracker.total
            tracker.at_peak = tracker.by_category()
            tracker.phase_peaks, tracker.phase_at_peak = {}, {}
            # Until the step's forward starts, what is live is the previous step's end (its gradients, until
            # zero_grad frees them): the tail of the optimizer phase, not the forward. Counted as the forward,
            # the forward's peak would switch between this moment and mid-forward as the depth grows, and
            # depth extrapolation from two small depths would join two different moments (depth.py).
            tracker.phase = "optimizer" if run.mode == "train" else "forward"
            with quiet_module_tracking(), tracker, costs, casts, \
                    _blocks_backward_marked(run, tracker) as forward_started:
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
        weight_cast_bytes=marks.get("weight_casts", {}).get("total", 0),
        ops=ops, baseline_bytes=baseline, precision=run.precision, tf32=run.tf32,
        compiled=run.compiled, allocator=run.allocator,
        notes=notes + run.notes,
        phase_peaks=tracker.phase_peaks, phase_at_peak=tracker.phase_at_peak,
        first_matmul_at=tuple(first_matmuls.at.values()), measured_from=measured_from,
        param_count=count_parameters(run.model), micro_batches=run.micro_batches,
        host=getattr(step.optimizer, "traffic", None),
        untraced=tuple(sorted({m.untraced_compute for m in run.model.modules() if hasattr(m, "untraced_compute")})))


# The backward's memory phases: the loss and the model's layers after the repeated blocks (the head); the
# first block's backward; the blocks between; the last block's backward (the first block in the forward) and
# what comes before it. FSDP keeps different things gathered in each (parallel.py). Split so that each phase
# peaks at the same moment at every depth: over the blocks' backward each block frees its activations and adds
# its gradients, so the live bytes move in a straight line from the first block's backward to the last, and
# which end is higher can change with the depth (bert-base at 512 tokens: the end at 2-3 layers, the start from
# 4 on, so one phase for all blocks came out 15% low extrapolated to 12). Between the ends nothing is higher
# than at one of them (identical blocks), so depth extrapolation leaves the middle out.
BACKWARD_PHASES = ("backward", "backward_blocks", "backward_middle", "backward_last_block")
BACKWARD_MIDDLE = "backward_middle"


@contextlib.contextmanager
def _blocks_backward_marked(run: Run, tracker: _RecordingMemTracker):
    """Switch the tracker's backward phase as the gradient reaches each repeated block's output (a tensor
    hook: it adds no node to the graph, so the step traced is unchanged): `backward_blocks` for the block the
    forward called last, `backward_middle` for the ones between, `backward_last_block` for the one it called
    first. Yields the function that starts counting a forward's block calls afresh (each micro-batch's)."""

    # The hooks stay on tensors the graph saves: a weak reference keeps them from tying the tracker (and what
    # it holds) into reference cycles, whose collection would free tensors at a time the allocation log records.
    tracker_ref = weakref.ref(tracker)
    calls = [0]  # block calls in this forward (a recomputation in the backward is not one)

    def on_gradient(number: int, gradient):
        tracker = tracker_ref()
        if tracker is not None and tracker.phase in BACKWARD_PHASES:
            tracker.phase = ("backward_last_block" if number == 0 else "backward_blocks"
                             if number == calls[0] - 1 else BACKWARD_MIDDLE)
        return gradient

    def hook_outputs(module, inputs, output):
        tracker = tracker_ref()
        if tracker is None or tracker.phase != "forward":
            return
        # The block's hidden states (its first output needing a gradient); others (a router's logits for an
        # auxiliary loss) can get theirs while the head's backward still runs.
        hidden = next((t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if hidden is not None:
            hidden.register_hook(functools.partial(on_gradient, calls[0]))
            calls[0] += 1

    def forward_started() -> None:
        calls[0] = 0

    blocks = run.workload.blocks(run.model) if run.mode == "train" and run.pipeline is None else []
    # One hook per module: a list that repeats a module (a shared layer) calls it once per position.
    handles = [block.register_forward_hook(hook_outputs) for block in {id(b): b for b in blocks}.values()]
    try:
        yield forward_started
    finally:
        for handle in handles:
            handle.remove()


def _trace_key(profile, stack) -> tuple:
    """Profiles that trace identically share one trace: the rounding and attention path differ only
    between the host CPU and GPUs, and a technique whose layers depend on the GPU (its `trace_key`) splits
    GPUs further, for the stacks that hold it only."""
    if profile.vendor == "cpu":
        return ("cpu",)
    return ("gpu", *(t.trace_key(profile) for t in stack.techniques if t.trace_key is not None))


_TRACES: dict[tuple, StepTrace] = {}


def traced(cell: ResolvedCell, profile=None) -> StepTrace:
    """The step trace of a cell (on `profile`, default the cell's), computed once per process for all
    profiles that trace alike."""
    profile = profile or cell.profile
    workload, spec = cell.workload, cell.spec
    key = (workload.name, spec.name, tuple(sorted(spec.config.items())), spec.seq_len, spec.image_size,
           spec.gen_len, cell.stack.name, cell.mode, cell.batch_size, _trace_key(profile, cell.stack))
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
