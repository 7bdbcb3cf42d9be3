"""Quantisation (guide T7-T9): weights, and for some forms activations, as 8- or 4-bit integers.

`qat-int8` trains through fake quantisation (quantise-dequantise in the forward, straight-through in
backward) so the weights learn to survive int8 rounding (Jacob et al. 2018, arXiv:1712.05877).
`ptq-int8` quantises a trained model after the fact: min/max observers on calibration batches give
every layer its own activation range (per-layer dynamic range calibration), weights get one scale per
output channel, and the weights are stored as int8 (same paper, section 2; PyTorch's eager-mode
quantization docs). Weight-only group quantisation (T9) lives in groupquant.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao import quantization as tq
from torch.ao.nn import qat
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from suites.techniques.base import Phase, Run, Technique, Unsupported, always
from suites.workloads.moe import MoE

# Calibration (ptq-int8, and qat-int8's observers before inference): this many batches of at most
# CALIBRATION_SAMPLES samples each, drawn from the workload with a generator of its own so they are
# not the batch that is measured afterwards.
CALIBRATION_BATCHES = 4
CALIBRATION_SAMPLES = 4
CALIBRATION_SEED = 1234

# Integer ranges. Activations are affine (scale + zero point) signed int8, as _int_mm takes int8 x int8;
# weights are symmetric (zero point 0), so the weight never needs a zero-point correction.
INT8_MIN, INT8_MAX = -128, 127

Quantisable = nn.Linear | nn.Conv2d


def _targets(model: nn.Module, types: tuple[type, ...]) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, child) for every child whose exact type is in `types`, each parent once."""
    return [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) in types]


def _replace(model: nn.Module, types: tuple[type, ...], make: Callable[[nn.Module], nn.Module | None]) -> int:
    """Swap every module of `types` for make(module) (None keeps it); a module shared by several parents
    (cross-layer sharing) is converted once and the one replacement is shared the same way."""
    made: dict[int, nn.Module | None] = {}
    for parent, name, child in _targets(model, types):
        if id(child) not in made:
            made[id(child)] = make(child)
        if made[id(child)] is not None:
            setattr(parent, name, made[id(child)])
    return sum(m is not None for m in made.values())


