"""GPT: a decoder-only transformer that predicts each next token from the ones before it.

Pre-norm blocks x + attn(norm(x)), x + mlp(norm(x)) with causal attention. Two families share the code:
`gpt2` (GPT-2/GPT-3: learned positions, LayerNorm, GELU MLP 4x, biases, lm_head tied to the token
embedding) and `llama` (Llama-2/3: rotary positions, RMSNorm, SwiGLU MLP, no biases, untied lm_head,
and in Llama-3 grouped-query attention: several query heads share one key/value head, which shrinks
the KV cache by that factor; Ainslie et al. 2023, arXiv:2305.13245). Served, the model prefills a
prompt into a preallocated KV cache and decodes one token at a time from it (suites/kv_cache.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from suites.kv_cache import KVCache, LayerCache, attention
from suites.workloads.base import (
    AttentionRoles,
    Batch,
    MlpRoles,
    Pipelining,
    Serving,
    SizeSpec,
    Traits,
    VocabularyRoles,
    Workload,
)
from suites.workloads.moe import MoE

FAMILIES = ("gpt2", "llama")


def llama_hidden(n_embd: int, multiple_of: int = 256) -> int:
    """SwiGLU width: 2/3 of 4d (so 3 matrices cost what 2 would), rounded up to `multiple_of`.

    Source: Meta's llama/model.py FeedForward; gives 11008 for d=4096 and 13824 for d=5120.
    """
    hidden = int(2 * 4 * n_embd / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    block_size: int  # longest sequence; also the learned position table's length in `gpt2`
    family: str = "gpt2"
    ffn_hidden: int | None = None  # None: 4d for gpt2, llama_hidden(d) for llama
    dropout: float = 0.0  # nanoGPT's default; raise it to measure the memory of dropout masks
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: one per query head
    n_experts: int = 0  # a mixture of experts in place of each MLP (suites/workloads/moe.py); 0: dense
    top_k: int = 2  # experts per token
    capacity_factor: float = 1.25  # each expert's buffer: this x its even share of the k x tokens (Switch's)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.family == "llama" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"rotary embeddings need an even head size, got {self.n_embd // self.n_head}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 4 * self.n_embd if self.family == "gpt2" else llama_hidden(self.n_embd)


def norm(cfg: GPTConfig) -> nn.Module:
    if cfg.family == "gpt2":
        return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
    return nn.RMSNorm(cfg.n_embd, eps=cfg.norm_eps)


def rope(x: torch.Tensor, theta: float, start: int = 0) -> torch.Tensor:
    """Rotate channel pairs (i, i + hd/2) of x [B, S, H, hd], at positions start..start+S-1, by
    position-dependent angles (HF layout).

    Computed on the fly rather than cached in a buffer so meta-built models need no re-initialisation.
    """
    seq, hd = x.shape[1], x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
    positions = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)
    angles = (positions[:, None] * inv_freq)[:, None, :]  # [S, 1, hd/2]: the same angle for every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        bias = cfg.family == "gpt2"
        # One matmul for q, k and v: n_head query heads, then kv_heads key and kv_heads value heads.
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.kv_groups = cfg.n_head // cfg.kv_heads  # query heads per key/value head (1: multi-head)
        self.rope_theta = cfg.rope_theta if cfg.family == "llama" else None

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, start: int = 0) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv(x)
        # The attention width is read from qkv's output, not the model width, so a structurally pruned
        # module (fewer heads: fewer qkv rows and proj columns, smaller n_head) keeps working.
        kv_heads = self.n_head // self.kv_groups
        size = qkv.shape[-1] // (self.n_head + 2 * kv_heads)
        q, k, v = qkv.split((self.n_head * size, kv_heads * size, kv_heads * size), dim=2)
        q = q.view(B, S, self.n_head, size)
        k, v = (t.view(B, S, kv_heads, size) for t in (k, v))
        if self.rope_theta is not None:
            # As Meta's and torchtitan's Llama: rotate token-major ([B, S, H, hd]), so attention writes its
            # output token-major too and the output projection reads it without a copy; and give v a buffer
            # of its own, as their separate q/k/v projections do, so the fused output's q and k parts die
            # after the rotation instead of staying saved (for backward) behind v.
            q, k = rope(q, self.rope_theta, start), rope(k, self.rope_theta, start)
            v = v.contiguous()
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            y = cache.attend(q, k, v, start)
        else:
            y = attention(q, k, v, dropout=self.dropout if self.training else 0.0)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, S, self.n_head * size)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d, h = cfg.n_embd, cfg.hidden
        self.swiglu = cfg.family == "llama"
        self.up = nn.Linear(d, h, bias=not self.swiglu)
        self.gate = nn.Linear(d, h, bias=False) if self.swiglu else None
        self.proj = nn.Linear(h, d, bias=not self.swiglu)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            h = F.silu(self.gate(x)) * self.up(x)
        else:
            h = F.gelu(self.up(x), approximate="tanh")  # GPT-2's "gelu_new"
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1, self.attn = norm(cfg), CausalSelfAttention(cfg)
        self.norm2 = norm(cfg)
        self.mlp = (MoE(cfg.n_embd, cfg.hidden, cfg.n_experts, cfg.top_k, cfg.capacity_factor, cfg.family == "llama")
                    if cfg.n_experts else MLP(cfg))

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, start: int = 0) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cache, start)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.family == "gpt2" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = norm(cfg)
        # gpt2 ties the output projection to wte by reading wte.weight in forward (no second
        # Parameter to re-tie after a meta build is materialised); llama has its own matrix.
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False) if cfg.family == "llama" else None
        self.apply(self._init_weights)
        # GPT-2 paper: scale the init of projections into the residual stream by 1/sqrt(2 * layers).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None, start: int = 0,
                last_only: bool = False) -> torch.Tensor:
        """Logits of every position of `idx`; with a `cache`, `idx` continues the cached sequence at
        position `start` (its keys and values are written there), and `last_only` computes the logits
        of the last position alone, as a server does to pick the next token."""
        seq = idx.shape[1]
        if start + seq > self.cfg.block_size:
            raise ValueError(f"sequence of {start + seq} tokens exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + seq, device=idx.device))
        x = self.drop(x)
        layers = cache.layers if cache is not None else [None] * len(self.blocks)
        for block, layer in zip(self.blocks, layers, strict=True):
            x = block(x, layer, start)
        x = self.norm_f(x[:, -1:] if last_only else x)
        return logits(x, self.lm_head, self.wte)


def logits(x: torch.Tensor, lm_head: nn.Linear | None, wte: nn.Embedding) -> torch.Tensor:
    """The output projection. GPT-2 reads the embedding matrix (tied) and leaves the logits in the matmul's
    dtype, as nanoGPT does; Llama's own head returns them in fp32, as Meta's reference model does (and
    torchtitan's and HF's losses take them), so its cross-entropy runs in fp32 under autocast too. Under tensor
    parallelism a rank holds some of the embedding's rows: its `gathered_logits` multiplies by them (the logits
    sharded by vocabulary for loss parallelism, or gathered from every rank under a pipeline)."""
    if lm_head is not None:
        return lm_head(x).float()
    gathered = getattr(wte, "gathered_logits", None)
    return gathered(x) if gathered is not None else F.linear(x, wte.weight)


class Stage(nn.Module):
    """One pipeline stage of a GPT: blocks [start, stop), the embeddings on the first stage and the final
    norm and head on the last. GPT-2's head reads the embedding matrix, so the last stage holds it too
    (Megatron-LM's way: both copies start equal and their gradients are summed each step)."""

    def __init__(self, model: GPT, index: int, stages: int):
        super().__init__()
        depth = len(model.blocks)
        if depth % stages:
            raise ValueError(f"{depth} blocks do not split into {stages} equal pipeline stages")
        per = depth // stages
        self.first, self.last = index == 0, index == stages - 1
        self.blocks = nn.ModuleList(model.blocks[index * per:(index + 1) * per])
        tied = model.lm_head is None
        self.wte = model.wte if self.first or (self.last and tied) else None
        self.wpe = model.wpe if self.first else None
        self.drop = model.drop
        self.norm_f = model.norm_f if self.last else None
        self.lm_head = model.lm_head if self.last else None
        self.tied = tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            idx = x
            x = self.wte(idx)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        if not self.last:
            return x
        x = self.norm_f(x)
        return logits(x, self.lm_head, self.wte)

    def tied_parameters(self) -> list[nn.Parameter]:
        """The embedding matrix where the first and the last stage both hold it (GPT-2's tied head)."""
        return [self.wte.weight] if self.tied and (self.first or self.last) and self.wte is not None else []


def logits_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _gpt2(n_layer: int, n_embd: int, n_head: int, block_size: int, vocab_size: int = 50257) -> dict:
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size, block_size=block_size)


