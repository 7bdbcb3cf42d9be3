"""CUDA's autocast op lists applied to CPU traces: op by op, restored on exit, and in a projection."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import harness.project.trace as trace_module
from harness.profiles import load_profiles
from harness.project import traced
from harness.project.autocast_policy import (
    CPU_ONLY,
    CUDA_FP32,
    CUDA_FP32_SET_OPT_DTYPE,
    CUDA_LOWER_PRECISION_EXTRA,
    CUDA_PROMOTE,
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
    names = CUDA_FP32 + CUDA_FP32_SET_OPT_DTYPE + CUDA_PROMOTE + CUDA_LOWER_PRECISION_EXTRA + CPU_ONLY
    assert [name for name in names if _op(name) is None] == []


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
    assert loss.grad_fn.next_functions[0][0].name() == "ToCopyBackward0"  # nll_loss's fp32 cast
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


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

    cuda = traced(workload, spec, parse_stack("amp-bf16"), mode, 4, profile)
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
