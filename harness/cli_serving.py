"""`headroom serve-matrix`: the serving fit matrix printed as a table, kept as a frame on request
(harness/serve_matrix.py computes it); and a run's own matrix (`run_matrix`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from harness.cli_args import UsageError, _count, _csv, _folder, _profiles, guard_output, printable


def add_parser(sub) -> None:
    matrix = sub.add_parser("serve-matrix", help="serving fit matrix: decoder sizes x GPUs x weight precision "
                                                 "(largest batch per context, decode tokens/s, USD per M tokens)")
    matrix.add_argument("--size", type=_csv, default=None, help="gpt size ids (default: gpt-7b, llama3-8b, gpt-13b, "
                                                                "gpt-70b)")
    matrix.add_argument("--gpu", type=_csv, default=None, help="profile ids or families (default: every GPU profile)")
    matrix.add_argument("--weights", type=_csv, default=None, help="bf16, int8, int4 (default: all three)")
    matrix.add_argument("--context", type=_csv, default=None, metavar="TOKENS,...",
                        help="contexts (prompt + generated tokens) to find the largest batch at (default 4096,32768)")
    matrix.add_argument("--gen-len", type=_count, default=None, help="tokens generated per sequence (default 128)")
    matrix.add_argument("--eager", action="store_true", help="eager decode instead of compiled (CUDA graphs)")
    matrix.add_argument("--tp", type=_csv, default=None, metavar="GPUS,...",
                        help="GPUs per replica, each count a tensor-parallel group of a node (default 1; e.g. 1,2,4,8)")
    matrix.add_argument("--prices", type=Path, default=None, metavar="FILE.csv",
                        help="GPU prices to cost tokens at instead of the profiles' (columns gpu, usd_per_hour, date, "
                             "source), as `headroom report --prices`")
    matrix.add_argument("--out", type=_folder, default=None, metavar="FILE.csv|.parquet", help="keep the frame")


def _contexts(values: list[str] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    try:
        contexts = tuple(int(v.replace("_", "")) for v in values)
    except ValueError:
        raise UsageError(f"--context takes token counts such as 4096,32768; got {','.join(values)}") from None
    if any(c < 1 for c in contexts):
        raise UsageError(f"--context takes positive token counts; got {','.join(values)}")
    return contexts


def _replica_gpus(values: list[str] | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    try:
        counts = tuple(int(v) for v in values)
    except ValueError:
        raise UsageError(f"--tp takes GPU counts such as 1,2,4,8; got {','.join(values)}") from None
    if any(c < 1 for c in counts):
        raise UsageError(f"--tp takes positive GPU counts; got {','.join(values)}")
    return counts


def cmd_serve_matrix(args) -> int:
    from harness.prices import priced_profiles
    from harness.profiles import resolve_gpus
    from harness.serve_matrix import C1_GPU, DEFAULT_GEN_LEN, MatrixRequest, context_label, judge_c1, serve_matrix

    if args.out:
        if args.out.suffix.lower() not in (".csv", ".parquet"):
            raise UsageError(f"--out {printable(str(args.out))}: the matrix is written as .csv or .parquet; name "
                             "the file so")
        guard_output(args.out, own="serve_matrix.csv")
    profiles = priced_profiles(_profiles(args), args.prices)  # a bad --prices file fails before any projection
    gpus = resolve_gpus(args.gpu, profiles) if args.gpu else [p for p in profiles.values() if p.vendor != "cpu"]
    options = {key: value for key, value in (("sizes", tuple(args.size or ()) or None),
                                             ("weights", tuple(args.weights or ()) or None),
                                             ("contexts", _contexts(args.context)),
                                             ("replica_gpus", _replica_gpus(args.tp))) if value}
    request = MatrixRequest(gpus=tuple(g.id for g in gpus), gen_len=args.gen_len or DEFAULT_GEN_LEN,
                            eager=args.eager, **options)
    started = time.perf_counter()

    def progress(done: int, total: int, row: dict) -> None:
        print(f"[{done}/{total} {time.perf_counter() - started:4.0f}s] {row['size']} {row['weights']} on "
              f"{_over(row)}{row['gpu']}", file=sys.stderr)

    matrix = serve_matrix(request, profiles, progress)
    print(_table(matrix, context_label(request.contexts[0])).to_string(index=False))
    for line in _notes(matrix):
        print(line)
    c1_gpu = profiles.get(C1_GPU)
    verdict = judge_c1(matrix, c1_gpu.capacity_bytes if c1_gpu else None)
    if verdict and (matrix["gpu"] == C1_GPU).any():  # a matrix of other GPUs was not asked about C1
        print(f"\nC1 (one A100 80 GB holds only about a 13B FP16 model): {verdict}")
    print(f"\nall figures projected ({'eager' if request.eager else 'compiled, CUDA-graph'} decode, "
          f"{request.gen_len} generated tokens per sequence); speed and cost at the first context, "
          f"{request.contexts[0]:,} tokens: TTFT is the prompts' prefill (all of the batch's, in one step), "
          "USD/M-gen-tok the whole generation's time (prefill included) per million generated tokens (prompt "
          f"tokens not counted); prices: {_prices(matrix, profiles)}"
          + (f" (from {printable(str(args.prices))} where it names the GPU)" if args.prices else ""), file=sys.stderr)
    if args.out:
        replaced = " (replacing the file there)" if args.out.exists() else ""
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.out.suffix.lower() == ".parquet":
            matrix.to_parquet(args.out, index=False)
        else:
            matrix.to_csv(args.out, index=False)
        print(f"matrix -> {printable(str(args.out))}{replaced}", file=sys.stderr)
    return 0


def _table(matrix, first_context: str):
    """The matrix for people: the answer's columns first, bytes in GiB, rates rounded; one-token headers
    (a header of several words reads as several columns), the speed columns naming the context they are at.
    Notes go under the table (`_notes`), not in a column as wide as the longest."""
    import pandas as pd

    # A context past every size's own is a column of dashes: left out (each row's note says why); the first
    # context's stays, the speeds being at it.
    batches = [c for c in matrix.columns if c.startswith("max_batch_")]
    batches = [c for c in batches if c == batches[0] or pd.to_numeric(matrix[c], errors="coerce").notna().any()]
    at = f"@{first_context}"
    columns = {"size": "size", "gpu": "GPU", "gpus": "GPUs", "weights": "weights",
               **{c: "max-batch@" + c.removeprefix("max_batch_") for c in batches},
               "decode_tokens_s_b1": f"decode-tok/s-b1{at}", "decode_tokens_s_max": f"decode-tok/s-max{at}",
               "ttft_ms_b1": f"TTFT-ms-b1{at}", "ttft_ms_max": f"TTFT-ms-max{at}",
               "decode_bandwidth_util_b1": f"BW-util-b1{at}", "usd_per_million_tokens_max": f"USD/M-gen-tok{at}",
               # A tensor-parallel replica's rows: each GPU's price and share of the weights.
               "usd_per_hour": "USD/h-per-GPU", "params_bytes": "weights-GiB-per-GPU"}
    table = matrix[[c for c in columns if c in matrix]].rename(columns=columns).copy()
    if "notes" in matrix:
        numbered = iter(range(1, len(matrix) + 1))
        table["note"] = [f"[{next(numbered)}]" if note else "" for note in matrix["notes"].fillna("")]
    for column in table.columns:
        if column == "weights-GiB-per-GPU":
            table[column] = [f"{v / 2**30:,.1f}" if v == v and v is not None else "-" for v in table[column]]
        elif column.startswith("max-batch"):
            table[column] = [str(int(v)) if v == v and v is not None else "-" for v in table[column]]
        elif column == "GPUs":
            table[column] = [str(int(v)) for v in table[column]]
        elif column not in ("size", "GPU", "weights", "note"):
            table[column] = [(f"{v:.0%}" if "util" in column else f"{v:,.2f}" if "USD" in column else f"{v:,.0f}")
                             if v == v and v is not None else "-" for v in table[column]]
    return table


def _notes(matrix) -> list[str]:
    """The rows' notes, numbered as the table's `note` column numbers them."""
    rows = matrix[matrix["notes"].fillna("") != ""] if "notes" in matrix else matrix.iloc[0:0]
    return [f"note [{index}] {row['size']} {row['weights']} on {_over(row)}{row['gpu']}: {row['notes']}"
            for index, (_, row) in enumerate(rows.iterrows(), 1)]


def _over(row) -> str:
    """`4 x ` before a GPU's name where a row's replica is a tensor-parallel group of that many."""
    gpus = row.get("gpus", 1)
    return f"{int(gpus)} x " if gpus == gpus and gpus > 1 else ""


def _prices(matrix, profiles) -> str:
    """Each GPU's price as the matrix costs it, with its date and age (a warning past a year), or none known."""
    from datetime import date

    from harness.prices import age_text, profile_prices

    prices = profile_prices(profiles)

    def priced(gpu: str) -> str:
        age, _, warning = age_text(prices[gpu], date.today()).partition(": ")
        return f"{gpu} {prices[gpu].label} ({age} old{': ' + warning if warning else ''})"

    return ", ".join(priced(gpu) if gpu in prices else f"{gpu} none known" for gpu in dict.fromkeys(matrix["gpu"]))