def _llama(n_layer: int, n_embd: int, n_head: int) -> dict:
    # Llama-2: 32000-token vocabulary, 4096-token context, RMSNorm eps 1e-5 (Touvron et al. 2023).
    return dict(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=32000, block_size=4096, family="llama"
    )


def _mixtral(n_layer: int, n_embd: int, n_head: int, ffn_hidden: int, experts: int, top_k: int) -> dict:
    # Mixtral: Llama-2's vocabulary, 8 key/value heads, rope theta 1e6, 32k context, SwiGLU experts (Mistral
    # AI's config.json for Mixtral-8x7B-v0.1).
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=8, vocab_size=32000, block_size=32768,
                family="llama", ffn_hidden=ffn_hidden, rope_theta=1e6, n_experts=experts, top_k=top_k)


def _llama3(n_layer: int, n_embd: int, n_head: int, ffn_hidden: int) -> dict:
    # Llama-3/3.1: 8 key/value heads, 128,256-token vocabulary, rope theta 500,000 (Meta's params.json);
    # 3.1's 131,072-token context, which the same shapes serve (Llama 3 herd paper, Dubey et al. 2024).
    return dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=8, vocab_size=128256,
                block_size=131072, family="llama", ffn_hidden=ffn_hidden, rope_theta=500000.0)


