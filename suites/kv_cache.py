"""The KV cache: the keys and values of every token a decoder has seen, kept so each new token attends to
them without recomputing them.

A server preallocates the cache for the whole context (prompt + generated tokens) and every batch
sequence, then writes each token's keys and values at its position. It holds
2 x layers x kv_heads x head_dim x tokens x batch x bytes per element, which at long contexts outgrows
the weights; decoding one token reads all the weights once for the batch and each sequence's cache, so
decode speed is set by memory bandwidth (Pope et al. 2022, "Efficiently Scaling Transformer
Inference", arXiv:2211.05102). `int8` storage (the `kv-int8` technique) keeps one symmetric scale per
token and head and halves a 16-bit cache; attention reads the int8 values and scales, dequantising in
registers as fused KV-int8 kernels do (vLLM, TensorRT-LLM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KV_KINDS = ("native", "int8")
INT8_MAX = 127


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              dropout: float = 0.0) -> torch.Tensor:
    """Scaled dot-product attention of q [B, H, S, D] over k, v [B, H_kv, S_kv, D]; grouped-query
    attention (H_kv < H) lets PyTorch's kernels share each key/value head, without copying it H / H_kv
    times as a repeat would."""
    kwargs = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, **kwargs)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as int8 with one symmetric scale per row (token and head), the scale in x's dtype: rounded
    to it before quantising, so dequantisation uses the very scale the values were rounded with."""
    tiny = torch.finfo(x.dtype).tiny if x.is_floating_point() else torch.finfo(torch.float32).tiny
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / INT8_MAX).clamp(min=tiny).to(x.dtype)
    q = torch.clamp(torch.round(x.float() / scale.float()), -INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


# A custom op, not the dequantise-then-attend Python below, is what the projection's trace sees: one
# kernel that reads the int8 cache and its scales, as a fused KV-int8 attention kernel does. Its CPU
# body is the reference arithmetic (dequantise the slice, then attend).
@torch.library.custom_op("headroom::scaled_dot_product_attention_int8_kv", mutates_args=())
def attend_int8(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, v: torch.Tensor,
                v_scale: torch.Tensor, causal: bool) -> torch.Tensor:
    keys, values = k.to(q.dtype) * k_scale, v.to(q.dtype) * v_scale
    return attention(q, keys, values, causal)


@attend_int8.register_fake
def _attend_int8_fake(q, k, k_scale, v, v_scale, causal):
    return torch.empty_like(q)


class LayerCache:
    """One layer's preallocated keys and values [B, H_kv, context, D] (int8 storage adds scales)."""

    def __init__(self, batch: int, kv_heads: int, context: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, kind: str = "native"):
        if kind not in KV_KINDS:
            raise ValueError(f"unknown KV cache kind {kind!r} (valid: {', '.join(KV_KINDS)})")
        self.kind, self.context = kind, context
        shape = (batch, kv_heads, context, head_dim)
        storage = torch.int8 if kind == "int8" else dtype
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = torch.zeros(shape, dtype=storage, device=device)
        self.k_scale = self.v_scale = None
        if kind == "int8":
            self.k_scale = torch.zeros((*shape[:3], 1), dtype=dtype, device=device)
            self.v_scale = torch.zeros((*shape[:3], 1), dtype=dtype, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Write the new keys and values at positions start.. and attend q to every cached position up to
        them. A prompt (several tokens) must start the sequence; one token continues it."""
        seq = q.shape[2]
        end = start + seq
        if end > self.context:
            raise ValueError(f"the KV cache holds {self.context} tokens; position {end - 1} is past it")
        if seq > 1 and start:
            raise ValueError("a chunk of several tokens must start at position 0 (prefill); decode one at a time")
        causal = seq > 1  # a single new token sees every cached position
        if self.kind == "int8":
            for store, scales, new in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                values, scale = quantize_per_token(new)
                store[:, :, start:end] = values
                scales[:, :, start:end] = scale
            return attend_int8(q, self.k[:, :, :end], self.k_scale[:, :, :end], self.v[:, :, :end],
                               self.v_scale[:, :, :end], causal)
        self.k[:, :, start:end] = k.to(self.k.dtype)
        self.v[:, :, start:end] = v.to(self.v.dtype)
        return attention(q, self.k[:, :, :end].to(q.dtype), self.v[:, :, :end].to(q.dtype), causal)


class KVCache:
    """The caches of every layer of a decoder, preallocated for `context` tokens of `batch` sequences;
    `kv_heads` has one entry per layer (structured pruning may leave layers with different counts)."""

    def __init__(self, kv_heads: list[int], batch: int, context: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, kind: str = "native"):
        self.layers = [LayerCache(batch, heads, context, head_dim, dtype, device, kind) for heads in kv_heads]
        self.kind, self.context = kind, context

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.tensors()]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, batch: int, element_bytes: float) -> int:
    """2 (keys and values) x layers x kv_heads x head_dim x tokens x batch x bytes per element."""
    return round(2 * layers * kv_heads * head_dim * tokens * batch * element_bytes)
