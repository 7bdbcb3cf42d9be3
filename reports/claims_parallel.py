"""The guide's parallelism claims (C11-C14) judged: a GPT-3 block's arithmetic and measured tensor-parallel
ranks (C11), the sequence-parallel saving from Korthikanti et al. 2022 (C12), the guide's column-parallel
sample run against the whole layer (C13), and its strategy-by-size table against the rows' best stacks
(C14). reports/claims.py judges the rest and orders them all.
"""

from __future__ import annotations

import pandas as pd

from reports.claims import GB, _judged, _numbers

# A rank holding at most this share of the single process's parameter bytes holds a split of them. Its
# sharded layers (blocks, token embedding and head) are 1/t of theirs, its norms and position embeddings whole:
# a t-way rank of gpt2-124m (0.7% of its weights in those) holds about 1 / t, 0.50 at t = 2; a rank holding
# it all holds 1.
SPLIT_SHARE = 0.9


def judge_c11(frame: pd.DataFrame) -> dict:
    """The arithmetic of a GPT-3 block, and the per-rank parameters of any measured tensor-parallel cell."""
    from suites.workloads.gpt import SIZES

    config = SIZES["gpt3-175b"].config
    layer = 12 * config["n_embd"] ** 2  # attention 4 d^2 + MLP 8 d^2 weights per block
    found = (f"a GPT-3 175B block holds {layer / 1e9:.2f}B weights, {2 * layer / GB:.1f} GB in FP16; "
             f"350 GB is the whole model's FP16 weights ({config['n_layer']} blocks)")
    ranks = frame[frame["technique"].astype(str).str.contains("tensor-parallel") & frame["rank"].notna()] \
        if len(frame) and "rank" in frame else frame[:0]
    ratios = []  # a rank's parameter bytes over the single process's
    for _, row in ranks.iterrows():
        alone = frame[(frame["workload"] == row["workload"]) & (frame["size"] == row["size"])
                      & (frame["mode"] == row["mode"]) & (frame["technique"] == "baseline")
                      & (frame["source"] == row["source"]) & frame["rank"].isna()]
        if len(alone) and float(alone.iloc[0]["params_bytes"] or 0) > 0:
            ratios.append(float(row["params_bytes"]) / float(alone.iloc[0]["params_bytes"]))
    verdict = f"contradicted: one layer is {350 * GB / (2 * layer):.0f}x smaller than stated"
    if ratios:
        found += (f"; {ranks['source'].iloc[0]} tensor-parallel ranks hold x{pd.Series(ratios).median():.2f} of the "
                  "single process's parameter bytes (sharded layers split, norms and position embeddings replicated)")
        share = pd.Series(ratios).median()
        verdict += ("; tensor parallelism does split the sharded weights across its ranks" if share <= SPLIT_SHARE
                    else f"; its ranks hold x{share:.2f} of the parameter bytes each: not a split")
    else:
        verdict += "; the per-rank split itself is not in these rows (tests/test_parallel.py measures it on 2 ranks)"
    return _judged("C11", found, f"the gpt3-175b shape; {len(ratios)} tensor-parallel rank rows", verdict)


def judge_c12() -> dict:
    """What sequence parallelism takes off a transformer block's activations at t-way tensor parallelism:
    Korthikanti et al. 2022's table 2, whose tensor-parallel and unsharded figures headroom's trace reproduces
    (tests/test_parallel_projection.py; the sequence-parallel 1/t is the paper's), and whose 2-rank
    measurement keeps the loss (tests/test_parallel.py). With flash attention (no 5as/h
    term), per s*b*h in 16-bit units: 10 + 24/t with tensor parallelism alone, 34/t with sequence parallelism."""
    paper = {t: 1 - (34 / t) / (10 + 24 / t) for t in (2, 4, 8)}
    # PyTorch's column-parallel layers keep their all-gathered input (2 of the 34 units each) whole.
    torch_sp = {t: 1 - (4 + 30 / t) / (10 + 24 / t) for t in (2, 4, 8)}
    found = ("sequence parallelism (a technique here: its loss checked on 2 ranks, its memory projected) takes a "
             "block's activations from "
             "10 + 24/t to 34/t per s*b*h in the paper: " + ", ".join(f"-{v:.0%} at t={t}" for t, v in paper.items())
             + "; as PyTorch runs it (the gathered inputs kept, 4 + 30/t): "
             + ", ".join(f"-{v:.0%} at t={t}" for t, v in torch_sp.items()) + "; T5-XXL is not a workload here")
    return _judged("C12", found, "Korthikanti et al. 2022, table 2 (its tensor-parallel figures reproduced by "
                                 "the projection)",
                   f"not measurable here for T5-XXL; 40% of activations is saved from {_first_t(paper)} in the "
                   f"paper, from {_first_t(torch_sp)} as PyTorch runs it (weights and optimizer state are unchanged, "
                   "so total memory falls less)")


def _first_t(saved: dict[int, float], target: float = 0.4) -> str:
    """The smallest tensor-parallel size whose saving reaches the guide's 40%, as text."""
    reached = [t for t, share in sorted(saved.items()) if share >= target]
    return f"t={reached[0]}" if reached else f"no t up to {max(saved)}"


# fp32 matmuls of 16 products: the same sums in another order differ by far less than this.
C13_TOLERANCE = 1e-4
C13_BATCH = 4  # rows of the layer's input, chunked over 2 ranks by the sample


