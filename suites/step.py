"""One training or inference step, shaped by the settings a technique stack left on the `Run`.

Train: zero the gradients, then per micro-batch a forward under autocast and a backward of the loss
divided by the number of micro-batches (scaled when fp16 loss scaling is on), then one optimizer
step. Infer: one forward in inference mode; for a served decoder (a workload with `serving` and a
size with `gen_len`), one generation: the prompt is prefilled into a freshly allocated KV cache, whose
last logits give the first token, and the other `gen_len - 1` tokens are decoded one at a time from
the cache (greedy: the most likely token). `mark(name)` is called at phase boundaries so memory probes
can read live bytes there; it is None in timed loops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from suites.techniques.adapters import store_frozen
from suites.techniques.base import Run
from suites.techniques.layout import to_layout
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


def _compiled(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model` through torch.compile; served on CUDA with mode reduce-overhead (each shape's kernels recorded
    once as a CUDA graph and replayed). Shapes are left to PyTorch's automatic dynamism: the cache length a
    decode step reads becomes dynamic at its first recompilation, while the prefill and the one-token
    decode keep static lengths, so `is_causal` stays a plain bool (`dynamic=True` would make it symbolic,
    which SDPA refuses: a graph break). A projection's fake-tensor model is left as it is: the trace costs
    the compiled step."""
    if any(is_fake(p) for p in model.parameters()):
        return model
    # Training keeps the default mode: CUDA graphs would need static gradient and optimizer buffers, and
    # nanoGPT- and torchtitan-style training compiles without them.
    graphs = device.type == "cuda" and not model.training
    return torch.compile(model, mode="reduce-overhead" if graphs else None)


