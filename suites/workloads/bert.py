"""BERT: a bidirectional transformer encoder trained to fill in masked tokens (masked LM).

Token + position + segment embeddings, then post-norm layers x = norm(x + attn(x)), x = norm(x + ffn(x))
where every token attends to every other, then an MLM head (dense, GELU, LayerNorm) whose output
projection is tied to the word embedding. Same structure as HuggingFace BertForMaskedLM, no pooler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from suites.workloads.base import AttentionRoles, Batch, MlpRoles, SizeSpec, Traits, Workload

MASK_PROB = 0.15  # fraction of tokens to predict (Devlin et al. 2019, section 3.1)
IGNORE = -100  # cross entropy's ignore_index, the label of unmasked positions as in HuggingFace


@dataclass(frozen=True)
class BertConfig:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    max_positions: int = 512
    type_vocab_size: int = 2
    dropout: float = 0.0  # BERT trained with 0.1; raise it to measure the memory of dropout masks
    norm_eps: float = 1e-12  # HuggingFace's layer_norm_eps for BERT
    # Training runs the MLM head on the masked positions only ("dense sequence output", NVIDIA's
    # DeepLearningExamples BERT, modeling.py): the same loss at about 15% of the head's FLOPs. HuggingFace
    # runs it on every position, the default here.
    dense_mlm_output: bool = False

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")

    @property
    def hidden(self) -> int:
        return 4 * self.n_embd


def mask_token_id(vocab_size: int) -> int:
    return 103 if vocab_size > 103 else vocab_size - 1  # 103 is [MASK] in bert-base-uncased's vocab


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # HF's query, key, value fused in one matmul
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv(x)
        # The attention width is read from qkv's output, not the model width, so a structurally pruned
        # module (fewer heads: fewer qkv rows and proj columns, smaller n_head) keeps working.
        inner = qkv.shape[-1] // 3
        heads = (B, S, self.n_head, inner // self.n_head)
        q, k, v = (t.view(heads).transpose(1, 2) for t in qkv.split(inner, dim=2))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout)  # no padding, so no mask
        return self.proj(y.transpose(1, 2).reshape(B, S, inner))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.up = nn.Linear(cfg.n_embd, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.n_embd)
        self.norm2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.drop(self.attn(x)))
        return self.norm2(x + self.drop(self.down(F.gelu(self.up(x)))))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.position = nn.Embedding(cfg.max_positions, cfg.n_embd)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.n_embd)
        self.norm_emb = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layer))
        # MLM head ("cls.predictions"): its decoder matrix is self.word.weight, read in forward, plus a
        # per-token output bias; HF counts that bias (vocab_size parameters) in the published totals.
        self.head_dense = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.head_norm = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.head_bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # HuggingFace's BertPreTrainedModel: normal(0, initializer_range=0.02), zero biases.
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                predict_at: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at every position, or only at `predict_at` (batch x k indices: the masked positions)."""
        seq = input_ids.shape[1]
        if seq > self.cfg.max_positions:
            raise ValueError(f"sequence of {seq} tokens exceeds max_positions {self.cfg.max_positions}")
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        positions = torch.arange(seq, device=input_ids.device)
        x = self.word(input_ids) + self.position(positions) + self.token_type(token_type_ids)
        x = self.drop(self.norm_emb(x))
        for layer in self.layers:
            x = layer(x)
        if predict_at is not None:
            x = x.gather(1, predict_at.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
        x = self.head_norm(F.gelu(self.head_dense(x)))
        return F.linear(x, self.word.weight, self.head_bias)


def _bert(n_layer: int, n_embd: int, n_head: int, vocab_size: int = 30522) -> dict:
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size)


SIZES = {
    s.name: s
    for s in (
        SizeSpec("smoke", "smoke", _bert(2, 64, 4, vocab_size=512), batch_size=4, seq_len=32),
        SizeSpec(
            "bert-base",
            "standard",
            _bert(12, 768, 12),
            batch_size=32,
            seq_len=128,
            canonical_params=109_514_298,
            canonical_source="HuggingFace bert-base-uncased, BertForMaskedLM",
        ),
        SizeSpec(
            "bert-large",
            "large",
            _bert(24, 1024, 16),
            batch_size=16,
            seq_len=128,
            canonical_params=335_174_458,
            canonical_source="HuggingFace bert-large-uncased, BertForMaskedLM",
        ),
    )
}


