"""The mixture-of-experts layer: capacity dispatch in training, dropless routing when served, and what a
served step reads of its experts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from suites.workloads import WORKLOADS
from suites.workloads import moe as M


def _layer(capacity_factor: float, swiglu: bool = True) -> M.MoE:
    torch.manual_seed(0)
    return M.MoE(n_embd=16, hidden=32, experts=4, top_k=2, capacity_factor=capacity_factor, swiglu=swiglu).eval()


def _dropless(layer: M.MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its k experts one by one, weighted by its softmaxed scores: the definition."""
    out = torch.zeros_like(x)
    for index, token in enumerate(x):
        scores, chosen = layer.router(token).topk(layer.top_k)
        for weight, expert in zip(scores.softmax(-1), chosen.tolist(), strict=True):
            hidden = token @ layer.up[expert]
            hidden = F.silu(token @ layer.gate[expert]) * hidden if layer.swiglu else F.gelu(hidden, approximate="tanh")
            out[index] += weight * (hidden @ layer.down[expert])
    return out


def test_a_served_layer_routes_every_token_to_its_experts_while_training_drops_past_capacity():
    layer, x = _layer(capacity_factor=0.5), torch.randn(12, 16)
    with torch.no_grad():
        served, reference = layer(x), _dropless(layer, x)
    assert torch.allclose(served, reference, rtol=1e-4, atol=1e-7)
    trained = layer(x).detach()  # capacity C = ceil(0.5 * 2 * 12 / 4) = 3 of the 24 choices per expert
    assert (trained - reference).norm() > 0.1 * reference.norm()  # some tokens passed through the residual alone


@pytest.mark.parametrize("swiglu", [True, False])
def test_the_graph_safe_branch_of_the_routed_matmul_gives_the_same_result(swiglu, monkeypatch):
    # Captured into a CUDA graph (compiled serving) the op cannot read how many rows each expert has: every
    # expert multiplies every row and keeps its own. Both branches must agree.
    layer, x = _layer(capacity_factor=1.0, swiglu=swiglu), torch.randn(5, 16)
    with torch.no_grad():
        picked = layer(x)
        monkeypatch.setattr(M, "_capturing", lambda tensor: True)
        fixed = layer(x)
    assert torch.allclose(picked, fixed, rtol=1e-4, atol=1e-7)


def test_tokens_reach_k_experts_alone_and_all_of_them_in_numbers():
    assert M.experts_touched(8, 2, 1) == pytest.approx(2)
    assert M.experts_touched(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5: two tokens often share one
    assert M.experts_touched(8, 2, 64) == pytest.approx(8, rel=1e-6)


def test_a_served_step_does_not_read_the_experts_its_tokens_do_not_reach():
    workload = WORKLOADS["gpt"]
    spec = workload.sizes["moe-smoke"]
    model = workload.build(dataclasses.replace(spec))
    layers = [m for m in model.modules() if isinstance(m, M.MoE)]
    experts = sum(p.numel() * p.element_size() for layer in layers for p in layer.expert_parameters())
    top_k, count = layers[0].top_k, layers[0].experts
    assert M.unread_expert_bytes(model, 1) == round(experts * (1 - top_k / count))
    assert M.unread_expert_bytes(model, 256) < 1e-6 * experts


def test_a_served_layer_under_autocast_computes_its_experts_in_autocasts_dtype():
    # The routed op has no autocast rule: its input is cast as the capacity path's bmm would be.
    layer, x = _layer(capacity_factor=1.0), torch.randn(6, 16)
    with torch.no_grad():
        reference = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            served = layer(x)
    assert served.dtype == torch.bfloat16
    assert (served.float() - reference).norm() < 0.02 * reference.norm()


def test_the_graph_safe_branch_keeps_an_unchosen_experts_overflow_out(monkeypatch):
    layer, x = _layer(capacity_factor=1.0), torch.randn(5, 16).abs()
    with torch.no_grad():
        layer.router.weight[3] = -1.0  # positive inputs: expert 3 scores lowest for every token
        picked = layer(x)
        layer.up[3].fill_(3e38)  # its products overflow to inf, and silu(-inf) * inf is NaN
        layer.gate[3].fill_(-3e38)
        monkeypatch.setattr(M, "_capturing", lambda tensor: True)
        fixed = layer(x)
    assert torch.isfinite(fixed).all() and torch.allclose(picked, fixed, rtol=1e-4, atol=1e-7)
