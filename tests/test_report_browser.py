"""The report in a real browser (headless Chromium, reports/browser.py): no console errors, every chart drawn,
a `<script>` name shown as text, and a screenshot. Skips, saying why, where no Chromium is installed
(.ci/run installs Debian's `chromium`). The parser and timeout tests need no browser."""

from __future__ import annotations

import json
import os
import stat
import time
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from harness.records import Record, records_frame
from harness.serve_matrix import read_matrix
from reports.browser import (
    ENV,
    PNG_SIGNATURE,
    BrowserError,
    find_chromium,
    parse_console,
    render_in_browser,
    screenshot,
)
from reports.build import write_report

XSS = "<script>alert(1)</script>"
GIB = 2**30


@pytest.fixture(scope="module")
def chromium() -> str:
    found = find_chromium()
    if found is None:
        pytest.skip("chromium not installed: none of chromium, chromium-browser, google-chrome on the PATH"
                    f"{' and $' + ENV + ' names no program' if os.environ.get(ENV) else ''} "
                    "(.ci/run installs it: apt-get install chromium)")
    return found


class Dom(HTMLParser):
    """What the tests look at in a page: its text, its <script> and <svg> elements, and for each
    `<figure class="chart">` whether an <svg> is inside it."""

    def __init__(self, html: str):
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.scripts = self.svgs = 0
        self.charts: list[bool] = []  # one per figure.chart: holds an svg
        self._figures: list[int | None] = []  # open figures: index into charts, None for other figures
        self.feed(html)
        self.close()

    def handle_starttag(self, tag, attrs):
        if tag == "script":
            self.scripts += 1
        elif tag == "svg":
            self.svgs += 1
            for index in self._figures:
                if index is not None:
                    self.charts[index] = True
        elif tag == "figure":
            if "chart" in (dict(attrs).get("class") or "").split():
                self.charts.append(False)
                self._figures.append(len(self.charts) - 1)
            else:
                self._figures.append(None)

    def handle_endtag(self, tag):
        if tag == "figure" and self._figures:
            self._figures.pop()

    def handle_data(self, data):
        self.text.append(data)


def _record(**kw) -> dict:
    base = dict(run_id="run-1", workload="gpt", size="small", mode="train", technique="baseline", gpu="cpu",
                source="measured", status="ok", reason="", notes="")
    base.update(kw)
    return Record(**base).to_dict()


def _timeline(folder: Path) -> Path:
    """A kept memory timeline (harness/measure/artifacts.py's JSON: microsecond times, then bytes per category
    after a leading unused column) for the report to draw."""
    path = folder / "timelines" / "gpt-small-train-baseline.json"
    path.parent.mkdir(parents=True)
    sizes = [[0, 100 * 2**20, 200 * 2**20, 4 * 2**20, t * 2**20, 50 * t * 2**20, 0, 0, 0] for t in range(5)]
    path.write_text(json.dumps([[1_000 * t for t in range(5)], sizes]))
    return path


