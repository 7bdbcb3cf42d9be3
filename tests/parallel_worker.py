"""Run under torchrun by tests/test_parallel.py: two training steps of gpt smoke under a parallel stack on
this rank's slice of the same global batch, the losses averaged over ranks and this rank's bytes, as JSON."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from harness.measure.distributed import exit_now, launched_by_torchrun, leave_together, process_group, rank_slice
from harness.measure.tensors import optimizer_state_bytes
from harness.profiles import detect_local, load_profiles
from suites.step import Step
from suites.techniques import parse_stack
from suites.techniques.base import Run
from suites.workloads import get_workload

GLOBAL_BATCH = 8


def losses(stack: str, size: str = "smoke") -> dict:
    device = torch.device("cpu")
    workload = get_workload("gpt")
    spec = workload.size(size)
    torch.manual_seed(0)
    run = Run(workload=workload, size=spec, mode="train", profile=detect_local(load_profiles(None)),
              model=workload.build(spec), batch_size=GLOBAL_BATCH)
    parse_stack(stack).apply(run)
    seen = []  # the sequence length and dtype of the first block's input on this rank
    blocks = workload.block_lists(getattr(run.model, "module", run.model))[0]  # DDP wraps the model
    blocks[0].register_forward_pre_hook(lambda module, args: seen.append((args[0].shape[1], str(args[0].dtype))))
    step = Step(run, device)
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        batch = rank_slice(workload.batch(spec, GLOBAL_BATCH, generator), run.data_parallel, run.data_rank)
        loss = step(batch).detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)  # each rank's mean over its equal slice: their mean is the global mean
            # Pipeline stages other than the last hold no loss: average over the pipelines only.
            loss /= dist.get_world_size() // (run.pipeline.stages if run.pipeline else 1)
        out.append(loss.item())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in run.model.parameters())
    embedding = getattr(getattr(run.model, "module", run.model), "wte", None)
    grad = embedding.weight.grad if embedding is not None else None  # the last step's, kept till zero_grad
    return {"losses": out, "local_params": local, "block_input_seq": seen[0][0] if seen else None,
            "block_input_dtype": seen[0][1] if seen else None,
            "optimizer_bytes": optimizer_state_bytes(step.optimizer),
            "loss_parallel": getattr(run.loss_context, "__name__", "") == "loss_parallel",
            "embedding_grad_rows": None if grad is None else (grad.to_local() if hasattr(grad, "to_local")
                                                               else grad).shape[0],
            "comm": run.comm_bytes_per_step}


def column_parallel() -> dict:
    """A Linear sharded by PyTorch's ColwiseParallel against the same Linear whole, on the same input."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    whole = torch.nn.Linear(16, 8)
    x = torch.randn(4, 16)
    expected = whole(x)
    sharded = parallelize_module(whole, init_device_mesh("cpu", (dist.get_world_size(),)),
                                 ColwiseParallel(use_local_output=False))
    out = sharded(x)
    return {"max_error": (out.full_tensor() - expected).abs().max().item(), "local_shape": list(out.to_local().shape)}


def volumes() -> dict:
    """Bytes CommVolumeMode counts for collectives of known sizes on this rank (fp32: 4 bytes an element)."""
    from torch.distributed._functional_collectives import all_reduce

    from harness.measure.comm_volume import bytes_sent

    rank = dist.get_rank()

    def ops():
        dist.all_reduce(torch.ones(1000))
        dist.all_gather_into_tensor(torch.empty(200), torch.ones(100))
        dist.reduce_scatter_tensor(torch.empty(100), torch.ones(200))
        all_reduce(torch.ones(10), "sum", dist.group.WORLD).wait()  # DTensor's functional form
        if rank == 0:
            dist.send(torch.ones(50), dst=1)
        else:
            dist.recv(torch.empty(50), src=0)

    sent, by_op = bytes_sent(ops)
    return {"sent": sent, "by_op": by_op}


if __name__ == "__main__":
    stack, out, *size = sys.argv[1:]
    profile = detect_local(load_profiles(None))
    with process_group(profile):
        result = column_parallel() if stack == "column" else volumes() if stack == "volume" else losses(stack, *size)
        leave_together()
        if not dist.is_initialized() or dist.get_rank() == 0:
            with open(out, "w") as handle:
                json.dump(result, handle)
    if launched_by_torchrun():
        exit_now(0)  # the result is saved: skip a teardown that can abort (see exit_now)
