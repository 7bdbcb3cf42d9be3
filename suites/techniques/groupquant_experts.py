"""Group-wise weight-only quantisation of a mixture of experts' batched expert matrices (guide T9).

A MoE layer keeps each projection of its E experts as one [E, in, out] Parameter that torch.bmm multiplies
(suites/workloads/moe.py); in Mixtral-8x7B they are 96% of the weights. Each expert's matrix is stored the
way `group-quant` stores a Linear weight: int8, or int4 packed two to a byte, one scale per group of G
inputs of each output. Served, the layer multiplies by them in its routed matmul (suites/workloads/moe.py,
headroom::routed_expert_mm), which reads only the experts its tokens reach and dequantises them there.

Written by hand: torchao's weight-only configs quantise nn.Linear, and its MoE quantisation
(torchao.prototype.moe_quant) converts its own MoE module types, not this layer.
"""

from __future__ import annotations

import torch
from torch import nn

from suites.techniques.groupquant import _group_size, dequantize, quantize_rows


class GroupQuantExperts(nn.Module):
    """One projection of E experts, [E, in, out] as torch.bmm takes it, stored per expert as an integer
    [out, in] matrix with one scale per group of inputs (GroupQuantLinear's layout, batched). It holds them
    and is not called: the MoE layer multiplies by them (MoE._routed)."""

    def __init__(self, weight: torch.Tensor, bits: int, group_size: int):
        super().__init__()
        self.experts, self.in_features, self.out_features = weight.shape
        self.bits, self.group_size = bits, group_size
        q, scale = quantize_rows(weight.detach().float().transpose(1, 2), bits, group_size)
        self.register_buffer("weight", q)  # [E, out, in] int8, or [E, out, in / 2] packed int4
        self.register_buffer("scales", scale.to(weight.dtype))  # [E, out, in / group], the weights' dtype

    @property
    def quantised_parameters(self) -> int:
        """The parameters the integer matrices stand for (suites/workloads/base.py, count_parameters)."""
        return self.experts * self.in_features * self.out_features

    def dequantize(self) -> torch.Tensor:
        """The float matrices [E, in, out], as the layer multiplies by them."""
        return dequantize(self.weight, self.scales, self.bits, self.group_size, self.out_features,
                          self.in_features).transpose(1, 2)

    def extra_repr(self) -> str:
        return (f"experts={self.experts}, in_features={self.in_features}, out_features={self.out_features}, "
                f"int{self.bits}, group_size={self.group_size}")


def quantise_experts(model: nn.Module, bits: int) -> tuple[int, int, int, int]:
    """Quantise every MoE layer's expert matrices in place: (matrices quantised, matrices kept because their
    inputs do not split into groups, their bytes before, after)."""
    from suites.techniques.expert import moe_layers
    from suites.techniques.quantization import _bytes

    done = kept = before = after = 0
    for layer in moe_layers(model):
        for name in layer.expert_names():
            weight = getattr(layer, name)
            group = _group_size(weight.shape[1], bits)
            if group is None:
                kept += 1
                continue
            quantised = GroupQuantExperts(weight, bits, group)
            before += _bytes([weight])
            after += _bytes(quantised.buffers())
            delattr(layer, name)  # the Parameter gives way to the module that multiplies by its integers
            setattr(layer, name, quantised)
            done += 1
    return done, kept, before, after