def _matrix(folder: Path) -> pd.DataFrame:
    """A serving fit matrix as `headroom serve-matrix --out` writes it, read back the way the report reads it."""
    path = folder / "serve_matrix.csv"
    pd.DataFrame([
        {"size": size, "gpu": gpu, "weights": "bf16", "max_batch_4k": batch, "params_bytes": params,
         "peak_reserved_b1_bytes": reserved, "decode_tokens_s_b1": speed, "notes": note}
        for size, gpu, batch, params, reserved, speed, note in [
            ("gpt-13b", "a100-sxm4-80gb", 15, 26e9, 30 * GIB, 56.0, f"{XSS} note"),
            ("gpt-13b", "h100-sxm", 15, 26e9, 30 * GIB, 90.0, ""),
            ("gpt-70b", "a100-sxm4-80gb", 0, 141e9, 150 * GIB, None, ""),
            ("gpt-70b", "h100-sxm", 0, 141e9, 150 * GIB, None, "")]]).to_csv(path, index=False)
    return read_matrix(path)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A report of a measured cell, its projections onto two GPU profiles, a row whose technique is a
    `<script>` element, a serving matrix and a memory timeline (the two charts)."""
    folder = tmp_path_factory.mktemp("browser")
    measured = dict(batch_size=8, precision="fp32", peak_allocated_bytes=3 * 2**20, peak_reserved_bytes=4 * 2**20,
                    step_time_ms_p50=12.5, step_time_ms_p90=13.0, throughput_samples_s=640.0,
                    device_name="cpu", torch_version="2.6.0", hostname="box")
    projected = dict(source="projected", batch_size=8, precision="bf16", peak_allocated_bytes=6 * GIB,
                     peak_reserved_bytes=7 * GIB, params_bytes=GIB, grads_bytes=GIB, optimizer_bytes=2 * GIB,
                     activations_bytes=2 * GIB, mfu=0.3, fits=True)
    frame = records_frame([
        _record(cell_id="m", **measured),
        _record(cell_id="p1", gpu="a100-sxm4-80gb", step_time_ms_p50=0.4, throughput_samples_s=20_000.0,
                **projected),
        _record(cell_id="p2", gpu="h100-sxm", step_time_ms_p50=0.2, throughput_samples_s=40_000.0, **projected),
        _record(cell_id="x", technique=XSS, gpu="h100-sxm", source="projected", status="unsupported",
                reason=f"unknown technique {XSS}"),
    ])
    return write_report([frame], folder / "report.html", matrix=_matrix(folder), timelines=[_timeline(folder)])


@pytest.fixture(scope="module")
def view(chromium, report):
    # A name that ran as a script would open alert(), which headless Chromium waits on: the call times out.
    return render_in_browser(report, timeout=30, chromium=chromium)


def test_the_report_has_no_console_errors(view):
    assert not view.errors, "console: " + "; ".join(map(str, view.errors))


def test_a_script_name_renders_as_text(view, report):
    dom, source = Dom(view.dom), Dom(report.read_text(encoding="utf-8"))
    assert XSS in "".join(dom.text)  # shown as the characters, not run
    assert dom.scripts == source.scripts == 0


def test_every_chart_is_present(view, report):
    dom, source = Dom(view.dom), Dom(report.read_text(encoding="utf-8"))
    assert source.svgs >= 2, "the fixture draws the serving matrix and a memory timeline"
    assert dom.svgs == source.svgs
    assert len(dom.charts) == len(source.charts) and all(dom.charts), f"figure.chart holding an svg: {dom.charts}"


def test_the_report_screenshot_is_a_png(chromium, report, tmp_path):
    out = screenshot(report, tmp_path / "shots" / "report.png", width=1600, height=1200, chromium=chromium)
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000
    assert int.from_bytes(data[16:20], "big") == 1600 and int.from_bytes(data[20:24], "big") == 1200


def test_a_page_with_console_errors_is_caught(chromium, tmp_path):
    """What makes the no-console-errors check able to fail: a deliberate console.error and a thrown error
    on a page Chromium opens are both found."""
    page = tmp_path / "broken.html"
    page.write_text('<!doctype html><html><body><p>x</p><script>console.error("deliberate error")</script>'
                    '<script>throw new Error("thrown on purpose")</script></body></html>')
    texts = [message.text for message in render_in_browser(page, chromium=chromium).errors]
    assert "deliberate error" in texts
    assert "Uncaught Error: thrown on purpose" in texts


def test_console_entries_are_read_from_both_log_formats():
    log = "\n".join([
        "[123:456:1202/030701.292639:ERROR:dbus/bus.cc:405] Failed to connect to the bus",
        '[123:123:1202/030701.764394:INFO:CONSOLE:2] "deliberate-x", source: file:///tmp/a.html (2)',
        '[0100/000000.000000:INFO:CONSOLE(7)] "Uncaught TypeError: x is not a function", source: file:///b.html (7)',
        '[123:123:1202/030701.764394:INFO:CONSOLE:9] "two',
        'lines", source: file:///tmp/a.html (9)',
        "[123:123:1202/030701.764394:WARNING:ui/base/idle/idle_linux.cc:111] None of the known services",
    ])
    messages = parse_console(log)
    assert [(m.text, m.source, m.line) for m in messages] == [
        ("deliberate-x", "file:///tmp/a.html", 2), ("Uncaught TypeError: x is not a function", "file:///b.html", 7),
        ("two\nlines", "file:///tmp/a.html", 9)]
    assert [m.uncaught for m in messages] == [False, True, False]
    assert parse_console("[1:1:0101/000000.0:INFO:CONSOLE_LOGGER:1] nothing\n") == ()


def test_a_hung_browser_is_killed_with_a_one_line_error(tmp_path, monkeypatch):
    fake = tmp_path / "fake-chromium"
    child = tmp_path / "child.pid"
    fake.write_text(f"#!/bin/sh\nsleep 30 &\necho $! > {child}\nsleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    page = tmp_path / "page.html"
    page.write_text("<p>x</p>")
    monkeypatch.setenv(ENV, str(fake))
    assert find_chromium() == str(fake)
    with pytest.raises(BrowserError, match=r"^fake-chromium did not finish opening .* within 1 s \(killed; .*\)$"):
        render_in_browser(page, timeout=1)
    assert _dies(int(child.read_text())), "the browser's children are killed with it"
    monkeypatch.setenv(ENV, str(tmp_path / "absent"))
    assert find_chromium() is None
    with pytest.raises(BrowserError, match="no Chromium found"):
        render_in_browser(page)


def _dies(pid: int, within_s: float = 5.0) -> bool:
    """Whether `pid` stops running within a few seconds (SIGKILL lands asynchronously); a zombie waiting for a
    parent that does not reap, as PID 1 of a container may not, is dead."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
