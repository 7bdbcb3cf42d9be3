"""One tensor-parallel rank's part of a model, for the projection: the modules `tensor-parallel` shards
(suites/techniques/tensor_parallel.tp_modules) rebuilt at the shapes one rank holds, so the same fake-tensor
trace measures that rank's parameters, activations and matmuls.

Megatron-style tensor parallelism over t ranks (Shoeybi et al. 2019, arXiv:1909.08053, section 3): the
QKV projection and the MLP's first layer (and its gate) keep 1/t of their output rows (whole heads and
neurons), the output projections 1/t of their input columns with their bias whole (added once after
the all-reduce); the token embedding and the head keep 1/t of the vocabulary's rows, the head's logits
sharded as loss parallelism keeps them (gathered whole on every rank under a pipeline, whose last stage hands
plain logits to its loss); norms and position embeddings stay whole. Written by hand because PyTorch's
DTensor sharding needs a live process group, which a projection has not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from suites.techniques.base import Phase, Run, Technique
from suites.techniques.tensor_parallel import tp_modules
from suites.techniques.vocabulary_parallel import head_vocabulary, vocabulary_modules


def _narrowed(layer: nn.Linear, outputs: int | None = None, inputs: int | None = None) -> nn.Linear:
    """A Linear of `layer`'s kind and placement with `outputs` rows and `inputs` columns (None: as is);
    the bias keeps `layer`'s length when only the inputs shrink (a row-parallel layer's is whole)."""
    new = nn.Linear(inputs or layer.in_features, outputs or layer.out_features, bias=layer.bias is not None,
                    device=layer.weight.device, dtype=layer.weight.dtype)
    new.requires_grad_(layer.weight.requires_grad)
    new.train(layer.training)
    return new


def _gathered(logits: torch.Tensor, ranks: int, vocabulary: int) -> torch.Tensor:
    """A rank's logits over its rows, standing for the all-gather of every rank's with the same shapes and
    bytes (the trace sees sizes, not values): as PyTorch's functional all_gather_tensor does it, the ranks'
    parts stacked along dim 0 in one buffer, then concatenated along the vocabulary."""
    buffer = torch.cat([logits] * ranks)
    whole = torch.cat(buffer.chunk(ranks), dim=-1)
    return whole if whole.shape[-1] == vocabulary else whole[..., :vocabulary]


class _WholeTableGradient(torch.autograd.Function):
    """A lookup into a rank's rows whose weight gradient is first computed for the whole vocabulary, then cut
    to the rank's rows, as the real run does: DTensor has no row-sharded rule for the embedding's backward, so
    every rank computes the whole table's gradient (replicated), and the technique's post-accumulate hook
    keeps a copy of its own rows (suites/techniques/vocabulary_parallel.place_gradient_as_parameter; DTensor's
    Replicate-to-Shard redistribution clones its chunk). V x d in the gradient's dtype, for one moment at the
    end of the backward."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, vocabulary: int) -> torch.Tensor:
        ctx.save_for_backward(tokens)  # as the embedding's own backward keeps its indices
        ctx.vocabulary, ctx.rows = vocabulary, weight.shape[0]
        return nn.functional.embedding(tokens, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        whole = torch.ops.aten.embedding_dense_backward(grad, tokens, ctx.vocabulary, -1, False)
        return None, whole[: ctx.rows].clone(), None


class VocabularyShard(nn.Embedding):
    """One rank's rows of a vocabulary-parallel embedding, as the trace needs it: ceil(V / t) rows (PyTorch
    shards unevenly as torch.chunk does), a lookup of every token into them (the real one masks the tokens
    other ranks hold and all-reduces: the same shapes) whose gradient passes through the whole table's
    (`_WholeTableGradient`), and a tied head's logits over its rows, gathered whole where `gathered`."""

    def __init__(self, embedding: nn.Embedding, ranks: int, gathered: bool):
        super().__init__(-(-embedding.num_embeddings // ranks), embedding.embedding_dim,
                         device=embedding.weight.device, dtype=embedding.weight.dtype)
        self.weight.requires_grad_(embedding.weight.requires_grad)
        self.train(embedding.training)
        self.ranks, self.vocabulary, self.gathered = ranks, embedding.num_embeddings, gathered

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return _WholeTableGradient.apply(tokens.remainder(self.num_embeddings), self.weight, self.vocabulary)

    def gathered_logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.linear(x, self.weight)
        return _gathered(logits, self.ranks, self.vocabulary) if self.gathered else logits


class VocabularyHead(nn.Module):
    """One rank's rows of a vocabulary-parallel head (a column-parallel Linear over the vocabulary), its
    logits all-gathered from every rank where `gathered`, else kept for loss parallelism's cross-entropy."""

    def __init__(self, head: nn.Linear, ranks: int, gathered: bool):
        super().__init__()
        self.part = _narrowed(head, outputs=-(-head.out_features // ranks))
        self.ranks, self.vocabulary, self.gathered = ranks, head.out_features, gathered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.part(x)
        return _gathered(logits, self.ranks, self.vocabulary) if self.gathered else logits


class _ShardedLogSoftmax(torch.autograd.Function):
    """loss_parallel's log-softmax over a rank's logits [N, V / t], as PyTorch computes it
    (torch/distributed/tensor/parallel/loss.py, `_log_softmax`): in fp32 for half-precision logits, returned
    in their dtype and kept for the backward (autograd keeps the op's output). Its all-reduces (a number per
    token) have no process group here and are left out. The backward passes the gradient on as is
    (`_log_softmax_backward_handler`): the softmax's part is done by the nll backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        computed = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        x = logits.to(computed, memory_format=torch.contiguous_format)
        shifted = x - x.amax(-1, keepdim=True)
        result = (shifted - torch.exp(shifted).sum(-1, keepdim=True).log()).to(logits.dtype)
        ctx.save_for_backward(result)
        ctx.dtype = logits.dtype
        return result

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.to(ctx.dtype)


class _ShardedNll(torch.autograd.Function):
    """loss_parallel's mean negative log-likelihood over a rank's log-softmax rows (`_nll_loss_forward`; the
    target taken modulo the rank's rows), and its backward fused with the log-softmax's as PyTorch's
    (`_nll_loss_and_log_softmax_backward`): a one-hot, the exponential, their sum and its product."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        local = target.remainder(x.shape[-1]).unsqueeze(-1)
        ctx.save_for_backward(x, local)
        return -x.gather(-1, local).mean()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, local = ctx.saved_tensors
        one_hot = torch.zeros_like(x).scatter_(-1, local, -1.0)
        return (one_hot + torch.exp(x)) * (grad / local.numel()), None


class ShardedLoss(TorchFunctionMode):
    """The trace's stand-in for `loss_parallel()`: a plain mean cross-entropy over logits sharded by
    vocabulary goes through _ShardedLogSoftmax and _ShardedNll; any other call (class weights, label
    smoothing, another reduction or ignored index) as it is."""

    # cross_entropy hands a mode its defaults as keywords: these are the plain call's.
    PLAIN = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
             "label_smoothing": 0.0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = all(kwargs.get(key, value) == value for key, value in self.PLAIN.items())
        if func is nn.functional.cross_entropy and plain and len(args) >= 2 and args[2:] in ((), (None,)):
            result = _ShardedLogSoftmax.apply(args[0])
            if result.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(result.device.type):
                # CUDA's autocast runs nll_loss in fp32: a copy of the log-softmax, kept for its backward too.
                result = result.float()
            return _ShardedNll.apply(result, args[1])
        return func(*args, **kwargs)


def keep_vocabulary_part(model: nn.Module, workload, ranks: int, gathered: bool = False) -> None:
    """Shrink `model`'s token embedding and head in place to one of `ranks` ranks' vocabulary rows, the
    logits `gathered` whole or kept sharded."""
    for name, kind in vocabulary_modules(model, workload).items():
        layer = getattr(model, name)
        setattr(model, name, VocabularyShard(layer, ranks, gathered) if kind == "embedding"
                else VocabularyHead(layer, ranks, gathered))


def keep_rank_part(model: nn.Module, workload, ranks: int, gathered_logits: bool = False,
                   vocabulary: bool = True) -> int:
    """Shrink `model` in place to what one of `ranks` tensor-parallel ranks holds (its logits gathered whole or,
    by default, sharded for loss parallelism; the embedding and head whole on every rank without `vocabulary`,
    as gpt-fast serves); the modules sharded."""
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
    if vocabulary:
        keep_vocabulary_part(model, workload, ranks, gathered_logits)
    return len(modules)


def rank_part(ranks: int, gathered_logits: bool = False, vocabulary: bool = True) -> Technique:
    """A projection-only technique that keeps one tensor-parallel rank's part of the model (its embedding and
    head whole without `vocabulary`)."""

    def apply(run: Run) -> None:
        found = set(vocabulary_modules(run.model, run.workload).values()) if vocabulary else set()
        head = head_vocabulary(run.model, run.workload) > 0
        layers = "the embedding and the head tied to it" if head and "head" not in found \
            else f"the {' and '.join(sorted(found))}"
        keep_rank_part(run.model, run.workload, ranks, gathered_logits, vocabulary)
        logits = "logits gathered whole" if gathered_logits or not head else "logits sharded, loss parallel"
        if head and not gathered_logits:
            run.loss_context = ShardedLoss
        run.notes.append(f"one of {ranks} tensor-parallel ranks' part traced: attention and MLP modules at 1/{ranks} "
                         f"of their heads and neurons"
                         + (f", {layers} at 1/{ranks} of the vocabulary ({logits})" if found else "")
                         + ", the rest whole")

    # The id names what is traced (traces are cached by the stack's name).
    return Technique(id=f"tensor-parallel-rank:t={ranks}" + ("" if vocabulary else ":vocabulary=whole"),
                     phase=Phase.PARALLEL, changes_numerics=False,
                     summary="one tensor-parallel rank's part of the model (projection only)",
                     check=lambda profile, workload, mode: None, apply=apply)


def activation_width(model: nn.Module, workload) -> int:
    """The width of the activations a row-parallel output all-reduces: the attention's input features."""
    roles = workload.traits.attention
    for module in model.modules():
        if hasattr(module, roles.qkv) and hasattr(module, roles.heads):
            return getattr(module, roles.qkv).in_features
    raise ValueError(f"{workload.name} has no attention module named by its traits")


@dataclass(frozen=True)
class ShardedModel:
    """A model of a spec on the meta device as one tensor-parallel rank holds it, and the figures its
    collectives are costed from."""

    model: nn.Module
    sharded: int  # attention and MLP modules sharded
    width: int  # the activation width their all-reduces carry
    embedding: bool  # the token embedding is vocabulary-parallel (its output all-reduced)
    logits_rows: int  # the vocabulary of the vocabulary-parallel head (0: none)


def sharded_model_figures(workload, spec, ranks: int, vocabulary: bool = True) -> ShardedModel:
    """The model of `spec` on the meta device as one of `ranks` tensor-parallel ranks holds it (its embedding
    and head whole without `vocabulary`), with the figures its tensor-parallel collectives are costed from."""
    with torch.device("meta"):
        model = workload.build(spec)
    found = vocabulary_modules(model, workload) if ranks > 1 and vocabulary else {}
    rows = head_vocabulary(model, workload) if ranks > 1 and vocabulary else 0
    sharded = keep_rank_part(model, workload, ranks, vocabulary=vocabulary) if ranks > 1 else 0
    width = activation_width(model, workload) if workload.traits.attention else 0
    return ShardedModel(model, sharded, width, "embedding" in found.values(), rows)
