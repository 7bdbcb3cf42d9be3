"""`headroom serve-matrix`: the serving fit matrix printed as a table, kept as a frame on request
(harness/serve_matrix.py computes it)."""

from __future__ import annotations

import sys
import time

from harness.cli import UsageError, _profiles, printable


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


def cmd_serve_matrix(args) -> int:
    from harness.profiles import resolve_gpus
    from harness.serve_matrix import C1_GPU, DEFAULT_GEN_LEN, MatrixRequest, judge_c1, serve_matrix

    profiles = _profiles(args)
    gpus = resolve_gpus(args.gpu, profiles) if args.gpu else [p for p in profiles.values() if p.vendor != "cpu"]
    options = {key: value for key, value in (("sizes", tuple(args.size or ()) or None),
                                             ("weights", tuple(args.weights or ()) or None),
                                             ("contexts", _contexts(args.context))) if value}
    request = MatrixRequest(gpus=tuple(g.id for g in gpus), gen_len=args.gen_len or DEFAULT_GEN_LEN,
                            eager=args.eager, **options)
    started = time.perf_counter()

    def progress(done: int, total: int, row: dict) -> None:
        print(f"[{done}/{total} {time.perf_counter() - started:4.0f}s] {row['size']} {row['weights']} on "
              f"{row['gpu']}", file=sys.stderr)

    matrix = serve_matrix(request, profiles, progress)
    print(_table(matrix).to_string(index=False))
    c1_gpu = profiles.get(C1_GPU)
    verdict = judge_c1(matrix, c1_gpu.capacity_bytes if c1_gpu else None)
    if verdict:
        print(f"\nC1 (one A100 80 GB holds only about a 13B FP16 model): {verdict}")
    print(f"\nall figures projected ({'eager' if request.eager else 'compiled, CUDA-graph'} decode, "
          f"{request.gen_len} generated tokens per sequence); prices: the profiles' own, with their dates",
          file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        if args.out.suffix == ".parquet":
            matrix.to_parquet(args.out, index=False)
        else:
            matrix.to_csv(args.out, index=False)
        print(f"matrix -> {printable(str(args.out))}", file=sys.stderr)
    return 0


def _table(matrix):
    """The matrix for people: the answer's columns first, bytes in GiB, rates rounded."""
    batches = [c for c in matrix.columns if c.startswith("max_batch_")]
    columns = {"size": "size", "gpu": "GPU", "weights": "weights",
               **{c: "max batch " + c.removeprefix("max_batch_") for c in batches},
               "decode_tokens_s_b1": "tok/s b1", "decode_tokens_s_max": "tok/s max",
               "decode_bandwidth_util_b1": "BW util b1", "usd_per_million_tokens_max": "USD/M tok max",
               "usd_per_hour": "USD/h", "params_bytes": "weights GiB", "notes": "notes"}
    table = matrix[[c for c in columns if c in matrix]].rename(columns=columns).copy()
    for column in table.columns:
        if column == "weights GiB":
            table[column] = [f"{v / 2**30:,.1f}" if v == v and v is not None else "-" for v in table[column]]
        elif column.startswith("max batch"):
            table[column] = [str(int(v)) if v == v and v is not None else "-" for v in table[column]]
        elif column not in ("size", "GPU", "weights", "notes"):
            table[column] = [(f"{v:.0%}" if "util" in column else f"{v:,.2f}" if "USD" in column else f"{v:,.0f}")
                             if v == v and v is not None else "-" for v in table[column]]
    return table


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


def cmd_fragmentation(args) -> int:
    """`headroom fragmentation`: the probe's rows printed (and kept with --out), then C4's verdict."""
    import dataclasses

    import pandas as pd

    from harness.cell import Cell
    from harness.fragmentation import (
        SETTINGS,
        judge_c4,
        measure_guide_scenario,
        measure_loop,
        projected_probe,
        variable_length_events,
    )
    from harness.profiles import detect_local

    profiles = _profiles(args)
    local = detect_local(profiles)
    gpu = args.gpu or (local.id if local.vendor != "cpu" else "h100-sxm")
    if gpu not in profiles or profiles[gpu].vendor == "cpu":
        raise UsageError(f"--gpu {gpu}: the probe needs a GPU profile (with a memory size); see headroom profiles")
    if args.measure and local.vendor != "nvidia":
        raise UsageError("--measure runs the guide's scenario on a CUDA device; this machine has none "
                         "(the projected probe runs without it)")
    cell = Cell("gpt", args.size, "train", "amp-bf16", gpu, args.batch_size, source="projected").resolve(profiles)
    started = time.perf_counter()
    results = projected_probe(profiles[gpu], cell)
    if args.measure:
        _, lengths = variable_length_events(cell)
        results += [measure_guide_scenario(setting) for setting in SETTINGS]
        results += [measure_loop(setting, args.size, args.batch_size, lengths) for setting in SETTINGS]
    frame = pd.DataFrame([{**dataclasses.asdict(r), "waste": r.waste, "gpu": gpu} for r in results])
    shown = frame.assign(**{
        "reserved GiB": frame["peak_reserved_bytes"] / 2**30,
        "allocated at that peak GiB": frame["allocated_at_reserved_peak_bytes"] / 2**30,
        "waste": [f"{w:.0%}" for w in frame["waste"]],
        "most held free GiB": frame["most_held_free_bytes"] / 2**30,
        "largest free block GiB": frame["largest_free_block_bytes"] / 2**30})
    columns = ["scenario", "allocator", "source", "reserved GiB", "allocated at that peak GiB", "waste",
               "most held free GiB", "largest free block GiB", "retries", "oom"]
    with pd.option_context("display.width", 250, "display.max_colwidth", 60, "display.float_format", "{:,.2f}".format):
        print(shown[columns].to_string(index=False))
    print(f"\nC4 (fragmentation wastes 30-50% of GPU memory): {judge_c4(results)}")
    print(f"done in {time.perf_counter() - started:.0f}s (projected rows: the allocator model on {gpu}'s capacity; "
          "the guide's scenario on a device with room for one more 1 GiB tensor)", file=sys.stderr)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.out, index=False)
        print(f"rows -> {printable(str(args.out))}", file=sys.stderr)
    return 0
