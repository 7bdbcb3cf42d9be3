"""Serving precision: the model held in 16-bit (guide T1 as servers use it) and the KV cache in int8.

`bf16-weights` / `fp16-weights` cast the weights themselves to 16 bits, with no fp32 master copy, which
is how every inference server loads a model (vLLM, TGI, TensorRT-LLM): half the bytes of fp32 to hold
and, since decoding streams every weight per token, about half the time. Weight-only quantisation
(`group-quant`, `group-quant-int4`) stacks on it, with 16-bit activations and scales. `kv-int8` stores a
served decoder's KV cache as int8 with one scale per token and head (suites/kv_cache.py), halving a
16-bit cache, which at long contexts outweighs the model.
"""

from __future__ import annotations

import torch
from torch import nn

from suites.techniques.base import Phase, Run, Technique, always
from suites.techniques.precision import _check_bf16, _check_fp16


def _check_weights(name: str, dtype_check):
    def check(profile, workload, mode):
        if mode != "infer":
            return (f"{name} serves a model in 16 bits; training needs fp32 master weights for its small updates "
                    f"(train with amp-{name[:4]})")
        return dtype_check(profile, workload, mode)

    return check


def cast_floating(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating parameter and buffer to `dtype` (integer buffers keep theirs), keeping shared
    parameters shared. Done by hand rather than `model.to(dtype)`, whose tensor swap fails on the
    projection's fake tensors."""
    cast: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_floating_point() or tensor.dtype == dtype:
                    continue
                if id(tensor) not in cast:
                    data = tensor.detach().to(dtype)
                    cast[id(tensor)] = (nn.Parameter(data, requires_grad=tensor.requires_grad)
                                        if isinstance(tensor, nn.Parameter) else data)
                table[name] = cast[id(tensor)]


def _weights_in(dtype: torch.dtype, label: str):
    def apply(run: Run) -> None:
        before = sum(p.numel() * p.element_size() for p in run.model.parameters())
        cast_floating(run.model, dtype)
        run.input_dtype = dtype
        after = sum(p.numel() * p.element_size() for p in run.model.parameters())
        run.precision = label
        run.notes.append(f"weights held in {label} (no fp32 copy): {before:,} -> {after:,} parameter bytes")

    return apply


def _check_kv_int8(profile, workload, mode):
    if mode != "infer":
        return "kv-int8 quantises the KV cache a served decoder keeps; training keeps none"
    if workload.serving is None:
        return f"kv-int8 quantises a decoder's KV cache; {workload.name} is not served token by token"
    return None


def _apply_kv_int8(run: Run) -> None:
    run.kv_cache = "int8"
    run.notes.append("KV cache int8 with one symmetric scale per token and head (scales in the activations' dtype), "
                     "dequantised inside the attention op; quantising each new token's keys and values adds about two "
                     "dozen small ops per layer to every decode step, which an eager (host-bound) decode pays for: "
                     "with compile they replay in a CUDA graph")


# COMPRESS order 0: after structural changes (an SVD or pruning scores want fp32), before quantisation,
# which then stores 16-bit scales and runs its kernels on 16-bit activations.
BF16_WEIGHTS = Technique(
    id="bf16-weights", phase=Phase.COMPRESS, order=0, changes_numerics=True, guide="T1",
    summary="serve the model in bf16 (weights cast, no fp32 master copy), as inference servers do",
    check=_check_weights("bf16-weights", _check_bf16), apply=_weights_in(torch.bfloat16, "bf16"),
    exclusive="precision", post_training=True)

FP16_WEIGHTS = Technique(
    id="fp16-weights", phase=Phase.COMPRESS, order=0, changes_numerics=True, guide="T1",
    summary="serve the model in fp16 (weights cast, no fp32 master copy)",
    check=_check_weights("fp16-weights", _check_fp16), apply=_weights_in(torch.float16, "fp16"),
    exclusive="precision", post_training=True)

def _apply_compile(run: Run) -> None:
    run.compiled = True  # suites/step.py compiles the model it runs (never a traced, fake-tensor one)
    if run.mode == "train":
        run.notes.append("torch.compile of the model (forward and backward through AOTAutograd, default mode: no "
                         "CUDA graphs; the optimizer step stays eager); compile time is the row's warmup_s")
    else:
        run.notes.append("torch.compile (dynamic shapes; on CUDA mode=reduce-overhead: CUDA graphs, one recorded per "
                         "sequence length, replayed from the second generation on); compile time is the row's "
                         "warmup_s, not in the timed steps")


KV_INT8 = Technique(
    id="kv-int8", phase=Phase.STEP, changes_numerics=True, guide="T8",
    summary="a served decoder's KV cache in int8, one scale per token and head",
    check=_check_kv_int8, apply=_apply_kv_int8, post_training=True)

# Inductor's fused kernels may reorder reductions: the same math, not the same bits.
COMPILE = Technique(
    id="compile", phase=Phase.COMPILE, changes_numerics=True,
    summary="torch.compile the model: fused training steps, or served with CUDA graphs as gpt-fast-style decoders run",
    check=always, apply=_apply_compile, post_training=True)

TECHNIQUES = (BF16_WEIGHTS, FP16_WEIGHTS, KV_INT8, COMPILE)