SIZES = {
    s.name: s
    for s in (
        SizeSpec("smoke", "smoke", _gpt2(2, 64, 4, block_size=64, vocab_size=512), batch_size=4, seq_len=64),
        SizeSpec(
            "gpt2-124m",
            "standard",
            _gpt2(12, 768, 12, 1024),
            batch_size=8,
            seq_len=1024,
            canonical_params=124_439_808,
            canonical_source="HuggingFace gpt2 (tied lm_head counted once)",
        ),
        SizeSpec(
            "gpt2-350m",
            "large",
            _gpt2(24, 1024, 16, 1024),
            batch_size=8,
            seq_len=1024,
            canonical_params=354_823_168,
            canonical_source="HuggingFace gpt2-medium (tied lm_head counted once)",
        ),
        SizeSpec(
            "gpt2-1.3b",
            "large",
            _gpt2(24, 2048, 16, 2048),
            batch_size=4,
            seq_len=2048,
            # Table 2.1 prints "1.3B" (two significant figures); these shapes count 1.316e9, 1.2% off.
            canonical_params=1_300_000_000,
            canonical_tolerance=0.015,
            canonical_source="Brown et al. 2020, Table 2.1 (GPT-3 XL)",
        ),
        SizeSpec(
            "gpt-7b",
            "large",
            _llama(32, 4096, 32),
            batch_size=1,
            seq_len=4096,
            canonical_params=6_738_415_616,
            canonical_source="HuggingFace meta-llama/Llama-2-7b-hf",
        ),
        SizeSpec(
            "gpt-13b",
            "large",
            _llama(40, 5120, 40),
            batch_size=1,
            seq_len=4096,
            canonical_params=13_015_864_320,
            canonical_source="HuggingFace meta-llama/Llama-2-13b-hf",
        ),
        SizeSpec(
            "llama3-8b",
            "large",
            _llama3(32, 4096, 32, ffn_hidden=14336),
            batch_size=1,
            seq_len=8192,
            canonical_params=8_030_261_248,
            canonical_source="HuggingFace meta-llama/Meta-Llama-3-8B (3.1-8B has the same shapes)",
        ),
        SizeSpec(
            "gpt-70b",
            "large",
            _llama3(80, 8192, 64, ffn_hidden=28672),
            batch_size=1,
            seq_len=8192,
            canonical_params=70_553_706_496,
            canonical_source="HuggingFace meta-llama/Meta-Llama-3-70B (3.1-70B has the same shapes)",
        ),
        # Llama's layout (own head, grouped-query attention, SwiGLU, RMSNorm) small enough for 2 CPU ranks.
        SizeSpec("llama-smoke", "test", dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, vocab_size=512,
                                             block_size=64, family="llama", ffn_hidden=128),
                 batch_size=4, seq_len=64, canonical_params=139_584,
                 canonical_source="no published model: this shape's own count, pinned so a change to the "
                 "llama layers shows (scale test keeps it out of every default plan)"),
        # A mixture of experts small enough for 2 CPU ranks: 4 experts, top 2, capacity for every token
        # (capacity factor 2 = E / k), so no token is dropped and expert parallelism keeps the loss exactly.
        SizeSpec("moe-smoke", "test", {**_gpt2(2, 64, 4, block_size=64, vocab_size=512), "n_experts": 4,
                                        "top_k": 2, "capacity_factor": 2.0}, batch_size=4, seq_len=64,
                 canonical_params=333_440, canonical_source="no published model: this shape's own count, "
                 "pinned so a change to the MoE layer shows (scale test keeps it out of every default plan)"),
        SizeSpec(
            "mixtral-8x7b",
            "large",
            _mixtral(32, 4096, 32, ffn_hidden=14336, experts=8, top_k=2),
            batch_size=1,
            seq_len=4096,
            canonical_params=46_702_792_704,
            canonical_source="HuggingFace mistralai/Mixtral-8x7B-v0.1",
        ),
        SizeSpec(
            "gpt3-175b",
            "large",
            _gpt2(96, 12288, 96, 2048),
            batch_size=1,
            seq_len=2048,
            # "175.0B" in Table 2.1; these shapes count 174.6e9, 0.2% off.
            canonical_params=175_000_000_000,
            canonical_tolerance=0.01,
            canonical_source="Brown et al. 2020, Table 2.1 (GPT-3 175B)",
        ),
    )
}


