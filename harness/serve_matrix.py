"""The serving fit matrix: for each decoder size x GPU profile x weight precision (x GPUs per replica, a
tensor-parallel group of a node: harness/project/served_parallel.py), the largest batch that fits at each
context, decode tokens/s at batch 1 and at that batch, and USD per million generated tokens at the profile's
price; every figure projected (harness/project/), one row per combination.

Weights as servers hold them: `bf16` (bf16-weights; fp16-weights on GPUs without bf16), `int8` and `int4`
(weight-only, group-wise scales, on 16-bit activations), each with `compile` (CUDA-graph decode, as
gpt-fast-style servers run) unless `eager` is asked for. The guide's C1 ("one A100 80 GB holds only
about a 13B FP16 model") is judged from the A100 80 GB's bf16 rows (`judge_c1`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from harness.cell import Cell
from harness.outcome import to_record
from harness.project import max_batch, project_outcome
from harness.project.query import with_degrees
from harness.project.served_parallel import search_cell
from suites.workloads import get_workload

WEIGHTS = {"bf16": "bf16-weights", "int8": "bf16-weights+group-quant", "int4": "bf16-weights+group-quant-int4"}
DEFAULT_SIZES = ("gpt-7b", "llama3-8b", "gpt-13b", "gpt-70b")
DEFAULT_CONTEXTS = (4096, 32768)
DEFAULT_GEN_LEN = 128
RUN_ID = "serve-matrix"
# What a first run on a CPU machine tabulates beside its cells (`headroom run` without --gpu): the size
# most often served (7B: the report's "which GPU serves a 7B model", and C1 judged from what its memory
# leaves) at a 4k context, in every weight precision. 13B and 70B (`headroom serve-matrix`) add 35 and 30
# seconds of tracing each to a first run that must stay under 15 minutes on a 2-core machine.
DAY_ONE_SIZES = ("gpt-7b",)
DAY_ONE_CONTEXTS = (4096,)


@dataclass(frozen=True)
class MatrixRequest:
    """What to tabulate: decoder sizes, GPU profile ids, weight precisions (WEIGHTS' keys), contexts
    (prompt + generated tokens) and generated tokens per sequence; `eager` drops `compile`."""

    sizes: tuple[str, ...] = DEFAULT_SIZES
    gpus: tuple[str, ...] = ()
    weights: tuple[str, ...] = tuple(WEIGHTS)
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    gen_len: int = DEFAULT_GEN_LEN
    eager: bool = False
    replica_gpus: tuple[int, ...] = (1,)  # GPUs per replica: 1, or a tensor-parallel group

    def __post_init__(self) -> None:
        # One row per combination, asked twice or not.
        for name in ("sizes", "gpus", "weights", "contexts", "replica_gpus"):
            object.__setattr__(self, name, tuple(dict.fromkeys(getattr(self, name))))
        unknown = [w for w in self.weights if w not in WEIGHTS]
        if unknown:
            raise ValueError(f"unknown weight precision {unknown[0]!r} (valid: {', '.join(WEIGHTS)})")
        if not self.replica_gpus or any(n < 1 for n in self.replica_gpus):
            raise ValueError(f"GPUs per replica must be positive integers, got {list(self.replica_gpus)}")
        if not self.contexts or any(c <= self.gen_len for c in self.contexts):
            raise ValueError(f"every context must exceed --gen-len {self.gen_len} (it holds the prompt too)")
        workload = get_workload("gpt")
        for size in self.sizes:
            workload.size(size)  # ValueError naming the valid sizes

    def stack(self, weights: str, profile, gpus: int = 1) -> str:
        """The technique stack serving `weights` on `profile` over `gpus` (tensor-parallel above one): 16-bit
        weights are fp16 where the GPU has no bf16 (T4, V100), as servers load them there."""
        stack = WEIGHTS[weights] + ("" if self.eager else "+compile")
        stack = stack if profile.has("bf16") else stack.replace("bf16-weights", "fp16-weights")
        return stack if gpus == 1 else with_degrees(f"tensor-parallel+{stack}", gpus, None)


def context_label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def serve_matrix(request: MatrixRequest, profiles: dict,
                 progress: Callable[[int, int, dict], None] | None = None) -> pd.DataFrame:
    """One row per size x GPU x weight precision (see the module docstring); `progress(done, total,
    row)` after each row."""
    workload = get_workload("gpt")
    combos = [(size, weights, gpu, gpus) for size in request.sizes for weights in request.weights
              for gpu in request.gpus for gpus in request.replica_gpus]
    rows = []
    for index, (size, weights, gpu, gpus) in enumerate(combos, 1):
        rows.append(_row(workload, request, profiles, size, weights, gpu, gpus))
        if progress:
            progress(index, len(combos), rows[-1])
    return pd.DataFrame(rows)


def _row(workload, request: MatrixRequest, profiles: dict, size: str, weights: str, gpu: str, gpus: int = 1) -> dict:
    profile = profiles[gpu]
    stack = request.stack(weights, profile, gpus)
    limit = workload.max_seq_len(workload.size(size))
    row = {"size": size, "gpu": gpu, "gpus": gpus, "weights": weights, "technique": stack, "gen_len": request.gen_len,
           "usd_per_hour": profile.per_device().usd_per_hour, "price_date": profile.price_date, "notes": ""}
    notes = [] if "bf16-weights" in stack else \
        [f"{'activations and scales' if weights != 'bf16' else '16-bit weights'} in fp16 (no bf16 on this GPU)"]
    for position, context in enumerate(request.contexts):
        label = context_label(context)
        row[f"max_batch_{label}"] = None
        if limit is not None and context > limit:
            notes.append(f"{label}: beyond {size}'s {limit:,}-token context")
            continue
        cell = Cell("gpt", size, "infer", stack, gpu, 1, source="projected", prompt_len=context - request.gen_len,
                    gen_len=request.gen_len, world_size=gpus).resolve(profiles)
        if cell.unsupported:
            notes.append(f"unsupported: {cell.unsupported}")
            break
        batch = max_batch(search_cell(cell))  # a tensor-parallel group's rank: what fits it fits the group
        row[f"max_batch_{label}"] = batch
        if position:
            continue
        # Speed and cost at the first context: batch 1 and the largest batch that fits.
        for name, at in (("b1", 1), ("max", batch)):
            if not at:
                continue
            record = to_record(cell.with_batch(at), project_outcome(cell.with_batch(at)), RUN_ID)
            row[f"decode_tokens_s_{name}"] = record.decode_tokens_s
            row[f"ttft_ms_{name}"] = record.ttft_ms
            row[f"decode_bandwidth_util_{name}"] = record.decode_bandwidth_util
            row[f"usd_per_million_tokens_{name}"] = record.usd_per_million_tokens
            # What a price given later (report --prices) costs: the replica's generated tokens a second.
            row[f"generated_tokens_s_{name}"] = record.tokens_per_s
            # The speed's range, from the step time's (the decode fit's held-out error, or wider: ledger.py),
            # as a factor on every rate and cost of the row: slowest, fastest.
            low, high, p50 = record.step_time_ms_low, record.step_time_ms_high, record.step_time_ms_p50
            if low and high and p50:
                row[f"speed_factor_low_{name}"], row[f"speed_factor_high_{name}"] = p50 / high, p50 / low
            if name == "b1":
                row["peak_reserved_b1_bytes"] = record.peak_reserved_bytes
                row["params_bytes"] = record.params_bytes
                row["kv_cache_b1_bytes"] = record.kv_cache_bytes
    if row.get("max_batch_" + context_label(request.contexts[0])) == 0:
        room = profile.per_device().capacity_bytes
        if row.get("params_bytes") and room and row["params_bytes"] > room:
            share = "its weights alone take" if gpus == 1 else f"each of its {gpus} GPUs' share of the weights takes"
            notes.append(f"does not fit: {share} {row['params_bytes'] / 2**30:,.1f} GiB of the "
                         f"{room / 2**30:,.1f} GiB the GPU has")
        else:
            notes.append(f"does not fit at batch 1 and {request.contexts[0]:,} tokens without the allocator "
                         "freeing its cache and retrying every step")
    row["notes"] = "; ".join(notes)
    return row


# C1's figure: the largest FP16 model one A100 80 GB holds, in parameters (GUIDE.md).
C1_PARAMS = 13e9
C1_GPU = "a100-sxm4-80gb"


def judge_c1(matrix: pd.DataFrame, capacity_bytes: int | None, gpu: str = C1_GPU) -> str | None:
    """The guide's C1 against the matrix's rows on `gpu` (capacity `capacity_bytes`) at its first
    context, batch 1: the largest size that fits in bf16, how many more bf16 parameters the memory left
    beside it would hold, and which weights make the sizes that do not fit fit. None for a matrix without the
    columns; where it lacks the rows, what to add to the matrix."""
    first = next((c for c in matrix.columns if c.startswith("max_batch_")), None)
    if matrix.empty or first is None or not {"params_bytes", "peak_reserved_b1_bytes"} <= set(matrix.columns):
        return None
    rows = matrix[matrix["gpu"] == gpu]
    if "gpus" in rows:  # one GPU's memory is the claim's: a tensor-parallel group's rows say nothing of it
        rows = rows[rows["gpus"].fillna(1) == 1]
    bf16 = rows[rows["weights"] == "bf16"]
    if bf16.empty:
        missing = f"single-GPU {gpu} rows" if rows.empty else f"bf16-weight rows on one {gpu}"
        return (f"not measurable with this serving matrix: it has no {missing} (headroom serve-matrix --gpu {gpu} "
                "--weights bf16)")
    fits = bf16[bf16[first].fillna(0) >= 1].sort_values("params_bytes")
    context = first.removeprefix("max_batch_")
    if fits.empty:
        smallest = bf16.sort_values("params_bytes").iloc[0]
        # Sizes above the claim's (gpt-13b's 13.02B is the claim's own): their not fitting says nothing.
        if smallest["params_bytes"] / 2 > 1.05 * C1_PARAMS:
            return (f"not measurable with these sizes: the smallest tried, {smallest['size']} "
                    f"({smallest['params_bytes'] / 2e9:.0f}B), is above the claim's {C1_PARAMS / 1e9:.0f}B "
                    "(add a size at or below it, e.g. --size gpt-7b,gpt-13b)")
        return f"contradicted: none of {', '.join(bf16['size'])} fits {gpu} in bf16 at {context} tokens"
    largest = fits.iloc[-1]
    params = largest["params_bytes"] / 2  # bf16: two bytes per parameter
    room = capacity_bytes - largest["peak_reserved_b1_bytes"] if capacity_bytes else 0
    reach = params + max(0.0, room) / 2
    verdict = ("supported" if reach < 1.5 * C1_PARAMS else
               f"contradicted by {reach / C1_PARAMS:.1f}x")
    parts = [f"{verdict}: {largest['size']} ({params / 1e9:.1f}B) fits {gpu} in bf16 at {context} tokens, batch 1, "
             f"with {room / 2**30:.0f} GiB left: weights of about {reach / 1e9:.0f}B parameters would fit (KV cache "
             f"of a {context} context included for the size that fits)"]
    for size in bf16[bf16[first].fillna(0) < 1]["size"]:
        other = rows[(rows["size"] == size) & (rows[first].fillna(0) >= 1)]["weights"].tolist()
        parts.append(f"{size} does not fit in bf16" + (f" but does in {' and '.join(other)}" if other else
                                                        " nor in the quantised weights tried"))
    return "; ".join(parts)


MATRIX_FILE = "serve_matrix.csv"  # in a results folder: the run's serving fit matrix


def judge_matrix(matrix: pd.DataFrame | None) -> str | None:
    """C1's verdict on `matrix`, with the A100 80 GB's capacity from its profile."""
    if matrix is None or matrix.empty:
        return None
    from harness.profiles import load_profiles

    profile = load_profiles().get(C1_GPU)
    return judge_c1(matrix, profile.capacity_bytes if profile else None)


def merged_matrices(matrices: list[pd.DataFrame]) -> pd.DataFrame | None:
    """Several serving matrices as one: a row per size, GPU, weights and GPUs per replica (1 in a matrix older
    than --tp), the last given winning; None for none."""
    if not matrices:
        return None
    matrix = pd.concat(matrices, ignore_index=True)
    matrix["gpus"] = pd.to_numeric(matrix["gpus"], errors="coerce").fillna(1).astype(int) if "gpus" in matrix else 1
    return matrix.drop_duplicates(["size", "gpu", "weights", "gpus"], keep="last").reset_index(drop=True)


def read_matrix(path) -> pd.DataFrame:
    """A serving fit matrix written by `headroom serve-matrix --out` or a run (CSV or Parquet); ValueError
    (one line) for a file that is not one."""
    from pathlib import Path

    path = Path(path)
    try:
        matrix = pd.read_parquet(path) if path.suffix == ".parquet" else pd.read_csv(path)
    except (OSError, ValueError, ImportError) as exc:
        raise ValueError(f"{path}: not a readable serving matrix ({type(exc).__name__})") from None
    needed = {"size", "gpu", "weights"}
    if not needed <= set(matrix.columns) or not any(c.startswith("max_batch_") for c in matrix.columns):
        raise ValueError(f"{path}: not a serving matrix (needs size, gpu, weights and max_batch_* columns)")
    return matrix