def tied_layers(model: nn.Module) -> set[int]:
    """ids of the modules whose weight Parameter another module also holds: a head tied to the token
    embedding, as Hugging Face ties lm_head to embed_tokens. Quantising one would leave the float table where
    the embedding reads it and add an integer copy (more bytes, not fewer), so the quantisers keep them in
    their dtype, as AutoAWQ and GPTQ checkpoints keep lm_head."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners[id(parameter)] = owners.get(id(parameter), 0) + 1
    return {id(module) for module in model.modules()
            if isinstance(getattr(module, "weight", None), nn.Parameter) and owners.get(id(module.weight), 0) > 1}


def tied_note(count: int) -> str:
    return (f"; {count} layer{'s' if count > 1 else ''} whose weight is tied to the token embedding kept in its "
            "dtype (an integer copy would add bytes beside the float table)") if count else ""


def _calibration_batches(run: Run):
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    samples = min(run.batch_size, CALIBRATION_SAMPLES)
    for _ in range(CALIBRATION_BATCHES):
        yield run.workload.batch(run.size, samples, generator)


def _calibrate(run: Run) -> None:
    """Run the calibration batches through the model in eval mode (observers record ranges)."""
    device = next(run.model.parameters()).device
    was_training = run.model.training
    run.model.eval()
    with torch.no_grad():
        for batch in _calibration_batches(run):
            run.workload.forward(run.model, {k: v.to(device) for k, v in batch.items()})
    run.model.train(was_training)


def _bytes(tensors) -> int:
    """Bytes of the data behind `tensors`; wrapper subclasses (torchao's quantized weights) count the plain
    tensors they flatten to (their int8 data and scales), not their logical fp32 shape."""
    total = 0
    for tensor in tensors:
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            total += _bytes(getattr(tensor, name) for name in names)
        else:
            total += tensor.numel() * tensor.element_size()
    return total


# ---------------------------------------------------------------------------------------------------
# qat-int8: fake quantisation with PyTorch's own modules (torch.ao.quantization).


def _qat_qconfig() -> tq.QConfig:
    # Weights: per-output-channel symmetric int8; activations: per-tensor affine 8-bit. Both are the
    # fused observer + fake-quant modules PyTorch's QAT workflow uses (moving-average min/max).
    return tq.QConfig(activation=tq.default_fused_act_fake_quant, weight=tq.default_fused_per_channel_wt_fake_quant)


class FakeQuantized(nn.Module):
    """A Linear / Conv2d whose input and weight go through int8 fake quantisation.

    The layer becomes torch.ao.nn.qat's Linear / Conv2d (same Parameter objects, the weight fake-quantised
    on every forward); the input gets a per-tensor activation fake-quant in front, which is where an int8
    kernel would quantise it. Gradients pass straight through the rounding to the float weights.
    """

    def __init__(self, module: Quantisable, qconfig):
        super().__init__()
        module.qconfig = qconfig
        self.input_fake_quant = qconfig.activation()
        self.layer = (qat.Linear if isinstance(module, nn.Linear) else qat.Conv2d).from_float(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The fused fake-quant kernel only takes fp32; under autocast x may be bf16/fp16.
        x = self.input_fake_quant(x.float()).to(x.dtype)
        # qat.Linear/Conv2d's own forward, with one change: without autograd the weight goes in detached
        # (PyTorch's ModTracker, under the projection's MemTracker, cannot hook a grad-requiring module
        # input inside inference_mode).
        layer = self.layer
        weight = layer.weight if torch.is_grad_enabled() else layer.weight.detach()
        weight = layer.weight_fake_quant(weight)
        if isinstance(layer, nn.Linear):
            return F.linear(x, weight, layer.bias)
        return layer._conv_forward(x, weight, layer.bias)


def _apply_qat(run: Run) -> None:
    qconfig = _qat_qconfig()
    count = _replace(run.model, (nn.Linear, nn.Conv2d), lambda m: FakeQuantized(m, qconfig))
    if not count:
        raise Unsupported(f"{run.workload.name} has no nn.Linear or nn.Conv2d layer to fake-quantise")
    if run.mode == "infer":
        # Inference simulates the int8 model QAT would export: calibrate the ranges once, then freeze them
        # (observers off, so inference_mode never updates buffers).
        _calibrate(run)
        run.model.apply(tq.disable_observer)
        frozen = f"; ranges calibrated on {CALIBRATION_BATCHES} batches then frozen"
    else:
        frozen = "; ranges tracked by moving-average observers during training"
    run.notes.append(f"qat-int8: {count} Linear/Conv2d layers fake-quantised with torch.ao.quantization "
                     f"(weights per-channel symmetric int8, inputs per-tensor affine 8-bit){frozen}; "
                     "BatchNorm not folded into convs" + experts_untouched(run.model))


def experts_untouched(model: nn.Module) -> str:
    """Where a mixture of experts keeps its experts as batched matrices (not nn.Linear or Conv2d), the note says
    this technique leaves them in their dtype, and which techniques do quantise them (read before the technique
    converts anything: the share is of the float model's weights)."""
    experts = _bytes(p for layer in model.modules() if isinstance(layer, MoE) for p in layer.expert_parameters())
    if not experts:
        return ""
    share = experts / max(1, _bytes(model.parameters()))
    return (f"; the MoE expert matrices' {experts:,} bytes ({share:.0%} of the weights; batched, not nn.Linear) "
            "keep their dtype: group-quant and group-quant-int4 quantise them")


# ---------------------------------------------------------------------------------------------------
# ptq-int8: per-layer calibration, weights stored as int8 buffers.


# torch.ao's observers record the ranges, but their calculate_qparams branches in Python on the values
# (validity checks, float() of the scale), which the projection's fake tensors cannot answer; these two
# are the same formulas (torch.ao.quantization.utils.determine_qparams) as plain tensor arithmetic.
_EPS = torch.finfo(torch.float32).eps


def _symmetric_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric int8: the largest magnitude maps to the half-range 127.5."""
    return torch.clamp(amax.float() / ((INT8_MAX - INT8_MIN) / 2), min=_EPS)


def _affine_qparams(min_val: torch.Tensor, max_val: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor affine int8 (scale, zero point) covering [min, max] widened to include 0."""
    low, high = torch.clamp(min_val.float(), max=0), torch.clamp(max_val.float(), min=0)
    scale = torch.clamp((high - low) / (INT8_MAX - INT8_MIN), min=_EPS)
    zero_point = torch.clamp(INT8_MIN - torch.round(low / scale), INT8_MIN, INT8_MAX).to(torch.int32)
    return scale, zero_point


def _quantize_activation(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    return torch.clamp(torch.round(x / scale) + zero_point, INT8_MIN, INT8_MAX).to(torch.int8)


def _int_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch._int_mm takes these operands: any shape on the CPU; on CUDA (cuBLASLt) more than 16
    rows and both inner and output sizes multiples of 8."""
    if a.device.type == "cpu":
        return True
    if a.device.type == "cuda":
        return a.shape[0] > 16 and a.shape[1] % 8 == 0 and b.shape[1] % 8 == 0
    return False


class _Int8Layer(nn.Module):
    """Shared state of the PTQ layers: int8 weight + per-channel scale + the input's calibrated range.

    Everything is a registered buffer (no packed script objects), so parameter/buffer accounting sees
    the real int8 storage.
    """

    def _store(self, module: Quantisable, act_scale: torch.Tensor, act_zero_point: torch.Tensor) -> None:
        weight = module.weight.detach().float()
        self.float_bias = module.bias is not None  # counted as a parameter, as it was one (quantised_parameters)
        scale = _symmetric_scale(weight.flatten(1).abs().amax(dim=1))  # one per output channel
        shape = (-1,) + (1,) * (weight.dim() - 1)
        q = torch.clamp(torch.round(weight / scale.view(shape)), INT8_MIN, INT8_MAX).to(torch.int8)
        self.register_buffer("weight", q)                                     # int8, the layer's shape
        self.register_buffer("weight_scale", scale)                           # fp32 [out]
        self.register_buffer("input_scale", act_scale.float().reshape(()))    # per layer
        self.register_buffer("input_zero_point", act_zero_point.int().reshape(()))

    @property
    def quantised_parameters(self) -> int:
        """The parameters the int8 weight (and the bias it folds) stand for (suites/workloads/base.py,
        count_parameters)."""
        return self.weight.numel() + (self.weight.shape[0] if self.float_bias else 0)


class Int8Linear(_Int8Layer):
    """y = x W^T + b with x quantised to int8 by its calibrated range and W stored as int8.

    The matmul is a real int8 x int8 -> int32 GEMM (torch._int_mm) where it runs; elsewhere the same
    integer product is computed in fp32. The activation zero point is folded into the bias once:
    s_x s_w (q_x - z) W_q^T = s_x s_w (q_x W_q^T - z rowsum(W_q)).
    """

    def __init__(self, module: nn.Linear, act_scale: torch.Tensor, act_zero_point: torch.Tensor):
        super().__init__()
        self.in_features, self.out_features = module.in_features, module.out_features
        self._store(module, act_scale, act_zero_point)
        bias = module.bias.detach().float() if module.bias is not None else torch.zeros(self.out_features)
        correction = self.input_scale * self.weight_scale * self.input_zero_point * self.weight.sum(1).float()
        self.register_buffer("output_bias", bias - correction)  # fp32 [out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q = _quantize_activation(rows.float(), self.input_scale, self.input_zero_point)
        weight_t = self.weight.t()
        if _int_mm_runs(q, weight_t):
            acc = torch._int_mm(q, weight_t).float()
        else:
            acc = q.float() @ weight_t.float()
        y = acc * (self.input_scale * self.weight_scale) + self.output_bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 weight + int8 input"


class Int8Conv2d(_Int8Layer):
    """A Conv2d with an int8 weight (per output channel) and its input quantised to the calibrated
    int8 range; PyTorch has no int8 convolution outside its packed quantized engine, so the convolution
    itself runs on the dequantised operands (storage is real int8, the arithmetic is simulated)."""

    def __init__(self, module: nn.Conv2d, act_scale: torch.Tensor, act_zero_point: torch.Tensor):
        super().__init__()
        if module.padding_mode != "zeros":
            raise Unsupported(f"ptq-int8 handles zero-padded convs; found padding_mode={module.padding_mode!r}")
        self.stride, self.padding = module.stride, module.padding
        self.dilation, self.groups = module.dilation, module.groups
        self._store(module, act_scale, act_zero_point)
        self.register_buffer("bias", module.bias.detach().float() if module.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = _quantize_activation(x.float(), self.input_scale, self.input_zero_point)
        x_dq = (q.float() - self.input_zero_point) * self.input_scale
        weight = self.weight.float() * self.weight_scale.view(-1, 1, 1, 1)
        # No cast back: under autocast F.conv2d runs (and returns) the autocast dtype, as the fp32 conv would.
        return F.conv2d(x_dq, weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


def _apply_ptq(run: Run) -> None:
    types = (nn.Linear, nn.Conv2d)
    untouched = experts_untouched(run.model)  # its share of the float model's weights
    observers: dict[int, tq.MinMaxObserver] = {}
    calls: dict[int, int] = {}
    hooks = []

    def observe(module, args):
        observers[id(module)](args[0].detach().float())
        calls[id(module)] = calls.get(id(module), 0) + 1

    for _, _, module in _targets(run.model, types):
        if id(module) in observers:
            continue
        # One observer per layer: each layer's input range is its own (the per-layer calibration of T8).
        observers[id(module)] = tq.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_affine)
        hooks.append(module.register_forward_pre_hook(observe))
    if not observers:
        raise Unsupported(f"{run.workload.name} has no nn.Linear or nn.Conv2d layer to quantise")
    try:
        _calibrate(run)
    finally:
        for hook in hooks:
            hook.remove()

    before = after = 0
    unseen = 0
    tied, kept_tied = tied_layers(run.model), []

    def convert(module: nn.Module) -> nn.Module | None:
        nonlocal before, after, unseen
        if id(module) in tied:
            kept_tied.append(module)
            return None
        if not calls.get(id(module)):  # never reached by the forward: nothing to calibrate
            unseen += 1
            return None
        observer = observers[id(module)]
        scale, zero_point = _affine_qparams(observer.min_val, observer.max_val)
        cls = Int8Linear if isinstance(module, nn.Linear) else Int8Conv2d
        new = cls(module, scale, zero_point)
        before += _bytes(module.parameters())
        after += _bytes(new.buffers())
        return new

    count = _replace(run.model, types, convert)
    if not count:
        raise Unsupported(f"no layer of {run.workload.name} was reached by the calibration forward")
    convs = sum(isinstance(m, Int8Conv2d) for m in run.model.modules())
    if not convs:
        # Every quantised layer's product is an int8 GEMM: the int8 peak is the one its MFU is judged by.
        # (Int8Conv2d computes in fp32 on dequantised operands, so a conv net keeps its float label.)
        run.precision = "int8"
    kept = f"; {unseen} layers never reached by calibration kept in fp32" if unseen else ""
    kept += tied_note(len(kept_tied))
    run.notes.append(
        f"ptq-int8: {count} layers ({count - convs} Linear, {convs} Conv2d) calibrated by per-layer min/max "
        f"on {CALIBRATION_BATCHES} batches of {min(run.batch_size, CALIBRATION_SAMPLES)} samples; weights int8 "
        f"per-channel symmetric, inputs int8 per-tensor affine; {before:,} -> {after:,} bytes in those layers; "
        "Linear matmul torch._int_mm (int8 x int8 -> int32) where it runs (CPU; CUDA with >16 rows and "
        f"sizes multiple of 8), else the integer product in fp32; convs on dequantised operands{kept}{untouched}")


# ---------------------------------------------------------------------------------------------------
# Checks and the registry entries.


def _inference_only(name: str, why: str):
    def check(profile, workload, mode):
        if mode != "infer":
            return f"{name} is an inference technique: {why}"
        return None

    return check


QAT_INT8 = Technique(
    id="qat-int8", phase=Phase.COMPRESS, order=1, changes_numerics=True, guide="T7",
    summary="quantisation-aware training: int8 fake quantisation of Linear/Conv2d weights (per channel) "
            "and inputs (per tensor)",
    check=always, apply=_apply_qat, exclusive="quantization", post_training=True, fine_tune=True)

PTQ_INT8 = Technique(
    id="ptq-int8", phase=Phase.COMPRESS, order=1, changes_numerics=True, guide="T8",
    summary="post-training int8: per-layer min/max calibration, int8 weights and inputs, int8 GEMM",
    check=_inference_only("ptq-int8", "post-training quantisation turns a trained model into an int8 "
                                      "inference model whose integer weights get no gradients (use qat-int8 "
                                      "to train with quantisation)"),
    apply=_apply_ptq, exclusive="quantization", post_training=True)

TECHNIQUES = (QAT_INT8, PTQ_INT8)
