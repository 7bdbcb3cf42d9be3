"""Hugging Face Transformers architectures from a local config, with random weights: `hf:/path/config.json`.

The JSON is read here and turned into a config by `AutoConfig.for_model`, and the model is built by
`AutoModelFor...from_config`: nothing is downloaded, no remote code runs. The head follows
`config.architectures` (causal or masked LM); the layer-count key is the depth key, so projection can
trace 2 and 3 layers and extrapolate. Needs the optional `transformers` package, 5 or later (`headroom[hf]`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from suites.workloads.base import ANY_SCALE, Batch, MlpRoles, SizeSpec, Traits, Workload
from suites.workloads.user import counted_flops, find_block_lists, uniform_blocks

PREFIX = "hf:"
# Architecture name suffix -> (head, Auto class). GPT-2 style names end in LMHeadModel.
HEADS = {"ForCausalLM": ("causal", "AutoModelForCausalLM"), "LMHeadModel": ("causal", "AutoModelForCausalLM"),
         "ForMaskedLM": ("masked", "AutoModelForMaskedLM")}
DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
MAX_SEQ_KEYS = ("max_position_embeddings", "n_positions")
DEFAULT_SEQ_LEN = 128  # a short default keeps the first run cheap; the harness can ask for longer
DEFAULT_BATCH = 8
MASK_PROB = 0.15  # BERT's share of masked positions
IGNORE = -100  # the label HF's losses skip
# 4.x encoders read token values (padding checks, mask shortcuts) that fake tensors cannot answer; 5 skips
# those reads on fake tensors, so the harness's trace and FLOP count work.
MIN_TRANSFORMERS = 5
# Keys the builder sets itself: weights are float32 (precision is a technique), no remote code runs.
DROPPED = ("model_type", "dtype", "torch_dtype", "auto_map", "transformers_version", "_name_or_path")


def _transformers(name: str):
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{name}: needs the transformers package: pip install 'headroom[hf]'") from None
    if int(transformers.__version__.split(".")[0]) < MIN_TRANSFORMERS:
        raise ValueError(f"{name}: needs transformers {MIN_TRANSFORMERS} or later, found {transformers.__version__}: "
                         f"pip install 'headroom[hf]'")
    return transformers


def config_path(name: str) -> Path:
    """The absolute path of the config.json `hf:PATH` names (PATH may be its folder)."""
    path = Path(name[len(PREFIX):]).expanduser().absolute()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{name}: no such file {path} (give a Hugging Face config.json or the folder holding one)")
    return path


def read_config(name: str, path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: cannot read {path} as JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError(f"{name}: {path} has no \"model_type\"; is it a Hugging Face config.json?")
    return config


def head_of(name: str, config: dict[str, Any]) -> tuple[str, str]:
    """(head, Auto class name) from `config.architectures`; ValueError listing what is supported."""
    architectures = config.get("architectures") or []
    for arch in architectures:
        for suffix, head in HEADS.items():
            if isinstance(arch, str) and arch.endswith(suffix):
                return head
    raise ValueError(f"{name}: architectures {architectures} has no supported head; supported: "
                     f"{', '.join('...' + s for s in HEADS)} (set \"architectures\" in the config)")


def _resized(value: Any, depth: int, file_depth: int | None) -> Any:
    # Per-layer lists (e.g. `layer_types`) must follow the depth: cycle the file's pattern.
    if isinstance(value, list) and file_depth and len(value) == file_depth and depth != file_depth:
        return [value[i % file_depth] for i in range(depth)]
    return value


def workload(name: str) -> Workload:
    """The workload of `hf:PATH`, named by the config's absolute path so a fresh process rebuilds it."""
    path = config_path(name)
    name = f"{PREFIX}{path}"
    raw = read_config(name, path)
    transformers = _transformers(name)
    head, auto_name = head_of(name, raw)
    model_type = raw["model_type"]
    fields = {k: v for k, v in raw.items() if k not in DROPPED}
    # The SizeSpec's config holds the scalar entries (the harness keys caches on them, so they must be
    # hashable; depth and widths are scalars); lists and dicts stay here, fixed by the file.
    scalars = {k: v for k, v in fields.items() if v is None or isinstance(v, bool | int | float | str)}
    nested = {k: v for k, v in fields.items() if k not in scalars}
    depth_key = next((k for k in DEPTH_KEYS if isinstance(scalars.get(k), int)), None)
    max_seq_key = next((k for k in MAX_SEQ_KEYS if isinstance(scalars.get(k), int)), None)
    if not isinstance(scalars.get("vocab_size"), int):
        raise ValueError(f"{name}: the config has no integer vocab_size to draw token ids from")
    auto = getattr(transformers, auto_name)

    def hf_config(spec: SizeSpec):
        depth = spec.config.get(depth_key) if depth_key else None
        extra = {k: _resized(v, depth, raw.get(depth_key)) for k, v in nested.items()}
        # No KV cache: training does not use one, and a forward that fills one holds memory for nothing.
        return transformers.AutoConfig.for_model(model_type, **{**extra, **spec.config, "use_cache": False})

    def build(spec: SizeSpec) -> nn.Module:
        try:
            # sdpa: the attention a real HF run picks, and it runs on the CPU, on meta and on fake tensors.
            return auto.from_config(hf_config(spec), attn_implementation="sdpa")
        except (ValueError, ImportError):  # an architecture without an sdpa path
            return auto.from_config(hf_config(spec), attn_implementation="eager")

    try:
        with torch.device("meta"):  # checks the config builds, and shows the blocks, in no memory
            probe = build(SizeSpec("probe", ANY_SCALE, scalars, batch_size=1))
    except Exception as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"{name}: transformers {transformers.__version__} cannot build {model_type!r} from it: "
                         f"{type(exc).__name__}: {detail}") from None
    blocks = find_block_lists(probe)
    # Llama-style SwiGLU MLPs (Llama, Mistral, Qwen2, ...): the down projection reads its width from its
    # weight, so neuron pruning can rebuild them. Attention is left out: its q, k and v are not fused.
    swiglu = any(all(isinstance(getattr(m, r, None), nn.Linear) for r in ("up_proj", "gate_proj", "down_proj"))
                 for m in probe.modules())
    max_seq = scalars.get(max_seq_key) if max_seq_key else None
    seq_len = min(max_seq, DEFAULT_SEQ_LEN) if max_seq else DEFAULT_SEQ_LEN
    size_name = path.parent.name if path.name == "config.json" else path.stem
    sizes = {size_name: SizeSpec(size_name, ANY_SCALE, scalars, batch_size=DEFAULT_BATCH, seq_len=seq_len)}

    def batch(spec: SizeSpec, batch_size: int, generator: torch.Generator) -> Batch:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        seq = spec.seq_len
        input_ids = torch.randint(0, spec.config["vocab_size"], (batch_size, seq), generator=generator)
        if head == "causal":
            return {"input_ids": input_ids, "labels": input_ids.clone()}  # HF shifts the labels itself
        # The same number of targets in every sample (as BERT's max_predictions_per_seq), so the mean loss
        # of equal splits of the batch averages to the whole's: accumulation keeps the numerics. The
        # tokens stay (configs need not name a mask token); memory and FLOPs are the same.
        chosen = torch.rand(batch_size, seq, generator=generator).topk(max(1, round(MASK_PROB * seq)), dim=1)
        masked = torch.zeros(batch_size, seq, dtype=torch.bool).scatter_(1, chosen.indices, True)
        return {"input_ids": input_ids, "labels": torch.where(masked, input_ids, IGNORE)}

    def forward(model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(input_ids=batch["input_ids"]).logits

    def loss(model: nn.Module, batch: Batch) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    # Every input needs a gradient (the activations descend from the trainable token embedding), so
    # training is 3x forward, as counted_flops takes it.
    forward_flops_per_sample, train_flops_per_sample = counted_flops(
        build, batch, forward, key=lambda spec: (tuple(sorted(spec.config.items())), spec.seq_len))

    traits = Traits(uniform_blocks=uniform_blocks(blocks), depth_key=depth_key, max_seq_key=max_seq_key,
                    mlp=MlpRoles(up="up_proj", gate="gate_proj", down="down_proj") if swiglu else None)
    return Workload(
        name=name, kind="decoder" if head == "causal" else "encoder", sizes=sizes, build=build, batch=batch,
        loss=loss, forward=forward, block_lists=find_block_lists,
        forward_flops_per_sample=forward_flops_per_sample, train_flops_per_sample=train_flops_per_sample,
        traits=traits, extra={"config_path": str(path), "model_type": model_type, "head": head})