def run_matrix(plan, profiles, out, console, full: bool):
    """A run's serving matrix for its GPUs, written to `out`/serve_matrix.csv: the default request with
    --serve-matrix, else the first run's compact one (DAY_ONE_SIZES at DAY_ONE_CONTEXTS)."""
    from harness.records import atomic_write_text
    from harness.serve_matrix import DAY_ONE_CONTEXTS, DAY_ONE_SIZES, MATRIX_FILE, MatrixRequest, serve_matrix

    gpus = tuple(g.id for g in [plan.local, *plan.foreign] if g.vendor != "cpu")
    if not gpus:
        console.print("serving matrix: no GPU profile in this run to tabulate")
        return None
    request = MatrixRequest(gpus=gpus) if full else MatrixRequest(gpus=gpus, sizes=DAY_ONE_SIZES,
                                                                   contexts=DAY_ONE_CONTEXTS)
    started = time.perf_counter()

    def progress(done: int, total: int, row: dict) -> None:
        if done == total or done % 10 == 0:
            console.print(f"serving matrix [{done}/{total} {time.perf_counter() - started:4.0f}s] {row['size']} "
                          f"{row['weights']} on {row['gpu']} (projected)")

    matrix = serve_matrix(request, profiles, progress)
    atomic_write_text(out / MATRIX_FILE, matrix.to_csv(index=False))
    console.print(f"serving matrix: {len(matrix)} rows -> {printable(str(out / MATRIX_FILE))}")
    return matrix
