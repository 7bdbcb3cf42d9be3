"""`headroom report`: merge results folders and files (with the serving matrices, fragmentation probes
and memory timelines kept beside them) into one HTML report (reports/build.py renders it) or a Markdown
summary (reports/markdown.py); with `--compare OLD NEW`, which cells got better or worse beyond their
noise (reports/compare.py)."""

from __future__ import annotations

import sys

from harness.cli_args import UsageError, _profiles, guard_output, printable


def cmd_report(args) -> int:
    from harness.records import read_results
    from reports.build import write_report

    if args.compare and len(args.results) != 2:
        raise UsageError(f"--compare takes exactly two results, OLD and NEW (got {len(args.results)})")
    if args.compare and args.serve_matrix:
        raise UsageError("--serve-matrix draws a serving matrix in a report; --compare does not use it")
    guard_output(args.out)
    out = args.out.resolve()
    for path in args.results:
        given = path.resolve()
        inputs = [given / "results.parquet", given / "results.csv", given / "cells"] if path.is_dir() else [given]
        if any(out == item or item in out.parents for item in inputs):
            raise UsageError(f"--out {args.out} would overwrite the results it reads ({path}); choose another file")
    markdown = _is_markdown(args)
    if args.compare:
        return _compare(args, markdown)
    import pandas as pd

    from harness.prices import price_table

    profiles = _profiles(args)
    prices = price_table(profiles, args.prices)  # a bad --prices file fails before any work

    from harness.serve_matrix import MATRIX_FILE, read_matrix

    matrices = [read_matrix(path / MATRIX_FILE) for path in args.results if (path / MATRIX_FILE).is_file()]
    matrices += [read_matrix(path) for path in args.serve_matrix or []]
    frames = [read_results(path) for path in args.results]
    empty = ", ".join(printable(str(path)) for path, frame in zip(args.results, frames, strict=True)
                      if not len(frame))
    if empty and all(not len(frame) for frame in frames) and not matrices:
        raise UsageError(f"{empty}: no rows (a header only), nothing to report; give a run's results "
                         "(headroom run writes them) or its folder")
    if empty:
        print(f"headroom: note: {empty} held no rows; the report is built from the others", file=sys.stderr)
    # The same run given twice (a folder and its results.csv, or a copy) is one set of rows: a row equal
    # to another in every column is the same row read twice.
    merged = pd.concat(frames, ignore_index=True)
    unique = merged[~merged.astype(str).duplicated(keep="first")]
    repeated = len(merged) - len(unique)
    counted = f" ({repeated} repeated rows of the same runs counted once)" if repeated else ""
    cut_short = tuple(frame.attrs["cut_short"] for frame in frames if frame.attrs.get("cut_short"))
    shards = _missing_shards(args.results)
    for warning in shards:
        print(f"headroom: warning: {warning}", file=sys.stderr)
    cut_short += shards
    from harness.serve_matrix import merged_matrices

    matrix = merged_matrices(matrices)
    if markdown:
        from reports.markdown import results_markdown, write_text

        write_text(results_markdown(unique, profiles, prices, cut_short, matrix), args.out)
        print(f"wrote {printable(str(args.out))} (Markdown) from {len(unique)} rows{counted}"
              + (" and a serving matrix" if matrix is not None and len(matrix) else ""))
        return 0
    from reports.accuracy import FILE as ACCURACY_FILE
    from reports.fragmentation import FILE as FRAGMENTATION_FILE
    from reports.timelines import timeline_files

    probes, accuracy = _side_files(args.results, FRAGMENTATION_FILE), _side_files(args.results, ACCURACY_FILE)
    write_report([unique], args.out, matrix, timeline_files(args.results), probes, accuracy=accuracy, prices=prices,
                 profiles=profiles, warnings=cut_short)
    print(f"wrote {printable(str(args.out))} from {len(unique)} rows{counted}")
    return 0


def _missing_shards(paths) -> tuple[str, ...]:
    """For the results folders that are slices of one plan (`headroom run --shard I/N`), the slices not given:
    a report of some of them is not the plan's."""
    from harness.records import ResultsStore

    slices: dict[str, tuple[int, set[int]]] = {}
    for path in paths:
        info = ResultsStore(path).run_info() if path.is_dir() else None
        if info and info.get("shard"):
            index, count = (int(part) for part in str(info["shard"]).split("/"))
            slices.setdefault(str(info.get("plan")), (count, set()))[1].add(index)
    warnings = []
    for count, given in slices.values():
        missing = sorted(set(range(1, count + 1)) - given)
        if missing:
            warnings.append(f"slices {', '.join(f'{i}/{count}' for i in missing)} of a sharded run are not among "
                            f"these results: the report holds {len(given)} of its {count} slices")
    return tuple(warnings)


def _is_markdown(args) -> bool:
    """Whether to write Markdown: --format, else the --out file's suffix; a suffix that says one kind while
    --format asks for the other, or that says neither without --format, is refused."""
    suffix = args.out.suffix.lower()
    kind = {".html": "html", ".htm": "html", ".md": "md"}.get(suffix)
    if kind is None and args.format is None:
        raise UsageError(f"--out {printable(str(args.out))}: name the report .html or .md, or give --format html|md")
    if kind and args.format and args.format != kind:
        raise UsageError(f"--format {args.format} writes {'Markdown' if args.format == 'md' else 'HTML'}, but --out "
                         f"names a {suffix} file: drop --format or change the name")
    return (args.format or kind) == "md"


def _compare(args, markdown: bool) -> int:
    """`--compare OLD NEW`: every matched cell's figures judged against their noise (reports/compare.py)."""
    from harness.records import read_results
    from reports.compare import compare_results, counts_line, write_comparison

    old_path, new_path = args.results
    comparison = compare_results(read_results(old_path), read_results(new_path))
    write_comparison(comparison, args.out, printable(str(old_path)), printable(str(new_path)), markdown=markdown)
    print(f"wrote {printable(str(args.out))}{' (Markdown)' if markdown else ''}: {counts_line(comparison)}")
    return 0


def _side_files(results, name: str):
    """The `name` CSV files kept beside the given results folders, as one frame (None if there are none)."""
    import pandas as pd

    frames = []
    for path in results:
        if (path / name).is_file():
            try:
                frames.append(pd.read_csv(path / name))
            except (OSError, ValueError) as exc:  # a damaged side file must not cost the report
                print(f"headroom: skipped {printable(str(path / name))}: {exc}", file=sys.stderr)
    return pd.concat(frames, ignore_index=True) if frames else None