def build(size: SizeSpec) -> nn.Module:
    return Bert(BertConfig(**size.config))


def make_batch(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    vocab, seq = size.config["vocab_size"], size.seq_len
    input_ids = torch.randint(0, vocab, (batch_size, seq), generator=generator)
    # Two segments per sample, split at a random point, as in next-sentence pairs.
    split = torch.randint(1, max(seq, 2), (batch_size, 1), generator=generator)
    token_type_ids = (torch.arange(seq) >= split).long()
    # The same number of targets in every sample (15% of the positions, at least one), as BERT's
    # pre-training data fixes max_predictions_per_seq: then the mean loss over any equal split of
    # the batch averages to the whole batch's mean, so gradient accumulation preserves numerics.
    targets = predictions_per_sample(seq)
    draw = torch.rand(batch_size, seq, generator=generator)
    chosen = draw.topk(targets, dim=1).indices
    masked = torch.zeros(batch_size, seq, dtype=torch.bool).scatter_(1, chosen, True)
    labels = torch.where(masked, input_ids, IGNORE)
    input_ids = torch.where(masked, mask_token_id(vocab), input_ids)
    return {"input_ids": input_ids, "token_type_ids": token_type_ids, "labels": labels}


def predictions_per_sample(seq: int) -> int:
    return max(1, round(MASK_PROB * seq))


def masked_positions(labels: torch.Tensor) -> torch.Tensor:
    """Each sample's masked positions (batch x k), k fixed by the sequence length as make_batch fixes it; a
    top-k of the mask rather than nonzero(), so the shape does not depend on the data (fake-tensor traces)."""
    return labels.ne(IGNORE).float().topk(predictions_per_sample(labels.shape[1]), dim=1).indices


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch["input_ids"], batch["token_type_ids"])


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    # Only the masked positions enter the loss: logits for every position (as HuggingFace computes them), or
    # for the masked ones alone (dense_mlm_output), the same loss either way.
    labels = batch["labels"]
    if _config(model).dense_mlm_output:
        positions = masked_positions(labels)
        logits = model(batch["input_ids"], batch["token_type_ids"], positions)
        labels = labels.gather(1, positions)
    else:
        logits = forward(model, batch)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


def _config(model: nn.Module) -> BertConfig:
    """The Bert config of the model or of the Bert inside its wrapper (compile, data-parallel wrappers)."""
    return model.cfg if isinstance(model, Bert) else next(m.cfg for m in model.modules() if isinstance(m, Bert))


def block_lists(model: nn.Module) -> list[nn.Module]:
    return [model.layers]


def forward_flops_per_sample(size: SizeSpec, training: bool = False) -> float:
    """A forward's FLOPs; `training`: the training loss's forward, whose MLM head may score the masked
    positions only (dense_mlm_output), where inference scores every position."""
    cfg, seq = BertConfig(**size.config), size.seq_len
    d = cfg.n_embd
    layer_weights = 4 * d * d + 2 * d * cfg.hidden  # qkv + proj, then the FFN
    attention = 4 * seq * d  # QK^T and AV, 2 * S * d FLOPs each per token
    head = 2 * d * d + 2 * d * cfg.vocab_size  # MLM dense, then the tied decoder
    predicted = predictions_per_sample(seq) if training and cfg.dense_mlm_output else seq
    return float(seq * cfg.n_layer * (2 * layer_weights + attention) + predicted * head)


def train_flops_per_sample(size: SizeSpec) -> float:
    # Backward computes each matmul's grad for both operands, 2x forward; every input needs a grad since
    # the activations descend from the (trainable) embeddings.
    return 3 * forward_flops_per_sample(size, training=True)


WORKLOAD = Workload(
    name="bert",
    kind="encoder",
    sizes=SIZES,
    build=build,
    batch=make_batch,
    loss=loss,
    forward=forward,
    block_lists=block_lists,
    forward_flops_per_sample=forward_flops_per_sample,
    train_flops_per_sample=train_flops_per_sample,
    accuracy_metric="masked-byte-accuracy",
    traits=Traits(uniform_blocks=True, depth_key="n_layer", max_seq_key="max_positions",
                  attention=AttentionRoles(qkv="qkv", out="proj", heads="n_head"), mlp=MlpRoles(up="up", down="down")),
)
