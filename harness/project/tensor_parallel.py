"""One tensor-parallel rank's part of a model, for the projection: the modules `tensor-parallel` shards
(suites/techniques/parallel.tp_modules) rebuilt at the shapes one rank holds, so the same fake-tensor
trace measures that rank's parameters, activations and matmuls.

Megatron-style tensor parallelism over t ranks (Shoeybi et al. 2019, arXiv:1909.08053, section 3): the
QKV projection and the MLP's first layer (and its gate) keep 1/t of their output rows (whole heads and
neurons), the output projections 1/t of their input columns with their bias whole (added once after
the all-reduce); norms, embeddings and the head stay whole on every rank. Written by hand because
PyTorch's DTensor sharding needs a live process group, which a projection has not.
"""

from __future__ import annotations

import torch
from torch import nn

from suites.techniques.base import Phase, Run, Technique
from suites.techniques.parallel import tp_modules


def _narrowed(layer: nn.Linear, outputs: int | None = None, inputs: int | None = None) -> nn.Linear:
    """A Linear of `layer`'s kind and placement with `outputs` rows and `inputs` columns (None: as is);
    the bias keeps `layer`'s length when only the inputs shrink (a row-parallel layer's is whole)."""
    new = nn.Linear(inputs or layer.in_features, outputs or layer.out_features, bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    new.requires_grad_(layer.weight.requires_grad)
    new.train(layer.training)
    return new


def keep_rank_part(model: nn.Module, workload, ranks: int) -> int:
    """Shrink `model` in place to what one of `ranks` tensor-parallel ranks holds; the modules sharded."""
    attention, mlp = workload.traits.attention, workload.traits.mlp
    modules = tp_modules(model, workload, ranks)
    for module, kind in modules:
        if kind == "attention":
            qkv, out = getattr(module, attention.qkv), getattr(module, attention.out)
            setattr(module, attention.qkv, _narrowed(qkv, outputs=qkv.out_features // ranks))
            setattr(module, attention.out, _narrowed(out, inputs=out.in_features // ranks))
            setattr(module, attention.heads, getattr(module, attention.heads) // ranks)
        else:
            for name in (mlp.up, mlp.gate):
                layer = getattr(module, name, None) if name else None
                if isinstance(layer, nn.Linear):
                    setattr(module, name, _narrowed(layer, outputs=layer.out_features // ranks))
            down = getattr(module, mlp.down)
            setattr(module, mlp.down, _narrowed(down, inputs=down.in_features // ranks))
    return len(modules)


def rank_part(ranks: int) -> Technique:
    """A projection-only technique that keeps one tensor-parallel rank's part of the model."""

    def apply(run: Run) -> None:
        keep_rank_part(run.model, run.workload, ranks)
        run.notes.append(f"one of {ranks} tensor-parallel ranks' part traced: attention and MLP modules at 1/{ranks} "
                         "of their heads and neurons, the rest whole")

    return Technique(id=f"tensor-parallel-rank:t={ranks}", phase=Phase.PARALLEL, changes_numerics=False,
                     summary="one tensor-parallel rank's part of the model (projection only)",
                     check=lambda profile, workload, mode: None, apply=apply)


def activation_width(model: nn.Module, workload) -> int:
    """The width of the activations a row-parallel output all-reduces: the attention's input features."""
    roles = workload.traits.attention
    for module in model.modules():
        if hasattr(module, roles.qkv) and hasattr(module, roles.heads):
            return getattr(module, roles.qkv).in_features
    raise ValueError(f"{workload.name} has no attention module named by its traits")


def sharded_model_figures(workload, spec, ranks: int) -> tuple[nn.Module, int, int]:
    """(the model of `spec` on the meta device as one of `ranks` tensor-parallel ranks holds it, the
    modules sharded, the activation width its all-reduces carry)."""
    with torch.device("meta"):
        model = workload.build(spec)
    sharded = keep_rank_part(model, workload, ranks) if ranks > 1 else 0
    width = activation_width(model, workload) if workload.traits.attention else 0
    return model, sharded, width
