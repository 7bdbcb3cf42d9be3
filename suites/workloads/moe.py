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
        """x [E, C, in] through each expert's `name` matrix: a batched matmul, or the module that replaced the
        matrix (suites/techniques/groupquant_experts.py)."""
        weight = getattr(self, name)
        return torch.bmm(x, weight) if isinstance(weight, torch.Tensor) else weight(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
