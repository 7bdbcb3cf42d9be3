"""One training or inference step, shaped by the settings a technique stack left on the `Run`.

Train: zero the gradients, then per micro-batch a forward under autocast and a backward of the loss
divided by the number of micro-batches (scaled when fp16 loss scaling is on), then one optimizer
step. Infer: one forward in inference mode. `mark(name)` is called at phase boundaries so memory
probes can read live bytes there; it is None in timed loops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from suites.techniques.base import Run
from suites.workloads.base import Batch

Mark = Callable[[str], None] | None


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """Split every tensor of a batch into `parts` equal micro-batches along dim 0 (views, no copies)."""
    if parts == 1:
        return [batch]
    chunks = {key: value.chunk(parts) for key, value in batch.items()}
    return [{key: chunks[key][i] for key in batch} for i in range(parts)]


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """fp32 matmuls and cuDNN convolutions on TF32 tensor cores while inside, as NVIDIA's containers run
    fp32 (PyTorch leaves matmuls in full fp32 by default); the previous settings come back after."""
    if not enabled:
        yield
        return
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


class Step:
    """A callable step for one run on one device; holds the optimizer and the loss scaler."""

    def __init__(self, run: Run, device: torch.device):
        self.run = run
        self.device = device
        self.model = run.model
        self.train = run.mode == "train"
        self.model.train(self.train)
        self.optimizer = run.optimizer_factory(self.model.parameters()) if self.train else None
        self.scaler = torch.amp.GradScaler(device.type) if run.loss_scaling else None

    def autocast(self):
        if self.run.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.run.autocast_dtype)

    def __call__(self, batch: Batch, mark: Mark = None) -> torch.Tensor:
        with tf32_matmuls(self.run.tf32):
            return self._train_step(batch, mark) if self.train else self._infer_step(batch, mark)

    def _train_step(self, batch: Batch, mark: Mark) -> torch.Tensor:
        run, optimizer = self.run, self.optimizer
        optimizer.zero_grad(set_to_none=True)
        parts = run.micro_batches
        total = None
        for micro in split_batch(batch, parts):
            if mark:
                mark("forward_start")
            with self.autocast():
                loss = run.workload.loss(self.model, micro)
                if parts > 1:
                    loss = loss / parts
            if mark:
                mark("forward_end")
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            if mark:
                mark("backward_end")
            total = loss.detach() if total is None else total + loss.detach()
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if mark:
            mark("optimizer_end")
        return total

    def _infer_step(self, batch: Batch, mark: Mark) -> torch.Tensor:
        if mark:
            mark("forward_start")
        with torch.inference_mode(), self.autocast():
            out = self.run.workload.forward(self.model, batch)
        if mark:
            mark("forward_end")
        return out