class Step:
    """A callable step for one run on one device; holds the optimizer and the loss scaler."""

    def __init__(self, run: Run, device: torch.device):
        self.run = run
        self.device = device
        self.train = run.mode == "train"
        run.model.train(self.train)
        self.model = _compiled(run.model, device) if run.compiled else run.model  # after train(): it picks the mode
        if self.train and run.autocast_dtype is not None:
            store_frozen(run)
        # Only what trains gets optimizer state (frozen adapter bases get none, whatever the optimizer).
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = run.optimizer_factory(trainable) if self.train else None
        self.scaler = torch.amp.GradScaler(device.type) if run.loss_scaling else None
        if run.pipeline is not None:
            from suites.techniques.base import Unsupported

            if self.scaler is not None:
                raise Unsupported("fp16 loss scaling across pipeline stages is not built: use amp-bf16")
            if run.pipeline.pipelines > run.data_parallel:
                raise Unsupported(f"{run.pipeline.pipelines} pipelines side by side need a data-parallel technique to "
                                  "split the batch and average their gradients: add fsdp")
        self.generates = not self.train and run.workload.serving is not None and run.size.gen_len is not None
        self._cache = None  # (batch size, the KV cache generations reuse)

    def autocast(self):
        if self.run.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.run.autocast_dtype)

    def __call__(self, batch: Batch, mark: Mark = None) -> torch.Tensor:
        batch = to_layout(batch, self.run.memory_format)
        with tf32_matmuls(self.run.tf32):
            return self._train_step(batch, mark) if self.train else self._infer_step(batch, mark)

    def _train_step(self, batch: Batch, mark: Mark) -> torch.Tensor:
        run, optimizer = self.run, self.optimizer
        optimizer.zero_grad(set_to_none=True)
        if run.pipeline is not None:
            return self._pipeline_step(batch, mark)
        parts = run.micro_batches
        total = None
        for index, micro in enumerate(split_batch(batch, parts)):
            # DDP all-reduces the gradients once per step, not after every micro-batch: the others run under
            # no_sync (PyTorch's DDP docs); FSDP2 reduce-scatters each, as it does by default.
            sync = self.model.no_sync() if index < parts - 1 and hasattr(self.model, "no_sync") \
                else contextlib.nullcontext()
            with sync, run.loss_context():
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
            value = loss.detach()
            value = value.full_tensor() if hasattr(value, "full_tensor") else value  # loss parallel's DTensor
            total = value if total is None else total + value
        if self.scaler:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        if mark:
            mark("optimizer_end")
        return total

    def _pipeline_step(self, batch: Batch, mark: Mark) -> torch.Tensor:
        """A pipeline stage's step: its schedule interleaves the micro-batches' forwards and backwards, so
        no forward's end can be marked (the row's activations stay unknown), only the step's phases."""
        if mark:
            mark("forward_start")
        loss = self.run.pipeline.step(batch, self.device, self.autocast())
        if mark:
            mark("backward_end")
        self.optimizer.step()
        if mark:
            mark("optimizer_end")
        return loss

    def _infer_step(self, batch: Batch, mark: Mark) -> torch.Tensor:
        if self.generates:
            return self._generate(batch, mark)
        if self.run.input_dtype is not None:  # a model served in 16 bits takes 16-bit inputs (images)
            batch = {k: v.to(self.run.input_dtype) if v.is_floating_point() else v for k, v in batch.items()}
        if mark:
            mark("forward_start")
        with torch.inference_mode(), self.autocast():
            out = self.run.workload.forward(self.model, batch)
        if mark:
            mark("forward_end")
        return out

    # Generation, in the pieces a timer or a trace calls one by one.

    @property
    def cache_dtype(self) -> torch.dtype:
        """The keys' and values' dtype: what the attention produces (the autocast dtype, else the weights')."""
        floating = (p.dtype for p in self.model.parameters() if p.is_floating_point())
        return self.run.autocast_dtype or next(floating, torch.float32)

    def new_cache(self, batch_size: int, device: torch.device | None = None, context: int | None = None):
        """A KV cache for `context` tokens (default: the whole prompt + generated tokens) of `batch_size`
        sequences."""
        size = self.run.size
        context = context or size.seq_len + size.gen_len
        return self.run.workload.serving.new_cache(self.model, batch_size, context, self.cache_dtype,
                                                   device or self.device, self.run.kv_cache)

    def cache(self, batch_size: int):
        """The step's KV cache for `batch_size` sequences, allocated once and reused by every generation, as
        a server keeps its cache: positions past a generation's own are never read, so nothing is reset.
        A compiled model sees it at a static address, which CUDA graphs need to write it in place."""
        if self._cache is None or self._cache[0] != batch_size:
            self._cache = (batch_size, self.new_cache(batch_size))
            if self.run.compiled and self.model is not self.run.model:  # really compiled (not a trace)
                for tensor in self._cache[1].tensors():
                    torch._dynamo.mark_static_address(tensor)
        return self._cache[1]

    def cache_bytes(self, batch_size: int) -> int:
        """Bytes of the KV cache of `batch_size` sequences (built on the meta device: no memory)."""
        return self.new_cache(batch_size, torch.device("meta")).nbytes

    def prefill(self, cache, prompt: torch.Tensor) -> torch.Tensor:
        """Write the prompt's keys and values into the cache; the first generated token [B, 1]."""
        return self._next_token(prompt, cache, 0)

    def decode(self, cache, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Feed `tokens` [B, 1] at `position`; the next token [B, 1]."""
        return self._next_token(tokens, cache, position)

    def _serving(self):
        stack = contextlib.ExitStack()
        for context in (tf32_matmuls(self.run.tf32), torch.inference_mode(), self.autocast()):
            stack.enter_context(context)
        return stack

    def next_logits(self, tokens: torch.Tensor, cache, start: int) -> torch.Tensor:
        """The next-token logits [B, vocab] after feeding `tokens` [B, S] at `start` (a prefill when
        start is 0 and S > 1, a decode step when S is 1), as the served model computes them."""
        with self._serving():
            return self.run.workload.serving.forward(self.model, tokens, cache, start)

    def _next_token(self, tokens: torch.Tensor, cache, start: int) -> torch.Tensor:
        with self._serving():  # the argmax too: every op of a generation runs in inference mode
            return self.run.workload.serving.forward(self.model, tokens, cache, start).argmax(dim=-1, keepdim=True)

    def _generate(self, batch: Batch, mark: Mark) -> torch.Tensor:
        prompt = batch["input_ids"]
        cache = self.cache(prompt.shape[0])
        if mark:
            mark("forward_start")
        tokens = [self.prefill(cache, prompt)]
        for i in range(self.run.size.gen_len - 1):
            tokens.append(self.decode(cache, tokens[-1], prompt.shape[1] + i))
        if mark:
            mark("forward_end")
        return torch.cat(tokens, dim=1)
