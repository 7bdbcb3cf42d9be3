"""Markdown for pull requests and chat: a results frame's summary (`headroom report --format md`), and
the escaping and table helpers the comparison's summary (reports/compare.py) shares.

Every value is formatted by reports/format.py and escaped here, so a name from a results file can
neither break a table (`|`, a newline) nor smuggle markup into a page that renders Markdown as HTML.
"""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from reports import format as fmt

MAX_ROWS = 50  # per table: a summary a reviewer reads, not a dump; the rest is counted
_SPECIAL = re.compile(r"([\\`*_{}\[\]|#])")


def escape(value) -> str:
    """`value` as text safe in Markdown and in a table cell: control characters written as escapes
    (`\\n`), Markdown punctuation backslash-escaped, `<`, `>` and `&` as HTML entities."""
    text = "".join(char if char.isprintable() else repr(char)[1:-1] for char in str(value))
    text = _SPECIAL.sub(r"\\\1", text)
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def table(headers: list[str], rows: list[list[str]], right_from: int = 1, limit: int = MAX_ROWS) -> str:
    """A pipe table of already formatted (unescaped) cells, left-aligned up to column `right_from` and
    right-aligned after it (figures), with at most `limit` rows and a line counting the rest."""
    align = [":--" if index < right_from else "--:" for index in range(len(headers))]
    lines = ["| " + " | ".join(escape(header) for header in headers) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in rows[:limit]]
    if len(rows) > limit:
        lines += ["", f"... and {len(rows) - limit} more rows."]
    return "\n".join(lines)


# What only the HTML report draws, said once at the end of the summary so its absence is not read as "none".
HTML_ONLY = ("The HTML report (`--out report.html`) adds the guide's claims judged, the fit matrix, charts, OOM "
             "advice, the serving table, accuracy and fragmentation.")


def results_markdown(frame: pd.DataFrame, profiles: dict | None = None, prices: dict | None = None,
                     warnings: tuple[str, ...] = (), matrix: pd.DataFrame | None = None) -> str:
    """A short summary of a results frame: its runs, rows by source and status, the answer (which GPU and
    stack per model, reports/answer.py), the serving answer where a serving `matrix` is given, and per workload
    and mode the measured cells' median step time and peak reserved memory; `warnings` (a run read while going
    or cut short) first."""
    lines = ["## headroom results", ""] + [f"> **Warning:** {escape(warning)}." for warning in warnings]
    lines += [""] if warnings else []
    runs = sorted(frame["run_id"].dropna().unique()) if len(frame) else []
    lines += [f"{len(frame)} rows from {len(runs)} run{'' if len(runs) == 1 else 's'}"
              + (": " + ", ".join(escape(run) for run in runs) if runs else "") + ".", ""]
    if not len(frame):
        return "\n".join(lines + serving_markdown(matrix, profiles, prices) + [HTML_ONLY])
    lines += answer_markdown(frame, profiles, prices) + serving_markdown(matrix, profiles, prices)
    counts = frame.groupby(["source", "status"], sort=True).size()
    lines += [table(["source", "status", "rows"], [[str(source), str(status), str(count)]
                                                   for (source, status), count in counts.items()], right_from=2), ""]
    # The cell rows of measured cells (a parallel cell's per-rank rows repeat it: the cell row is the max).
    measured = frame[(frame["source"] == "measured") & frame["rank"].isna()]
    if measured.empty:
        lines += ["No measured cells: every figure here is projected.", "", HTML_ONLY]
        return "\n".join(lines)
    # Several runs may hold one cell: each row then says its run, so two figures of one cell are told apart.
    several = len(runs) > 1
    headers = ["size", "technique", "GPU", "batch", "status", "step time p50", "peak memory (reserved)"]
    headers = ["run", *headers] if several else headers
    for (workload, mode), group in measured.groupby(["workload", "mode"], sort=True):
        group = group.sort_values(["size", "technique", "gpu", "batch_size", "run_id"], kind="stable")
        rows = [[fmt.text(row["run_id"])] * several
                + [fmt.text(row["size"]), fmt.text(row["technique"]), fmt.text(row["gpu"]),
                   fmt.text(row["batch_size"]), fmt.text(row["status"]), step_time(row), peak_memory(row)]
                for _, row in group.iterrows()]
        lines += [f"### {escape(workload)} · {escape(mode)} (measured cells only)", "",
                  table(headers, rows, right_from=5 + several), ""]
    return "\n".join(lines + [HTML_ONLY])