def build(size: SizeSpec) -> nn.Module:
    return GPT(GPTConfig(**size.config))


def make_batch(size: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    # S + 1 random tokens: the inputs are the first S, the labels the last S (each position's next).
    tokens = torch.randint(0, size.config["vocab_size"], (batch_size, size.seq_len + 1), generator=generator)
    return {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}


def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    return model(batch["input_ids"])


def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    return logits_loss(forward(model, batch), batch["labels"])


def block_lists(model: nn.Module) -> list[nn.Module]:
    return [model.blocks]


def forward_flops_per_sample(size: SizeSpec) -> float:
    cfg, seq = GPTConfig(**size.config), size.seq_len
    d = cfg.n_embd
    mlp_matrices = 3 if cfg.family == "llama" else 2
    qkv = d * (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim  # fewer key/value heads: a narrower qkv
    # A mixture of experts counts the k experts each token uses (model FLOPs) and its router.
    experts = cfg.top_k if cfg.n_experts else 1
    block_weights = qkv + d * d + experts * mlp_matrices * d * cfg.hidden + d * cfg.n_experts
    # QK^T and AV are full S x S matmuls (2 * S * d FLOPs each per token): the math sdpa path computes
    # the masked half too, and that is what FlopCounterMode counts.
    attention = 4 * seq * d
    per_token = cfg.n_layer * (2 * block_weights + attention) + 2 * d * cfg.vocab_size
    return float(seq * per_token)


def train_flops_per_sample(size: SizeSpec) -> float:
    # Backward computes each matmul's grad for both operands, 2x forward; every input needs a grad since
    # the activations descend from the (trainable) token embedding.
    return 3 * forward_flops_per_sample(size)


def new_cache(model: nn.Module, batch_size: int, context: int, dtype: torch.dtype, device: torch.device,
              kind: str = "native") -> KVCache:
    """A KV cache for `batch_size` sequences of `context` tokens, with each layer's own KV head count."""
    heads = [block.attn.n_head // block.attn.kv_groups for block in model.blocks]
    return KVCache(heads, batch_size, context, model.cfg.head_dim, dtype, device, kind)


def serve_forward(model: nn.Module, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """The next-token logits [B, vocab] after `tokens`, which continue the cached sequence at `start`."""
    return model(tokens, cache=cache, start=start, last_only=True)[:, -1]


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of tables a token reads one row of (position table, an untied token embedding), which a
    decode step does not stream; a tied embedding is read whole as the output projection."""
    tables = [model.wpe] if model.wpe is not None else []
    if model.lm_head is not None:
        tables.append(model.wte)
    return sum(t.weight.numel() * t.weight.element_size() for t in tables)


WORKLOAD = Workload(
    name="gpt",
    kind="decoder",
    sizes=SIZES,
    build=build,
    batch=make_batch,
    loss=loss,
    forward=forward,
    block_lists=block_lists,
    forward_flops_per_sample=forward_flops_per_sample,
    train_flops_per_sample=train_flops_per_sample,
    accuracy_metric="bits-per-byte",
    serving=Serving(new_cache=new_cache, forward=serve_forward, gathered_bytes=gathered_bytes),
    pipelining=Pipelining(stage=Stage, loss=logits_loss),
    traits=Traits(uniform_blocks=True, depth_key="n_layer", max_seq_key="block_size",
                  attention=AttentionRoles(qkv="qkv", out="proj", heads="n_head", kv_groups="kv_groups"),
                  mlp=MlpRoles(up="up", gate="gate", down="proj"), residual_entry="drop",
                  vocabulary=VocabularyRoles(embedding="wte", head="lm_head")),
)
