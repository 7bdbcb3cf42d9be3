"""Step time from a per-op roofline: every traced op is costed on its own shape, then the GPU's kernel
time and the host's issue time of each step phase are combined.

- Compute: an op's FLOPs at the *achievable* rate of its dtype (a profile's measured best GEMM, else the
  share of its datasheet a measured sibling tensor-core dtype reaches, else the datasheet derated by
  generation), times its class's efficiency (convolutions on tensor cores; fused
  attention, which on Hopper and Blackwell runs an Ampere-era kernel at a smaller share still), on a
  saturation curve: a GEMM of f FLOPs runs at rate * f / (f + f_half), f_half growing with the SM
  count (small GEMMs leave SMs idle), so it takes (f + f_half) / rate; a decode step's skinny matmuls and
  one-query attention (GEMV, split-K kernels over every SM) pay at most their memory time for the idle SMs.
- Memory: bytes read + written at the datasheet bandwidth times a fitted efficiency (a measured copy rate
  replaces it only where the vendor's constants were never fitted); a served decoder's matmuls and attention
  stream at their own fitted share (decode_fit.toml), weight-only int8/int4 ones slower. An op takes the
  longer of the two, plus a fixed cost per kernel it launches (launch, tail; a foreach op launches one per
  chunk of tensors). A 16-bit GEMM with a dimension off the tensor-core granule runs at a fraction of the
  rate, and so does torchao's int4 weight-only kernel (tinygemm) at any size.
- Host: eager PyTorch spends microseconds per op (Python, dispatcher, autograd), by who issues it
  (Python with autograd, autograd's C++ engine, inference mode), plus cuDNN's set-up per convolution. A phase (forward,
  backward, optimizer) takes (K**p + I**p)**(1/p) for kernel time K and issue time I: the GPU runs ahead
  of a slow host only while big kernels give it the time (p fitted; p = 1 on a CPU, which runs its ops
  as it issues them).
The constants are per vendor and generation (speed_constants.py), fitted and validated on held-out rows
by `benchmarks/projection_calibration.py`. Vectorised with numpy: the fit evaluates the model often.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from harness.metrics import peak_name
from harness.project.speed_constants import SpeedConstants, constants_for
from harness.project.trace import StepTrace
from suites.techniques.offload import HostTraffic

# A training step's phases, then a served decoder's (generation_trace.py): the prompt's prefill and the
# first and last decode steps, between which a decode step's time grows with the cache it reads.
PHASES = ("forward", "backward", "optimizer", "prefill", "decode_first", "decode_last")
GENERATION_PHASES = PHASES[3:]
ISSUERS = ("python", "engine", "inference")
_CLASS_INDEX = {"matmul": 0, "conv": 1, "attention": 2, "memory": 3}
# An unknown SM count (a profile without one) counts as a mid-sized GPU's.
DEFAULT_SM_COUNT = 100


@dataclass(frozen=True)
class TimeEstimate:
    """Projected seconds for one step, and where they go (kernel parts summed over the step's ops)."""

    step_s: float
    compute_s: float  # compute-bound ops at their achievable rate (saturation included)
    memory_s: float   # memory-bound ops at the achievable bandwidth
    launch_s: float   # fixed per-kernel cost
    issue_s: float    # the host's issue time (overlaps the three above)
    notes: tuple[str, ...] = ()
    fitted: bool = True  # whether the GPU's constants were fitted on measurements of its vendor
    phase_s: tuple[tuple[str, float], ...] = ()  # (phase, seconds) adding up to step_s; empty where not split

    @property
    def overhead_s(self) -> float:
        """What the step takes beyond the GPU's busy time: the GPU waiting on the host."""
        return max(0.0, self.step_s - self.compute_s - self.memory_s - self.launch_s)


@dataclass
class OpArrays:
    """The trace's ops as arrays, with what the profile fixes (peaks, bandwidth): the model's input."""

    count: np.ndarray
    flops: np.ndarray
    bytes: np.ndarray
    kernels: np.ndarray
    phase: np.ndarray       # index into PHASES
    issuer: np.ndarray      # index into ISSUERS
    aligned: np.ndarray     # bool: GEMM leading dimensions on the tensor-core granule (op_costs._aligned)
    op_class: np.ndarray    # index into _CLASS_INDEX
    fused: np.ndarray       # bool: an elementwise op inside a compiled kernel (the trace saw the fusion)
    simt: np.ndarray        # bool: an NVIDIA GPU's CUDA cores (fp32 without TF32), not its tensor cores
    achievable: np.ndarray  # measured achievable FLOP/s of the op's dtype, nan where unmeasured
    datasheet: np.ndarray   # dense datasheet FLOP/s of the op's dtype, nan where unknown (0 for no FLOPs)
    sm_count: int
    bandwidth: float | None       # datasheet bytes/s
    achievable_bandwidth: float | None
    host_is_device: bool
    # Matmuls and attention of a served decoder's prefill and decode: they stream weights and the KV
    # cache in long sequential reads, which reach more of the bandwidth than a training step's mix.
    streaming: np.ndarray | None = None
    compiled: bool = False  # torch.compile'd (the `compile` technique)
    cuda_graphs: bool = False  # ... and replayed as CUDA graphs (served: mode reduce-overhead)
    host: HostTraffic | None = None  # an offloaded optimizer's transfers and host step
    host_link_bytes_s: float | None = None  # one direction of the host link
    notes: list[str] = field(default_factory=list)
    # A convolution's operands not laid out channels-last, where the device transposes them (bytes, tensors).
    nchw_bytes: np.ndarray | None = None
    nchw_tensors: np.ndarray | None = None
    vendor: str = ""
    tinygemm: np.ndarray | None = None  # bool: torchao's int4 tinygemm matmul (its own rate)
    weight_bits: np.ndarray | None = None  # a weight-only matmul's packed weight bits (8, 4), else 0


# Tensor-core dtypes whose unmeasured rate is read off a measured sibling's share of its datasheet.
_SHARED_TENSOR_RATES = ("bf16", "fp16", "tf32")


def achievable_rate(profile, name: str) -> tuple[float, str | None]:
    """The achievable FLOP/s of `name` on `profile` and, where it is borrowed, the dtype it is borrowed from.

    A measured figure wins. Else a 16-bit or TF32 rate takes the share of its datasheet that the profile's
    measured bf16 (or fp16) reaches: the same tensor cores at the same power-limited clocks. Measured
    pairs bear it out within 10%: TF32's share over bf16's is 1.01 on an H100 SXM, 0.97 on an H100 PCIe,
    0.96 on an H800 PCIe, 0.92 on an A100 PCIe 40GB, 0.90 on an L4 (zzc0721/torch-performance-test-data
    @9d82827), where a generation's derating would miss that an L4 (72 W) reaches 0.59 of its bf16
    datasheet and an A100 SXM 0.87. NVIDIA parts only (the pairs are all NVIDIA's). nan where nothing measured
    applies (the caller derates by generation)."""
    if name in profile.achievable_flops:
        return profile.achievable_flops[name], None
    if name in _SHARED_TENSOR_RATES and profile.vendor == "nvidia" and profile.peak(name):
        for sibling in ("bf16", "fp16"):
            if sibling in profile.achievable_flops and profile.peak(sibling):
                return profile.peak(name) * profile.achievable_flops[sibling] / profile.peak(sibling), sibling
    return np.nan, None


def op_arrays(trace: StepTrace, profile, tf32_matmul: bool = False, phases: tuple[str, ...] = PHASES) -> OpArrays:
    """The trace's ops in `phases` on `profile` (`tf32_matmul`: fp32 matmuls on TF32 tensor cores)."""
    rows = [(shape, count) for shape, count in trace.ops.items() if shape.phase in phases]
    achievable, datasheet, simt = [], [], []
    for shape, _ in rows:
        if not shape.flops:
            achievable.append(np.nan)
            datasheet.append(0.0)
            simt.append(False)
            continue
        name = peak_name(profile, shape.dtype, convolution=shape.op_class == "conv", tf32_matmul=tf32_matmul)
        simt.append(name == "fp32" and profile.vendor == "nvidia")  # AMD runs fp32 on its matrix cores
        achievable.append(achievable_rate(profile, name)[0] if name else np.nan)
        datasheet.append(profile.peak(name) or np.nan if name else np.nan)
    notes = []
    used = sorted({peak_name(profile, s.dtype, s.op_class == "conv", tf32_matmul) for s, _ in rows if s.flops} - {None})
    shared = [f"{n} at the share of its datasheet that the measured {achievable_rate(profile, n)[1]} reaches"
              for n in used if n not in profile.achievable_flops and achievable_rate(profile, n)[1]]
    derated = [n for n in used if np.isnan(achievable_rate(profile, n)[0])]
    if shared:
        notes.append(f"no measured matmul rate for {'; '.join(shared)} on {profile.id}")
    if derated:
        notes.append(f"no measured matmul rate for {', '.join(derated)} on {profile.id}: "
                     "datasheet derated by generation")

    def column(values, dtype=float) -> np.ndarray:
        return np.array(values, dtype=dtype)

    return OpArrays(
        count=column([c for _, c in rows]), flops=column([s.flops for s, _ in rows]),
        bytes=column([s.bytes for s, _ in rows]), kernels=column([s.kernels for s, _ in rows]),
        phase=column([PHASES.index(s.phase) for s, _ in rows], int),
        issuer=column([ISSUERS.index(s.issuer) for s, _ in rows], int),
        aligned=column([s.aligned for s, _ in rows], bool),
        op_class=column([_CLASS_INDEX[s.op_class] for s, _ in rows], int),
        fused=column([s.fused for s, _ in rows], bool), simt=column(simt, bool),
        achievable=column(achievable), datasheet=column(datasheet), sm_count=profile.sm_count or DEFAULT_SM_COUNT,
        bandwidth=profile.memory_bandwidth_bytes_s, achievable_bandwidth=profile.achievable_bandwidth_bytes_s,
        host_is_device=profile.vendor == "cpu",
        streaming=column([s.phase in GENERATION_PHASES and s.op_class in ("matmul", "attention")
                          for s, _ in rows], bool),
        compiled=trace.compiled, cuda_graphs=trace.compiled and not any(s.phase == "backward" for s in trace.ops),
        host=trace.host if "optimizer" in phases else None, host_link_bytes_s=host_link_bytes_s(profile),
        notes=notes, nchw_bytes=column([s.nchw_bytes for s, _ in rows]),
        nchw_tensors=column([s.nchw_tensors for s, _ in rows]), vendor=profile.vendor,
        tinygemm=column([s.tinygemm for s, _ in rows], bool), weight_bits=column([s.weight_bits for s, _ in rows], int))


def step_time(ops: OpArrays, constants: SpeedConstants) -> TimeEstimate | None:
    """The model itself: step seconds of `ops` under `constants`; None when a peak or bandwidth is unknown."""
    gpu, host = constants.gpu, constants.host
    # A fitted vendor's bandwidth efficiency was fitted against datasheet bandwidth (it absorbs what the
    # trace's byte counts miss), so a measured copy rate is used only where nothing was fitted.
    measured = ops.achievable_bandwidth if not gpu.fitted else None
    bandwidth = measured or (ops.bandwidth * gpu.bandwidth_efficiency if ops.bandwidth else None)
    notes = list(ops.notes)
    if not measured and bandwidth:
        notes.append(f"bandwidth: datasheet derated by the {'fitted' if gpu.fitted else 'prior'} efficiency "
                     f"{gpu.bandwidth_efficiency:.2f}")
    rate = np.where(np.isnan(ops.achievable), ops.datasheet * gpu.matmul_derating, ops.achievable)
    has_flops = ops.flops > 0
    if not bandwidth or np.isnan(rate[has_flops]).any():
        return None
    # Convolutions on tensor cores reach a far smaller share of their peak than GEMMs do (implicit-GEMM
    # lowering, NCHW layouts, small channel counts): NVIDIA's published ResNet-50 runs use about 15% of
    # an A100's TF32 peak, against over half of a V100's fp32 peak on its CUDA cores. So the fitted conv
    # efficiency applies on tensor cores; a CUDA-core convolution runs at the achievable rate like a GEMM.
    # (Those 15% are of the whole step: its layout transposes, memory-bound ops and host time take most of
    # the gap, so the fitted efficiency of the convolutions themselves is far higher.)
    conv_efficiency = np.where(ops.simt, 1.0, gpu.conv_efficiency)
    # Fused attention on tensor cores runs PyTorch's FlashAttention-2 kernel, which uses a smaller share of
    # a newer generation's peak than of Ampere's (speed_constants.toml); fp32 attention on CUDA cores does not.
    attention_efficiency = gpu.attention_efficiency * np.where(ops.simt, 1.0, gpu.attention_generation_scale)
    rate = rate * np.choose(ops.op_class, [1.0, conv_efficiency, attention_efficiency, 1.0])
    rate = np.where(ops.aligned, rate, rate * gpu.unaligned_efficiency)
    memory = ops.bytes / bandwidth
    if ops.streaming is not None and ops.streaming.any():
        # A fitted stream efficiency (decode_fit.toml) was fitted against datasheet bandwidth, as the training
        # fit's was, so it stands; where the decode was never fitted, a measured copy rate replaces the prior.
        measured_stream = ops.achievable_bandwidth if not gpu.decode_fitted else None
        stream = measured_stream or (ops.bandwidth * gpu.stream_bandwidth_efficiency)
        # A weight-only kernel streams its packed weight slower than a bf16 matmul streams its own: it unpacks
        # and scales every element on the way (torchao's one-row decodes: speed_constants.toml).
        share = np.ones(len(ops.count))
        if ops.weight_bits is not None:
            share = np.select([ops.weight_bits == 8, ops.weight_bits == 4],
                              [gpu.int8_weight_stream_share, gpu.int4_weight_stream_share], 1.0)
        memory = np.where(ops.streaming, ops.bytes / (stream * share), memory)
        fitted_or_prior = "fitted" if gpu.decode_fitted else "prior"
        streamed_at = ("the measured copy rate" if measured_stream else
                       f"{gpu.stream_bandwidth_efficiency:.2f} of the datasheet bandwidth ({fitted_or_prior})")
        notes.append(f"prefill/decode matmuls and attention stream at {streamed_at}")
        for bits in (8, 4):
            if ops.weight_bits is not None and (ops.streaming & (ops.weight_bits == bits)).any():
                notes.append(f"int{bits} weight-only matmuls stream their packed weights at "
                             f"{getattr(gpu, f'int{bits}_weight_stream_share'):.2f} of that rate ({fitted_or_prior}): "
                             "they dequantise on the way")
    # The saturation curve's cost, f_half / rate, is the time an under-filled wave of output tiles leaves SMs
    # idle. A decode step's matmuls are a few rows (the batch) by a weight, and its attention one query by the
    # cache: cuBLAS runs such skinny shapes as GEMV or split-K kernels, and SDPA splits the cache's keys
    # (flash-decoding), over every SM, streaming the weight or cache at bandwidth; so their idle-SM cost is at
    # most their memory time. Uncapped, an fp32 decode GEMM on CUDA cores paid f_half / fp32 rate
    # (0.13 ms on an A100, 25x its weight's read) and an A10 decoded faster than an A100 with 2.6x its bandwidth.
    saturation_s = gpu.saturation_flops_per_sm * ops.sm_count / np.where(has_flops, rate, 1.0)
    decoding = np.isin(ops.phase, [PHASES.index("decode_first"), PHASES.index("decode_last")])
    skinny = decoding & np.isin(ops.op_class, [_CLASS_INDEX["matmul"], _CLASS_INDEX["attention"]])
    saturation_s = np.where(skinny, np.minimum(saturation_s, memory), saturation_s)
    # torchao's int4 tinygemm multiplies at a fraction of the bf16 rate at any row count (speed_constants.toml);
    # its under-filled waves leave SMs idle as a bf16 GEMM's do, so the saturation cost stays the bf16 one.
    if ops.tinygemm is not None and ops.tinygemm.any():
        rate = np.where(ops.tinygemm, rate * gpu.tinygemm_efficiency, rate)
        notes.append(f"int4 matmuls run torchao's tinygemm at {gpu.tinygemm_efficiency:.3f} of the bf16 rate (prior): "
                     "a prefill, or a decode batch of a few dozen sequences, multiplies slower than in bf16")
    compute = np.where(has_flops, ops.flops / np.where(has_flops, rate, 1.0) + saturation_s, 0.0)
    launch = ops.kernels * gpu.kernel_s
    transposes = layout_transposes_s(ops, bandwidth, gpu.kernel_s)
    issue_per_op = (np.array([constants.issue_s[i] for i in ISSUERS])[ops.issuer]
                    + np.where(ops.op_class == _CLASS_INDEX["conv"], host.issue_conv_s, 0.0)) * ops.count
    if ops.compiled:
        # torch.compile fuses elementwise ops into their neighbours' kernels (their bytes still move, in
        # the fused kernel). Served, CUDA graphs replay the whole step with one launch: no per-op host cost.
        # Trained, the compiled forward and backward launch their remaining kernels from Inductor's wrapper
        # without autograd's per-op recording (costed as the engine's C++ dispatch), and the optimizer step
        # stays eager.
        graph = ops.phase != PHASES.index("optimizer")
        # Where the trace followed the fusion (a compiled training step), its marks say which ops it took in
        # and its stores are the fused kernels; otherwise (a served graph) every elementwise op is fused.
        fused = ops.fused if ops.fused.any() else graph & (ops.op_class == _CLASS_INDEX["memory"])
        launch = np.where(fused, 0.0, launch)
        wrapper = 0.0 if ops.cuda_graphs else constants.issue_s["engine"]
        issue_per_op = np.where(fused, 0.0, np.where(graph, wrapper * ops.count, issue_per_op))
    kernel = (np.maximum(compute, memory) + launch + transposes) * ops.count
    p = 1.0 if ops.host_is_device else host.overlap
    step = 0.0
    phase_s = {}
    for index in range(len(PHASES)):
        in_phase = ops.phase == index
        k, i = kernel[in_phase].sum(), issue_per_op[in_phase].sum()
        if k or i:
            phase_s[PHASES[index]] = (k**p + i**p) ** (1 / p)
            step += phase_s[PHASES[index]]
    if ops.host is not None:
        if not ops.host_link_bytes_s:
            return None
        phase_s["host offload"] = offload_s(ops.host, ops.host_link_bytes_s, phase_s.get("backward", 0.0), notes)
        step += phase_s["host offload"]
    compute_bound = compute >= memory
    if not gpu.fitted:
        notes.append(f"speed constants for {constants.key} not fitted on any measurement (priors)")
    return TimeEstimate(
        step_s=float(step), compute_s=float((compute * ops.count)[compute_bound].sum()),
        memory_s=float((memory * ops.count)[~compute_bound].sum() + (transposes * ops.count).sum()),
        launch_s=float((launch * ops.count).sum()),
        issue_s=float(issue_per_op.sum()), notes=tuple(notes), fitted=gpu.fitted,
        phase_s=tuple((name, float(seconds)) for name, seconds in phase_s.items()))


def where_the_step_goes(time: TimeEstimate) -> str | None:
    """A note splitting a projected step by phase and by what bounds its kernels: which part a technique
    moves (checkpointing lengthens the backward; adapters add memory-bound elementwise kernels; a compiled
    step drops launches and host issue). None where the estimate was not split by phase."""
    if not time.phase_s:
        return None

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:,.1f}" if seconds < 0.1 else f"{seconds * 1e3:,.0f}"

    phases = ", ".join(f"{name} {ms(seconds)}" for name, seconds in time.phase_s)
    # What the step takes beyond the GPU's busy time, less the host offload's own phase: the host's issue.
    waits = time.overhead_s - dict(time.phase_s).get("host offload", 0.0)
    return (f"where the step goes: {phases} ms; kernels bound by compute {ms(time.compute_s)} ms, by memory "
            f"{ms(time.memory_s)} ms, launches {ms(time.launch_s)} ms; the host issues ops for {ms(time.issue_s)} ms, "
            f"overlapping the kernels" + (f" (the GPU waits {ms(waits)} ms on it)" if waits >= 0.01 * time.step_s
                                          else ""))