def serving_markdown(matrix: pd.DataFrame | None, profiles: dict | None, prices: dict | None) -> list[str]:
    """The serving answer (reports/answer.serving_answers) as a table: per served size the cheapest GPU-hour that
    holds it, the fastest stream and the best value, at the report's prices."""
    from harness.prices import price_table
    from harness.profiles import load_profiles
    from reports.answer import serving_answers

    if matrix is None or not len(matrix):
        return []
    if prices is None:
        prices = price_table(load_profiles() if profiles is None else profiles)
    found = serving_answers(matrix, prices)

    def pick(value) -> str:
        if value is None:
            return "fits no GPU profile"
        price = f" ({value['price']})" if value["price"] else ""
        return f"{value['gpu']} · {value['weights']} weights: {value['what']}; {value['cost']}{price}"

    rows = [[a["size"], pick(a["picks"]["cheapest"]), pick(a["picks"]["fastest"]), pick(a["picks"]["value"])]
            for a in found]
    context = found[0]["context"] if found else ""
    return [f"### Serving a decoder (projected, {found[0]['decode'] if found else ''} decode, {context} context)", "",
            table(["size", "cheapest that holds it", "fastest stream", "best value"], rows, right_from=4), ""]


def step_time(row) -> str:
    """A measured row's median step time, marked where its repeats disagreed beyond the noise threshold."""
    text = milliseconds(row["step_time_ms_p50"])
    if row.get("noisy") is True or str(row.get("noisy")) == "True":
        spread = row.get("step_time_cv")
        text += " (noisy" + ("" if fmt.missing(spread) else f", cv {float(spread):.0%}") + ")"
    return text


def peak_memory(row) -> str:
    """A measured row's peak reserved bytes; on a device without a caching allocator (the CPU) its peak
    allocated bytes, said so, since nothing there is reserved beyond what is allocated."""
    reserved, allocated = row.get("peak_reserved_bytes"), row.get("peak_allocated_bytes")
    if fmt.missing(reserved) and not fmt.missing(allocated):
        return f"{fmt.bytes_(allocated)} allocated"
    return fmt.bytes_(reserved)


def answer_markdown(frame: pd.DataFrame, profiles: dict | None, prices: dict | None) -> list[str]:
    """The report's answer as a table: per model and mode, the best-value and the fastest GPU + stack."""
    from harness.prices import cost_rows, price_table
    from harness.profiles import load_profiles
    from harness.project.speed_constants import ratio_check
    from reports.answer import answers
    from reports.build import capacities_of, fitted_keys

    profiles = load_profiles() if profiles is None else profiles
    costed = cost_rows(frame, price_table(profiles) if prices is None else prices)
    check = ratio_check()  # ties judged as the HTML report judges them
    found = answers(costed, capacities_of(profiles), fitted_keys(profiles, check.get("gpus", [])),
                    check.get("worst_abs_error"))
    if not found:
        return []

    def pick(value, why: str) -> str:
        if value is None:
            return why
        price = f" ({value['price']})" if value["price"] else ""
        ties = f"; tie: {value['ties']}" if value["ties"] else ""
        basis = f" (interval: {value['basis']})" if value.get("basis") else ""
        passed = f"; {value['passed']}" if value.get("passed") else ""
        return (f"{value['gpu']} · {value['stack']} ({value['source']}): {value['speed']}{basis}; {value['cost']}"
                f"{price}; batch {value['batch']}, {value['left']}{ties}{passed}")

    def model(a) -> str:
        unpriced = f" (also fits, no price: {', '.join(a['unpriced'])})" if a.get("unpriced") else ""
        return a["mode"] + unpriced

    rows = [[a["workload"], a["size"], model(a), pick(a["picks"]["value"], a["why"]),
             pick(a["picks"]["fastest"], a["why"])] for a in found]
    return ["### The answer: best value and fastest GPU + stack per model", "",
            "Costs at on-demand USD per GPU-hour, each price dated; ranges are projection intervals or noise.", "",
            table(["workload", "size", "mode", "best value", "fastest"], rows, right_from=5), ""]


def milliseconds(value) -> str:
    return fmt.EMPTY if fmt.missing(value) else f"{fmt.number(value, 2)} ms"


def write_text(text: str, out: Path) -> Path:
    """Write a page (Markdown or HTML) atomically; the folder must exist or be creatable."""
    from harness.records import atomic_write_text

    out = Path(out)
    try:
        atomic_write_text(out, text if text.endswith("\n") else text + "\n")
    except OSError as exc:
        raise ValueError(f"cannot write {out} ({exc.strerror}); choose another --out") from None
    return out
