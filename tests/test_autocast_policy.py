"""CUDA's autocast op lists applied to CPU traces: op by op, restored on exit, and in a projection."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import harness.project.trace as trace_module
from harness.cell import Cell
from harness.profiles import load_profiles
from harness.project import traced
from harness.project.autocast_policy import (
    CPU_ONLY,
    CUDA_FP32,
    CUDA_FP32_APPEND_DTYPE,
    CUDA_FP32_SET_OPT_DTYPE,
    CUDA_LOWER_PRECISION_EXTRA,
    CUDA_PROMOTE,
    NOT_IN_2_11,
    NOT_IN_2_14,
    _op,
    cuda_autocast_policy,
)
from suites.techniques import parse_stack
from suites.workloads import WORKLOADS

PROFILES = load_profiles()


def _dtypes_under_autocast(dtype=torch.bfloat16) -> dict[str, torch.dtype]:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    target = torch.randint(0, 8, (4,))
    with torch.autocast("cpu", dtype=dtype):
        h = x @ w
        out = {"matmul": h, "softmax": torch.softmax(h, -1), "layer_norm": F.layer_norm(h, (8,)),
               "sum": h.sum(), "exp": h.exp(), "cross_entropy": F.cross_entropy(h, target),
               "softmax_explicit_dtype": torch.softmax(h, -1, dtype=h.dtype)}
    sum(v.float().sum() for v in out.values()).backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    return {name: value.dtype for name, value in out.items()}


def test_every_listed_op_exists_in_this_torch():
    names = CUDA_FP32 + CUDA_FP32_SET_OPT_DTYPE + CUDA_PROMOTE + CUDA_LOWER_PRECISION_EXTRA + CPU_ONLY + tuple(
        CUDA_FP32_APPEND_DTYPE.values())
    # A typo would be missing from every release: each name must exist on the releases known to have it.
    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    may_lack = set(NOT_IN_2_11 if release < (2, 14) else ()) | set(NOT_IN_2_14 if release > (2, 11) else ())
    assert [name for name in names if _op(name) is None and name not in may_lack] == []


@pytest.mark.parametrize("fake", [False, True], ids=["real", "fake"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_policy_runs_softmax_norms_and_reductions_in_fp32(fake, dtype):
    with FakeTensorMode() if fake else contextlib.nullcontext():
        host = _dtypes_under_autocast(dtype)
        with cuda_autocast_policy():
            cuda = _dtypes_under_autocast(dtype)
    # The CPU's lists leave these in the 16-bit dtype; CUDA's run them in fp32 (autocast_mode.h).
    assert {host[k] for k in ("softmax", "layer_norm", "sum", "exp")} == {dtype}
    assert {cuda[k] for k in ("softmax", "layer_norm", "sum", "exp")} == {torch.float32}
    # Both cast matmuls down; an explicit dtype is never overridden; losses come out in fp32.
    assert host["matmul"] == cuda["matmul"] == dtype
    assert host["softmax_explicit_dtype"] == cuda["softmax_explicit_dtype"] == dtype
    assert host["cross_entropy"] == cuda["cross_entropy"] == torch.float32


def test_cuda_cross_entropy_takes_log_softmax_in_the_logits_dtype():
    # CUDA has no cross_entropy entry: it decomposes to log_softmax(x, dtype=x.dtype) (explicit, so not
    # cast) and nll_loss (fp32). The CPU casts the whole loss to fp32 first.
    logits = torch.randn(4, 8).bfloat16().requires_grad_()
    target = torch.randint(0, 8, (4,))
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(logits, target)
    cast = loss.grad_fn.next_functions[0][0]
    assert cast.name() == "ToCopyBackward0"  # nll_loss's fp32 cast
    log_softmax = cast.next_functions[0][0]
    # The log-probabilities autograd keeps for the backward are bf16 (the CPU's lists keep them in fp32).
    assert log_softmax.name() == "LogSoftmaxBackward0" and log_softmax._saved_result.dtype == torch.bfloat16


def test_cuda_promote_policy_widens_mixed_inputs():
    a, b = torch.randn(8).bfloat16(), torch.randn(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="dtype"):
            torch.dot(a, b)  # the CPU has no promote entry for dot
        with cuda_autocast_policy():
            assert torch.dot(a, b).dtype == torch.float32


def test_leaving_the_context_restores_the_cpu_lists():
    before = _dtypes_under_autocast()
    with cuda_autocast_policy():
        pass
    assert _dtypes_under_autocast() == before
    assert before["softmax"] == torch.bfloat16


@pytest.mark.parametrize("workload_name,mode", [("bert", "infer"), ("gpt", "train")])
def test_gpu_projections_trace_with_the_cuda_lists(monkeypatch, workload_name, mode):
    workload = WORKLOADS[workload_name]
    spec = workload.sizes["smoke"]
    profile = PROFILES["a100-sxm4-80gb"]

    def fp32_memory_ops(trace):
        return sum(cost.count for (phase, kind, dtype), cost in trace.costs.items()
                   if kind == "memory" and dtype == "float32")

    cuda = traced(Cell(workload_name, "smoke", mode, "amp-bf16", profile.id, 4).resolve(PROFILES))
    monkeypatch.setattr(trace_module, "cuda_autocast_policy", contextlib.nullcontext)
    host = trace_module.trace_step(
        lambda: _run(workload, spec, mode, profile), parse_stack("amp-bf16"), profile,
        lambda: workload.batch(spec, 4, torch.Generator().manual_seed(0)))
    # bert: the MLM head's LayerNorm of a bf16 GELU output runs in fp32 on CUDA, in bf16 on the CPU;
    # gpt: CUDA's cross entropy keeps log_softmax in bf16 where the CPU casts the logits to fp32.
    assert fp32_memory_ops(cuda) != fp32_memory_ops(host)
    assert cuda.activations_bytes != host.activations_bytes


def _run(workload, spec, mode, profile):
    from suites.techniques import Run

    return Run(workload=workload, size=spec, mode=mode, profile=profile, model=workload.build(spec), batch_size=4)


# --- against CUDA's own autocast kernels ------------------------------------------------------------
# Fake tensors on the `cuda` device run CUDA's autocast kernels (forward only) without a GPU: the
# oracle the CPU-side policy must agree with, op by op, for this torch's lists.

def test_every_op_on_this_torchs_cuda_lists_is_accounted_for():
    from harness.project import autocast_policy as policy

    known = set(policy.CUDA_FP32 + policy.CUDA_FP32_SET_OPT_DTYPE + policy.CUDA_PROMOTE
                + policy.CUDA_LOWER_PRECISION_EXTRA + policy.CUDA_BANNED + policy.SAME_AS_CPU
                + policy.SHARED_LOWER_PRECISION + tuple(policy.CUDA_FP32_APPEND_DTYPE))
    names = [n.removeprefix("aten::") for n in torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA")
             if n.startswith("aten::")]  # other libraries (torchvision) register their own ops
    assert names and [n for n in names if n not in known] == []


_OPS = {
    "softmax": lambda h, w, t: torch.softmax(h, -1),
    "log_softmax": lambda h, w, t: torch.log_softmax(h, 1),
    "softmax_dtype": lambda h, w, t: torch.softmax(h, -1, dtype=h.dtype),
    "layer_norm": lambda h, w, t: F.layer_norm(h, (8,)),
    "rms_norm": lambda h, w, t: torch.rms_norm(h, (8,)),
    "group_norm": lambda h, w, t: F.group_norm(h.reshape(4, 4, 2), 2),
    "batch_norm": lambda h, w, t: F.batch_norm(h, None, None, training=True),
    "sum": lambda h, w, t: h.sum(),
    "sum_dim": lambda h, w, t: h.sum(-1),
    "mean": lambda h, w, t: h.mean(-1),
    "cumsum": lambda h, w, t: h.cumsum(0),
    "prod": lambda h, w, t: h.prod(),
    "exp": lambda h, w, t: h.exp(),
    "pow": lambda h, w, t: h.pow(2),
    "rsqrt": lambda h, w, t: h.rsqrt(),
    "norm": lambda h, w, t: torch.norm(h),
    "vector_norm": lambda h, w, t: torch.linalg.vector_norm(h, dim=-1),
    "logsumexp": lambda h, w, t: h.logsumexp(-1),
    "gelu": lambda h, w, t: F.gelu(h),
    "silu": lambda h, w, t: F.silu(h),
    "matmul": lambda h, w, t: h @ w,
    "linear": lambda h, w, t: F.linear(w, w),
    "bmm": lambda h, w, t: torch.bmm(w[None], w[None]),
    "conv2d": lambda h, w, t: F.conv2d(w.reshape(1, 1, 8, 8), w[:3, :3].reshape(1, 1, 3, 3)),
    "sdpa": lambda h, w, t: F.scaled_dot_product_attention(w[None, None], w[None, None], w[None, None]),
    "cross_entropy": lambda h, w, t: F.cross_entropy(h, t),
    "nll_loss": lambda h, w, t: F.nll_loss(h, t),
    "mse_loss": lambda h, w, t: F.mse_loss(h, w[:4]),
    "bce_with_logits": lambda h, w, t: F.binary_cross_entropy_with_logits(h, w[:4].sigmoid()),
    "add_mixed": lambda h, w, t: h + w[:4],
    "cat_mixed": lambda h, w, t: torch.cat([h, w[:4]]),
    "addcmul_mixed": lambda h, w, t: torch.addcmul(w[:4], h, h),
    "dot_mixed": lambda h, w, t: torch.dot(h[0], w[0]),
    "mv": lambda h, w, t: torch.mv(w, w[0]),
}


def _output_dtypes(device: str, dtype: torch.dtype) -> dict[str, torch.dtype | str]:
    """Each op's output dtype under `device` autocast at `dtype`, on fake tensors of that device."""
    from torch._subclasses.fake_tensor import FakeTensor

    mode = FakeTensorMode()

    def fake(shape, kind=torch.float32):
        meta = torch.empty(shape, dtype=kind, device="meta")
        return FakeTensor(mode, meta, torch.device(device)) if device == "cuda" else mode.from_tensor(
            torch.empty(shape, dtype=kind))

    enabled, previous = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
    # Set directly: torch.autocast("cuda") turns itself off where CUDA is unavailable.
    torch.set_autocast_enabled(device, True)
    torch.set_autocast_dtype(device, dtype)
    results = {}
    # Made outside the mode: inside it (torch 2.6) the meta tensor would itself come out fake.
    w = fake((8, 8))
    t = fake((4,), torch.long)
    try:
        with mode:
            h = (w[:4] @ w)  # the autocast dtype, as a 16-bit activation would be
            for name, op in _OPS.items():
                try:
                    results[name] = op(h, w, t).dtype
                except RuntimeError as exc:
                    results[name] = f"raises: {type(exc).__name__}"
    finally:
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, previous)
    return results


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_policy_gives_the_dtypes_cudas_own_autocast_gives(dtype):
    try:
        cuda = _output_dtypes("cuda", dtype)
    except RuntimeError as exc:  # torch 2.6 starts the CUDA runtime for fake CUDA tensors
        pytest.skip(f"this torch cannot run fake CUDA tensors without a CUDA driver: {str(exc).splitlines()[0]}")
    with cuda_autocast_policy():
        policy = _output_dtypes("cpu", dtype)
    host = _output_dtypes("cpu", dtype)
    assert cuda["matmul"] == dtype and cuda["softmax"] == torch.float32  # the oracle is CUDA's autocast
    assert {k: v for k, v in policy.items() if v != cuda[k]} == {}
    # ...and the policy matters: the CPU's own lists disagree with CUDA's on these.
    assert {k for k in host if host[k] != cuda[k]} >= {"softmax", "layer_norm", "sum", "exp", "norm"}
