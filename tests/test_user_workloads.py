"""Users' own models as workloads: a factory (`model:package.module:factory`, tests/user_models.py) and a
Hugging Face config (`hf:/path/config.json`): built, batched at any size, trained one step, traced on fake
tensors as the harness traces, rebuilt from the name alone in a fresh process; and the one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from suites.workloads import get_workload
from suites.workloads.base import ANY_SCALE, count_parameters
from tests import user_models

REPO = Path(__file__).resolve().parents[1]
RESNET, MLP, TOKENS = (f"model:tests.user_models:{f}" for f in ("resnet18_small", "tiny_mlp", "token_model"))

# Minimal configs as a user would write them: (config, the layer list's attribute path, depth key).
HF_CONFIGS = {
    "llama": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 256, "max_position_embeddings": 512, "torch_dtype": "bfloat16"},
              "model.layers", "num_hidden_layers"),
    "bert": ({"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 256, "max_position_embeddings": 64},
             "bert.encoder.layer", "num_hidden_layers"),
    "gpt2": ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4,
              "vocab_size": 256, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0},
             "transformer.h", "n_layer"),
}


def _write(folder: Path, config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "config.json"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("hf")
    for family, (config, _, _) in HF_CONFIGS.items():
        _write(root / f"tiny-{family}", config)
    return root


def _attr(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_resnet_factory():
    w = get_workload(RESNET)
    assert get_workload(RESNET) is w and w.name == RESNET and w.kind == "vision"
    spec = w.size("resnet18_small")
    assert (spec.scale, spec.batch_size, spec.image_size, spec.seq_len) == (ANY_SCALE, 2, 64, None)
    assert w.sizes_at("smoke") == [spec]
    for n in (1, 3, 8):
        batch = w.batch(spec, n, _gen())
        assert batch["images"].shape == (n, 3, 64, 64) and batch["images"].dtype == torch.float32
        assert batch["labels"].shape == (n,) and batch["labels"].dtype == torch.int64
        assert 0 <= batch["labels"].min() and batch["labels"].max() < 10
    model = w.build(spec)
    loss = w.loss(model, w.batch(spec, 3, _gen()))
    assert torch.isfinite(loss)
    loss.backward()
    assert model.conv1.weight.grad is not None
    assert w.traits.convolutional and w.traits.batch_norm and not w.traits.uniform_blocks
    assert w.block_lists(model) == [model.layer1, model.layer2, model.layer3, model.layer4]


def test_flops_counted_on_fake_tensors():
    w = get_workload(RESNET)
    spec = w.size("resnet18_small")
    flops = w.forward_flops_per_sample(spec)
    assert w.train_flops_per_sample(spec) == 3 * flops
    model = w.build(spec).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        w.forward(model, w.batch(spec, 1, _gen()))
    assert flops == counter.get_total_flops() > 0
    recording = get_workload("model:tests.user_models:recording_mlp")
    user_models.BUILT.clear()
    assert recording.forward_flops_per_sample(recording.size("recording_mlp")) == 2 * (16 * 32 + 32 * 4)
    assert recording.forward_flops_per_sample(recording.size("recording_mlp")) > 0  # cached: no second build
    assert user_models.BUILT == ["FakeTensor"]


def test_tuple_factory_single_input():
    w = get_workload(MLP)
    spec = w.size("tiny_mlp")
    assert spec.batch_size == 8 and spec.image_size is None and spec.seq_len is None and w.kind == "user"
    first, again, other = (w.batch(spec, 5, _gen(seed)) for seed in (0, 0, 1))
    assert first["x"].shape == (5, 16) and torch.equal(first["x"], again["x"])
    assert not torch.equal(first["x"], other["x"])  # floats are redrawn with the generator
    assert torch.equal(first["labels"], first["labels"][:1].expand(5))  # one sample, tiled
    model = w.build(spec)
    assert w.forward(model, first).shape == (5, 4)  # called positionally on the one input
    w.loss(model, first).backward()
    assert w.block_lists(model) == []
    assert not (w.traits.convolutional or w.traits.batch_norm or w.traits.uniform_blocks)


def test_keyword_inputs_tiled_rows():
    w = get_workload(TOKENS)
    spec = w.size("token_model")
    assert (spec.batch_size, spec.seq_len) == (4, 16)
    batch = w.batch(spec, 6, _gen())
    assert torch.equal(batch["labels"], batch["input_ids"])  # rows are tiled together, so pairs stay pairs
    assert torch.equal(batch["input_ids"][4:], batch["input_ids"][:2])
    model = w.build(spec)
    assert w.forward(model, batch).shape == (6, 16, 100)
    assert w.block_lists(model) == [model.layers] and w.traits.uniform_blocks


@pytest.mark.parametrize("family", list(HF_CONFIGS))
def test_hf_config(hf_dir, family):
    _, layers, depth_key = HF_CONFIGS[family]
    path = hf_dir / f"tiny-{family}" / "config.json"
    w = get_workload(f"hf:{path}")
    spec = w.size(f"tiny-{family}")
    assert w.name == f"hf:{path}" and spec.scale == ANY_SCALE
    assert spec.seq_len == min(spec.config[w.traits.max_seq_key], 128)
    assert w.traits.depth_key == depth_key and w.depth(spec) == 2 and w.traits.uniform_blocks
    assert w.kind == ("encoder" if family == "bert" else "decoder")
    for n in (1, 3):
        batch = w.batch(spec, n, _gen())
        assert batch["input_ids"].shape == batch["labels"].shape == (n, spec.seq_len)
        assert 0 <= batch["input_ids"].min() and batch["input_ids"].max() < 256
    model = w.build(spec)
    assert next(model.parameters()).dtype == torch.float32  # the file's torch_dtype is not followed
    loss = w.loss(model, batch)
    assert torch.isfinite(loss)
    loss.backward()
    assert w.block_lists(model) == [_attr(model, layers)] and len(_attr(model, layers)) == 2
    deeper = w.with_depth(spec, 3)
    assert len(_attr(w.build(deeper), layers)) == 3
    assert w.forward_flops_per_sample(deeper) > w.forward_flops_per_sample(spec) > 0


def test_hf_masked_lm_labels(hf_dir):
    w = get_workload(f"hf:{hf_dir / 'tiny-bert'}")  # the folder names its config.json
    spec = w.size("tiny-bert")
    batch = w.batch(spec, 4, _gen())
    targets = batch["labels"] != -100
    assert targets.sum(dim=1).tolist() == [round(0.15 * spec.seq_len)] * 4
    assert torch.equal(batch["labels"][targets], batch["input_ids"][targets])


def test_hf_llama_flops_and_mlp_roles(hf_dir, monkeypatch):
    from suites.techniques.pruning import prune_blocks

    monkeypatch.chdir(hf_dir)
    w = get_workload("hf:tiny-llama/config.json")  # a relative path, named absolutely
    assert w.name == f"hf:{hf_dir / 'tiny-llama' / 'config.json'}"
    spec = w.size("tiny-llama")
    # Analytic: 2 FLOPs per weight per token (GQA: k and v are 64 -> 32), plus QK^T and AV (4 S d per token).
    d, hidden, seq, layers = 64, 128, spec.seq_len, 2
    weights = layers * (2 * d * d + 2 * d * 32 + 3 * d * hidden) + d * 256
    # Within 0.1%: some transformers versions also count the rotary angles' small matmul.
    assert w.forward_flops_per_sample(spec) == pytest.approx(seq * (2 * weights + layers * 4 * seq * d), rel=1e-3)
    assert w.traits.mlp is not None and w.traits.attention is None
    model = w.build(spec)
    changes = prune_blocks(w.block_lists(model), w.traits)
    assert changes["MLP neurons"] == {(128, 96): 2}
    assert w.forward(model, w.batch(spec, 2, _gen())).shape == (2, seq, 256)


@pytest.mark.parametrize("which", [RESNET, MLP, TOKENS, "llama", "bert", "gpt2"])
def test_builds_and_steps_on_fake_tensors(request, which):
    if not which.startswith("model:"):
        which = f"hf:{request.getfixturevalue('hf_dir') / f'tiny-{which}'}"
    w = get_workload(which)
    spec = next(iter(w.sizes.values()))
    with torch.device("meta"):
        assert count_parameters(w.build(spec)) > 0
    # As the harness traces a step: everything made inside the mode, real inputs refused.
    with FakeTensorMode(allow_non_fake_inputs=False):
        model = w.build(spec)
        batch = w.batch(spec, 2, _gen())
        assert all(isinstance(v, FakeTensor) for v in batch.values())
        with sdpa_kernel(SDPBackend.MATH):
            w.loss(model, batch).backward()


def test_fresh_process_rebuilds_the_same_workload(hf_dir):
    names = [TOKENS, f"hf:{hf_dir / 'tiny-llama' / 'config.json'}"]
    script = ("import sys, torch; from suites.workloads import get_workload\n"
              "for name in sys.argv[1:]:\n"
              "    w = get_workload(name); spec = next(iter(w.sizes.values()))\n"
              "    b = w.batch(spec, 3, torch.Generator().manual_seed(0))\n"
              "    print(w.name, spec, sorted((k, v.tolist()) for k, v in b.items()))\n")
    child = subprocess.run([sys.executable, "-c", script, *names], cwd=REPO, capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr
    here = []
    for name in names:
        w = get_workload(name)
        spec = next(iter(w.sizes.values()))
        b = w.batch(spec, 3, _gen())
        here.append(f"{w.name} {spec} {sorted((k, v.tolist()) for k, v in b.items())}")
    assert child.stdout.splitlines() == here


@pytest.mark.parametrize("name,message", [
    ("model:nocolon", "expected model:package.module:factory"),
    ("model:tests.no_such_module:make", "module tests.no_such_module not found (is it on PYTHONPATH?)"),
    ("model:tests.user_models:missing", "module tests.user_models has no attribute 'missing'"),
    ("model:tests.user_models:resnet18_smal", "did you mean 'resnet18_small'?"),
    ("model:tests.user_models:NOT_A_FUNCTION", "tests.user_models.NOT_A_FUNCTION is a int, not a function"),
    ("model:tests.user_models:wrong_type", "the factory returned a int; return UserModel(model, example, loss)"),
    ("model:tests.user_models:not_a_module", "the model is a str, not an nn.Module"),
    ("model:tests.user_models:uneven_example", "different sample counts along dim 0: {'x': 2, 'labels': 3}"),
    ("model:tests.user_models:raises", "the factory raised RuntimeError: no GPU here"),
])
def test_factory_errors_are_one_line(name, message):
    with pytest.raises(ValueError) as error:
        get_workload(name)
    text = str(error.value)
    assert text.startswith(f"{name}: ") and message in text and "\n" not in text


@pytest.mark.parametrize("config,message", [
    (None, "no such file"),
    ({"architectures": ["BertForSequenceClassification"], "model_type": "bert", "vocab_size": 256},
     "has no supported head; supported: ...ForCausalLM, ...LMHeadModel, ...ForMaskedLM"),
    ({"architectures": ["LlamaForCausalLM"], "vocab_size": 256}, 'has no "model_type"'),
    ({"architectures": ["FooForCausalLM"], "model_type": "no-such-type", "vocab_size": 256},
     "cannot build 'no-such-type'"),
])
def test_hf_errors_are_one_line(tmp_path, config, message):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json" if config is None else _write(tmp_path, config)
    with pytest.raises(ValueError) as error:
        get_workload(f"hf:{path}")
    text = str(error.value)
    assert text.startswith(f"hf:{path}: ") and message in text and "\n" not in text


def test_hf_without_transformers_5(tmp_path, monkeypatch):
    path = _write(tmp_path, HF_CONFIGS["llama"][0])
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ValueError, match=r"needs the transformers package: pip install 'headroom\[hf\]'$"):
        get_workload(f"hf:{path}")
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="4.57.6"))
    with pytest.raises(ValueError, match=r": needs transformers 5 or later, found 4.57.6: pip install"):
        get_workload(f"hf:{path}")