def c13_errors() -> tuple[float, float, int]:
    """The guide's column-parallel sample on one process standing in for 2 ranks: the max |error| of rank 0's
    output against the whole layer's, that of sharding the weight and gathering every part, and how many
    of the batch's rows the sample's output holds (tests/test_parallel.py runs the real 2-process layer)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(8, 16, generator=generator), torch.randn(C13_BATCH, 16, generator=generator)
    whole = torch.nn.functional.linear(x, weight)
    local = torch.nn.functional.linear(x.chunk(2)[0], weight.chunk(2)[0])  # rank 0's part, as the sample does
    sample = torch.cat([local, local], dim=-1)  # the same local output twice instead of a gather
    gathered = torch.cat([torch.nn.functional.linear(x, w) for w in weight.chunk(2)], dim=-1)
    rows = sample.shape[0]
    return (sample - whole[:rows]).abs().max().item(), (gathered - whole).abs().max().item(), rows


def judge_c13() -> dict:
    """C13 judged from `c13_errors`: the sample is wrong where it drops rows or its output differs."""
    error, gathered_error, rows = c13_errors()
    sample_wrong = rows != C13_BATCH or error > C13_TOLERANCE
    verdict = ("contradicted: the sample is wrong" if sample_wrong else "supported: the sample computes the layer") + \
        ("; GUIDE.md C13's correction holds" if gathered_error <= C13_TOLERANCE else "; the gathered layer differs too")
    return _judged("C13", f"the sample's output has {rows} of {C13_BATCH} rows and repeats one shard: "
                          f"max |error| {error:.2f}; sharding the weight and gathering gives {gathered_error:.1g}",
                   "computed here (tests/test_parallel.py runs it on 2 processes)", verdict)


# The guide's strategy table (C14): parameter bucket -> (its recommendation, the techniques that mark it).
STRATEGY = (("<1B", 0, 1e9, "mixed precision + checkpointing"), ("1-10B", 1e9, 1e10, "tensor parallelism + "
            "quantisation"), (">10B", 1e10, float("inf"), "3D parallelism (+ expert parallelism)"))


def strategy_table(rows: pd.DataFrame) -> list[dict]:
    """Per model-size bucket: the sizes in the rows, the guide's recommendation, what the rows recommend
    (the best-value single-GPU training stack, or that no single GPU holds it) and whether they agree."""
    train = rows[(rows["mode"] == "train") & (_numbers(rows, "param_count") > 0)] if len(rows) else rows
    table = []
    for label, low, high, guide in STRATEGY:
        part = train[(_numbers(train, "param_count") >= low) & (_numbers(train, "param_count") < high)]
        if not len(part):
            continue
        ok = part[part["status"] == "ok"].assign(usd=lambda f: _numbers(f, "usd_per_million_samples"))
        sizes = ", ".join(dict.fromkeys(part["size"]))
        if not len(ok):
            found, verdict = "no single-GPU stack tried fits any GPU: several GPUs are needed", \
                "agrees" if label == ">10B" else "disagrees: one GPU is not enough"
        else:
            # Each size's best-value stack (costs compare within a size, not across images and sequences),
            # then the stack most sizes choose.
            ranked = ok.dropna(subset=["usd"]).sort_values("usd", kind="stable")
            per_size = (ranked if len(ranked) else ok).groupby("size", sort=False).head(1)
            winner = per_size["technique"].value_counts().index[0]
            chosen = per_size[per_size["technique"] == winner]
            found = (f"{winner}, the best value on one GPU for {len(chosen)} of {len(per_size)} sizes "
                     f"({', '.join(chosen['size'])})")
            stack = set(str(winner).split("+"))
            amp, checkpointing = any(t.startswith("amp") for t in stack), any("checkpointing" in t for t in stack)
            if label == "<1B":
                verdict = "agrees" if amp and checkpointing else \
                    "partly agrees: mixed precision, but checkpointing only costs time where memory is left" \
                    if amp else \
                    "disagrees"
            elif label == "1-10B":
                verdict = "disagrees: one GPU holds " + ", ".join(dict.fromkeys(ok["size"])) + \
                    " without tensor parallelism"
            else:
                verdict = "disagrees: one GPU holds " + ", ".join(dict.fromkeys(ok["size"]))
        table.append({"bucket": label, "sizes": sizes, "guide": guide, "rows recommend": found, "verdict": verdict})
    return table


def judge_c14(rows: pd.DataFrame, multi_gpu_rows: int = 0) -> dict:
    """The strategy table's buckets on single-GPU rows; `multi_gpu_rows` says whether the results also hold
    multi-GPU cells (the parallel section judges those)."""
    table = strategy_table(rows)
    if not table:
        return _judged("C14", "no training rows", "none", "not measurable here")
    agree = sum(row["verdict"].startswith("agrees") for row in table)
    partly = sum(row["verdict"].startswith("partly agrees") for row in table)
    found = "; ".join(f"{row['bucket']}: {row['rows recommend']} (guide: {row['guide']})" for row in table)
    beyond = (f"; {multi_gpu_rows} multi-GPU cells in these results (their own section)" if multi_gpu_rows else
              "; no multi-GPU cells in these results (headroom project --tp/--pp/--dp projects them)")
    return _judged("C14", found, "single-GPU training rows by parameter count (the strategy table below)",
                   f"{'supported' if agree == len(table) else 'partly supported' if agree + partly else 'contradicted'}"
                   f": {agree} of {len(table)} buckets agree" + (f", {partly} partly" if partly else "") + beyond)
