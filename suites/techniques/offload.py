"""Optimizer offload (`optim-offload`): Adam's state and step in host memory (ZeRO-Offload, Ren et al.
2021, arXiv:2101.06840), through torchao's CPUOffloadOptimizer.

Each parameter of 4,096 values or more gets a pinned host copy, a pinned host gradient and host AdamW
moments: about four times its bytes in host memory (pinned blocks round up to powers of two), none of it
on the device. As soon as a gradient is
accumulated it is copied to the host on a side stream (overlapping the rest of the backward); the step
runs PyTorch's fused CPU AdamW per parameter and copies each updated parameter back. Smaller parameters
stay with an AdamW on the device. The device keeps parameters and gradients only.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import is_fake

from suites.techniques.base import Phase, Run, Technique, Unsupported, default_optimizer, train_only
from suites.techniques.optimizers import fused_adamw

# torchao's CPUOffloadOptimizer default: smaller tensors stay on the device (too many small transfers).
MINIMAL_SIZE = 4096


@dataclass(frozen=True)
class HostTraffic:
    """What an offloaded optimizer step moves and computes on the host, per step, in bytes."""

    host_bytes: int  # resident: parameter copies, gradient copies, moments
    to_host: int  # gradients, device -> host
    to_device: int  # updated parameters, host -> device
    host_step: int  # the host AdamW's memory traffic (read p, g, m, v; write p, m, v)


def pinned_bytes(size: int) -> int:
    """What PyTorch's pinned host allocator holds for a request: the next power of two (CachingHostAllocator)."""
    return 1 << max(0, size - 1).bit_length()


def host_traffic(offloaded: list[torch.Tensor]) -> HostTraffic:
    """The host side of offloading these parameters (each's host copies are in its own dtype): a pinned
    copy and a pinned gradient each (rounded as the pinned allocator rounds), and two moments."""
    sizes = [p.numel() * p.element_size() for p in offloaded]
    size = sum(sizes)
    return HostTraffic(host_bytes=2 * sum(pinned_bytes(s) for s in sizes) + 2 * size, to_host=size, to_device=size,
                       host_step=7 * size)


class HostAdamWModel(torch.optim.Optimizer):
    """What CPUOffloadOptimizer leaves on the device, for the projection's fake-tensor trace (the real one
    needs a CUDA device, its streams and pinned memory): small parameters stepped by a device AdamW, the
    others by the host, which `traffic` describes. Written here because torchao's cannot be built on
    fake tensors; the real optimizer is the one measured."""

    def __init__(self, params) -> None:
        params = [p for p in params if p.requires_grad]
        small = [p for p in params if p.numel() < MINIMAL_SIZE]
        self.traffic = host_traffic([p for p in params if p.numel() >= MINIMAL_SIZE])
        self.on_device = fused_adamw(small) if small else None  # torchao's device optimizer is fused too
        super().__init__(params, default_optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults)

    @property
    def state(self):  # the device's state only: MemTracker and the byte counts read it
        return self.on_device.state if self.on_device is not None else {}

    @state.setter
    def state(self, value) -> None:  # Optimizer.__init__ assigns an empty state
        pass

    def step(self, closure=None):
        if self.on_device is not None:
            self.on_device.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def offloaded_adamw(params) -> torch.optim.Optimizer:
    """torchao's CPUOffloadOptimizer over fused CPU AdamW with the default optimizer's settings (or, on the
    projection's fake tensors, the model of what it leaves on the device)."""
    params = list(params)
    if any(is_fake(p) for p in params):
        return HostAdamWModel(params)
    from torchao.optim import CPUOffloadOptimizer

    reference = default_optimizer([torch.nn.Parameter(torch.zeros(1))]).defaults
    optimizer = CPUOffloadOptimizer(params, torch.optim.AdamW, minimal_size=MINIMAL_SIZE, lr=reference["lr"],
                                    weight_decay=reference["weight_decay"], betas=reference["betas"],
                                    eps=reference["eps"])
    return optimizer


def host_state_bytes(optimizer) -> int | None:
    """Host bytes an offloading optimizer keeps (copies of parameters and gradients, moments); None for others."""
    if isinstance(optimizer, HostAdamWModel):
        return optimizer.traffic.host_bytes
    copies = getattr(optimizer, "param_d2h_map", None)
    if copies is None:
        return None
    from harness.measure.tensors import storage_bytes

    pinned = sum(pinned_bytes(storage_bytes([t])) for p in copies.values() for t in (p, p.grad))
    moments = [v for inner in optimizer.optim_dict.values() for s in inner.state.values() for v in s.values()
               if isinstance(v, torch.Tensor)]
    return pinned + storage_bytes(moments)


def _check(profile, workload, mode: str) -> str | None:
    reason = train_only("optim-offload")(profile, workload, mode)
    if reason:
        return reason
    if profile.vendor == "cpu":
        return "optim-offload moves Adam's state from GPU memory to the host; on a CPU it is already there"
    if importlib.util.find_spec("torchao") is None:
        return "optim-offload is torchao's CPUOffloadOptimizer, and torchao is not installed (pip install torchao)"
    return None


def _apply(run: Run) -> None:
    # torchao's offload is single-GPU: its hook copies each gradient to the host as soon as autograd has it,
    # before DDP averages it (and FSDP2's sharded gradients never pass that hook), so ranks would diverge.
    if run.data_parallel > 1:
        raise Unsupported("optim-offload is single-GPU (torchao's CPUOffloadOptimizer copies gradients before "
                          "data parallelism averages them); for several GPUs use cpu-offload (FSDP2)")
    if run.loss_scaling:
        # GradScaler unscales and checks the host copies while they are still being copied from the device.
        raise Unsupported("optim-offload cannot take fp16 loss scaling: the scaler would read host gradients "
                          "still in flight; use amp-bf16")
    if run.optimizer_factory is not default_optimizer:
        raise Unsupported("optim-offload replaces the optimizer, which another technique of the stack already wraps")
    run.optimizer_factory = offloaded_adamw
    run.notes.append("AdamW state and step on the host (torchao CPUOffloadOptimizer): the device keeps parameters "
                     "and gradients; host_bytes holds the rest")


OPTIM_OFFLOAD = Technique(
    id="optim-offload", phase=Phase.STEP, changes_numerics=True,
    summary="AdamW's moments and step in host memory (torchao's CPUOffloadOptimizer, ZeRO-Offload style)",
    check=_check, apply=_apply, exclusive="optimizer")

TECHNIQUES = (OPTIM_OFFLOAD,)