def layout_transposes_s(ops: OpArrays, bandwidth: float, kernel_s: float) -> np.ndarray:
    """Per op, the seconds of the layout transposes around an NCHW convolution: each operand read and
    written once more, one kernel each. cuDNN's tensor-core convolutions compute channels-innermost and
    transpose NCHW operands in and the result out (NVIDIA's Convolutional Layers guide, "Tensor layouts in
    memory"), as oneDNN reorders on a CPU; cuDNN's fp32 CUDA-core kernels and AMD's MIOpen, whose native
    layout is NCHW, do not. A compiled step has none: Inductor's layout optimisation runs a convolutional
    network's convolutions channels-last (torch/_inductor/config.py, `layout_optimization`, on for CUDA)."""
    if ops.nchw_bytes is None or ops.compiled or not (ops.host_is_device or ops.vendor == "nvidia"):
        return np.zeros(len(ops.count))
    transposed = (ops.op_class == _CLASS_INDEX["conv"]) & ~ops.simt
    return np.where(transposed, 2 * ops.nchw_bytes / bandwidth + ops.nchw_tensors * kernel_s, 0.0)


# The host link's datasheet figure is both directions together; one direction carries half, and pinned
# copies reach about 80% of that (CUDA samples' bandwidthTest: about 26 of PCIe Gen4 x16's 32 GB/s).
HOST_LINK_EFFICIENCY = 0.8
# An assumption, not a measurement: the host's fused AdamW streams 7 tensors' bytes per parameter; we take
# 84 GB/s of host memory traffic (3 billion fp32 parameters a second), within what a two-socket server's
# DDR4/DDR5 channels carry. Every row that uses it says so.
HOST_ADAMW_BYTES_S = 84e9


