"""A mixture-of-experts MLP for the GPT workload's MoE sizes, and the exchange that spreads its experts
over ranks (expert parallelism).

A router scores every token against each of E experts and sends it to its top k (Shazeer et al. 2017;
Mixtral, Jiang et al. 2024: the k scores softmaxed into the weights that mix the experts' outputs). Each
expert is an MLP of the family's kind. Dispatch is by capacity, as GShard (Lepikhin et al. 2020) and
Switch (Fedus et al. 2021) do it: each expert takes at most C = ceil(capacity_factor * k * tokens / E)
tokens, first choices before second ones, and a token past that passes on through the residual alone.
Every shape is then fixed by the batch, not by the routing, which is what lets the projection trace it
on fake tensors and the ranks exchange equal parts (written by hand: PyTorch has no MoE layer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class _LocalAllToAll(torch.autograd.Function):
    """The all-to-all's buffers without the sending (the projection): a fresh output forward and a fresh
    one for the gradient backward, as torch.distributed.nn's all_to_all_single allocates them, so the
    trace holds the send buffer and what arrives both live while each exchange runs."""

    @staticmethod
    def forward(ctx, parts: torch.Tensor) -> torch.Tensor:
        return parts.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous().clone()


class ExpertExchange:
    """Expert parallelism's all-to-all: the capacity buffer [E, C, D] of this rank's tokens goes out in R
    equal parts, one per rank holding E/R experts; this rank gets its experts' tokens from every rank,
    [E/R, R*C, D], and sends their outputs back the same way. With `communicate` False (the projection)
    the same shapes are made from this rank's own buffer, without sending anything."""

    def __init__(self, ranks: int, communicate: bool = True, group=None):
        self.ranks, self.communicate, self.group = ranks, communicate, group

    def _all_to_all(self, parts: torch.Tensor) -> torch.Tensor:
        parts = parts.contiguous()
        if not self.communicate:
            return _LocalAllToAll.apply(parts)
        from torch.distributed.nn.functional import all_to_all_single

        return all_to_all_single(torch.empty_like(parts), parts, group=self.group)

    def dispatch(self, buffer: torch.Tensor) -> torch.Tensor:
        experts, capacity, width = buffer.shape
        local = experts // self.ranks
        received = self._all_to_all(buffer.reshape(self.ranks, local, capacity, width))  # [source, local, C, D]
        return received.transpose(0, 1).reshape(local, self.ranks * capacity, width)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        local, tokens, width = out.shape
        parts = out.reshape(local, self.ranks, tokens // self.ranks, width).transpose(0, 1)
        return self._all_to_all(parts).reshape(local * self.ranks, tokens // self.ranks, width)


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected number of distinct experts `tokens` tokens route to, each to `top_k` of `experts` (uniform
    routing): what a dropless kernel reads of the expert weights. One decoded token reads k of E experts;
    a batch of tokens soon reads them all."""
    return experts * (1 - (1 - top_k / experts) ** tokens)


def _capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on x's device (compiled serving): no host reads allowed."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# Dropless routed matmul, as serving engines run a mixture of experts (vLLM's and SGLang's fused MoE kernels,
# HF Transformers' Mixtral): each token's k chosen experts' matrices only, so a decode step reads the chosen
# experts' weights, not every expert's. One custom op, so the projection's trace costs it as that kernel
# (harness/project/op_costs.py); the body is the reference arithmetic, one matmul per chosen expert. Written
# by hand: PyTorch has no grouped MoE matmul.
@torch.library.custom_op("headroom::routed_expert_mm", mutates_args=())
def routed_expert_mm(x: torch.Tensor, chosen: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bits: int,
                     group_size: int) -> torch.Tensor:
    """x [T, k, in] (each token's input to each of its k experts) times its chosen experts' matrices -> [T, k, out].
    `weight` is [E, in, out] floats (bits 16), or [E, out, in] integers with group scales (groupquant_experts)."""
    out_features = weight.shape[2] if bits == 16 else weight.shape[1]
    out = x.new_zeros((*chosen.shape, out_features))
    # Picking each expert's rows needs their count on the host, which a CUDA graph being captured (compiled
    # serving) cannot wait for: there every expert multiplies every row and keeps its own, in fixed shapes.
    capturing = _capturing(x)
    for expert in range(weight.shape[0]) if capturing else chosen.unique().tolist():
        if bits == 16:
            matrix = weight[expert]
        else:
            from suites.techniques.groupquant import dequantize  # a workload does not import techniques at load

            in_features = weight.shape[2] * (2 if bits == 4 else 1)
            matrix = dequantize(weight[expert], scales[expert], bits, group_size, out_features, in_features).t()
        if capturing:  # where, not a 0/1 product: an unchosen expert's overflow (inf * 0) would give NaN
            out = torch.where((chosen == expert).unsqueeze(-1), (x @ matrix.to(x.dtype)).to(out.dtype), out)
        else:
            rows, slots = (chosen == expert).nonzero(as_tuple=True)
            out[rows, slots] = (x[rows, slots] @ matrix.to(x.dtype)).to(out.dtype)
    return out


@routed_expert_mm.register_fake
def _routed_expert_mm_fake(x, chosen, weight, scales, bits, group_size):
    return x.new_empty((*chosen.shape, weight.shape[2] if bits == 16 else weight.shape[1]))


class MoE(nn.Module):
    """Top-k routed experts in place of a block's MLP (see the module docstring)."""

    def __init__(self, n_embd: int, hidden: int, experts: int, top_k: int, capacity_factor: float, swiglu: bool):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be between 1 and the {experts} experts, got {top_k}")
        self.router = nn.Linear(n_embd, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, n_embd, hidden) * 0.02)
        self.gate = nn.Parameter(torch.randn(experts, n_embd, hidden) * 0.02) if swiglu else None
        self.down = nn.Parameter(torch.randn(experts, hidden, n_embd) * 0.02)
        self.experts, self.top_k, self.capacity_factor, self.swiglu = experts, top_k, capacity_factor, swiglu
        self.exchange: ExpertExchange | None = None

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(self.capacity_factor * self.top_k * tokens / self.experts))

    def keep_experts(self, rank: int, exchange: ExpertExchange) -> None:
        """Keep only this rank's E / R experts (expert parallelism); the exchange brings them their tokens."""
        local = self.experts // exchange.ranks
        for name in ("up", "gate", "down"):
            weight = getattr(self, name)
            if weight is not None:
                setattr(self, name, nn.Parameter(weight.detach()[rank * local:(rank + 1) * local].clone(),
                                                 requires_grad=weight.requires_grad))
        self.exchange = exchange

    def expert_names(self) -> list[str]:
        """The attributes holding the experts' matrices ([E, in, out]; `gate` only for SwiGLU experts)."""
        return [name for name in ("up", "gate", "down") if getattr(self, name) is not None]

    def expert_parameters(self) -> list[nn.Parameter]:
        """The experts' trainable matrices (none once weight-only quantisation replaced them)."""
        return [p for p in (getattr(self, name) for name in self.expert_names()) if isinstance(p, nn.Parameter)]

    def _experts(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [E, C, in] through each expert's `name` matrix: a batched matmul. A matrix that weight-only
        quantisation replaced (suites/techniques/groupquant_experts.py) is dequantised first: only with gradients
        on, since a served model goes through `_routed`."""
        weight = getattr(self, name)
        return torch.bmm(x, weight if isinstance(weight, torch.Tensor) else weight.dequantize().to(x.dtype))

    def _routed(self, name: str, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """x [T, k, in] through each token's chosen experts' `name` matrices (dropless)."""
        weight = getattr(self, name)
        if isinstance(weight, torch.Tensor):
            return routed_expert_mm(x, chosen, weight, weight.new_empty(0), 16, 0)
        return routed_expert_mm(x, chosen, weight.weight, weight.scales, weight.bits, weight.group_size)

    def _served(self, x: torch.Tensor) -> torch.Tensor:
        """Inference without capacity: every token reaches its k experts, as serving engines run it."""
        shape, width = x.shape, x.shape[-1]
        tokens = x.reshape(-1, width)
        scores, chosen = self.router(tokens).float().topk(self.top_k, dim=-1)  # [T, k]
        weights = scores.softmax(dim=-1)
        routed = tokens.unsqueeze(1).expand(-1, self.top_k, -1)
        if torch.is_autocast_enabled(x.device.type):
            # Autocast has no rule for the custom op: its inputs are cast as a matmul's would be (the capacity
            # path's bmm), so it computes, and the projection costs it, in autocast's dtype.
            routed = routed.to(torch.get_autocast_dtype(x.device.type))
        hidden = self._routed("up", routed, chosen)
        hidden = F.silu(self._routed("gate", routed, chosen)) * hidden if self.swiglu else \
            F.gelu(hidden, approximate="tanh")
        out = self._routed("down", hidden, chosen)
        return (out * weights.unsqueeze(-1).to(out.dtype)).sum(1).view(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and self.exchange is None:
            return self._served(x)
        shape, width = x.shape, x.shape[-1]
        tokens = x.reshape(-1, width)
        count, k, experts = tokens.shape[0], self.top_k, self.experts
        scores, chosen = self.router(tokens).float().topk(k, dim=-1)  # [T, k]
        weights = scores.softmax(dim=-1)
        capacity = self.capacity(count)
        # Choice-major order (every token's first choice before any second one): a token's place in its
        # expert's buffer is how many earlier (choice, token) pairs picked that expert.
        expert = chosen.t().reshape(-1)  # [k T]
        picked = F.one_hot(expert, experts)
        place = ((picked.cumsum(0) - 1) * picked).sum(-1)
        slot = torch.where(place < capacity, expert * capacity + place, experts * capacity)  # past it: a spare row
        buffer = tokens.new_zeros(experts * capacity + 1, width).index_add(0, slot, tokens.repeat(k, 1))
        routed = buffer[:-1].view(experts, capacity, width)
        if self.exchange is not None:
            routed = self.exchange.dispatch(routed)
        hidden = self._experts("up", routed)
        hidden = F.silu(self._experts("gate", routed)) * hidden if self.swiglu else F.gelu(hidden, approximate="tanh")
        out = self._experts("down", hidden)
        if self.exchange is not None:
            out = self.exchange.combine(out)
        out = torch.cat([out.reshape(experts * capacity, width), out.new_zeros(1, width)])
        mixed = (out[slot] * weights.t().reshape(-1, 1).to(out.dtype)).view(k, count, width).sum(0)
        return mixed.view(shape)


def unread_expert_bytes(model: nn.Module, tokens: int) -> int:
    """Bytes of expert weights a step of `tokens` tokens does not read (served dropless): each MoE layer's
    expert matrices, stored as they are (floats, or integers and scales), less the experts the tokens reach."""
    unread = 0.0
    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        stored = 0
        for name in layer.expert_names():
            weight = getattr(layer, name)
            tensors = [weight] if isinstance(weight, torch.Tensor) else list(weight.buffers())
            stored += sum(t.numel() * t.element_size() for t in tensors)
        unread += stored * (1 - experts_touched(layer.experts, layer.top_k, tokens) / layer.experts)
    return round(unread)
