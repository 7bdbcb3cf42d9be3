"""Channels-last memory layout for convolutional networks: activations and convolution weights stored
NHWC (channels innermost) instead of PyTorch's default NCHW.

Tensor-core convolutions (cuDNN on NVIDIA GPUs, from Volta on) and oneDNN on CPUs compute in a
channels-innermost layout; given NCHW tensors they transpose every operand in and the output back out,
extra memory traffic around each convolution (PyTorch's channels-last tutorial; NVIDIA's Convolutional
Layers guide, "Tensor layouts in memory"). Storing the model and its inputs channels-last removes those
transposes: same values, same bytes, less traffic. NVIDIA's ResNet-50 AMP recipes train this way
(DeepLearningExamples' ConvNets configs.yml: `memory_format: nhwc` for every AMP run).
"""

from __future__ import annotations

import torch

from suites.techniques.base import Phase, Run, Technique


def _check(profile, workload, mode):
    if not workload.traits.convolutional:
        return (f"channels-last changes the layout of convolutions' 4-D activations; {workload.name}'s compute "
                "is not in convolutions")
    return None


def _apply(run: Run) -> None:
    # What Module.to(memory_format=...) does (restride the 4-D parameters and buffers: the convolution
    # weights), written out because Module.to cannot swap the fake tensors a projection traces with.
    for tensor in (*run.model.parameters(), *run.model.buffers()):
        if tensor.dim() == 4:
            tensor.data = tensor.data.contiguous(memory_format=torch.channels_last)
    run.memory_format = torch.channels_last
    run.notes.append("channels-last: convolution weights and image batches stored NHWC")


def to_layout(batch: dict[str, torch.Tensor], memory_format: torch.memory_format | None) -> dict[str, torch.Tensor]:
    """The batch with its 4-D floating tensors (images) in `memory_format`; unchanged when None."""
    if memory_format is None:
        return batch
    return {key: value.contiguous(memory_format=memory_format) if value.dim() == 4 and value.is_floating_point()
            else value for key, value in batch.items()}


# COMPRESS, after the swaps of that phase (which build new modules in the default layout) and before
# checkpointing, compilation and the data-parallel wrappers, which must see the final layout.
CHANNELS_LAST = Technique(
    id="channels-last", phase=Phase.COMPRESS, order=3, changes_numerics=False,
    summary="NHWC activations and conv weights (torch.channels_last): no layout transposes around convolutions",
    check=_check, apply=_apply)

TECHNIQUES = (CHANNELS_LAST,)