def host_link_bytes_s(profile) -> float | None:
    """One direction of the profile's host link, as pinned copies reach it; None where unknown."""
    both = (profile.interconnect or {}).get("host_link_gb_s")
    return both * 1e9 / 2 * HOST_LINK_EFFICIENCY if both else None


def offload_s(host: HostTraffic, link_bytes_s: float, backward_s: float, notes: list[str]) -> float:
    """Seconds an offloaded optimizer adds to a step: gradients leave during the backward (only what does
    not fit under it shows), then the host's AdamW and the parameters' return run as a per-parameter
    pipeline, the slower of the two setting the pace."""
    to_host = host.to_host / link_bytes_s
    host_step = host.host_step / HOST_ADAMW_BYTES_S
    to_device = host.to_device / link_bytes_s
    notes.append(f"optimizer offload: gradients to the host {to_host * 1e3:.1f} ms (under a {backward_s * 1e3:.1f} "
                 f"ms backward), host AdamW {host_step * 1e3:.1f} ms at an assumed {HOST_ADAMW_BYTES_S / 1e9:.0f} GB/s "
                 f"(not measured), parameters back {to_device * 1e3:.1f} ms over the host link")
    return max(0.0, to_host - backward_s) + max(host_step, to_device)


def estimate(trace: StepTrace, profile, constants: SpeedConstants | None = None, tf32_matmul: bool = False,
             phases: tuple[str, ...] = PHASES) -> TimeEstimate | None:
    """Step time of `trace` on `profile`; None when a needed peak or the bandwidth is unknown.

    `tf32_matmul` models `torch.backends.cuda.matmul.allow_tf32 = True` (the `tf32` technique);
    `phases` selects parts of the step (e.g. leave out the optimizer when it is amortised)."""
    return step_time(op_arrays(trace, profile, tf32_matmul, phases), constants or constants_for(profile))
