"""Headless Chromium, for checking a report as a reader sees it: open a self-contained HTML file and get the
DOM after load with what the page wrote to its console (`render_in_browser`), or save a PNG of it
(`screenshot`). The report's browser test (tests/test_report_browser.py) and the README's screenshot
(`nox -s readme-screenshot`) use it; nothing else does, and it needs nothing beyond the standard library.

The browser is `$HEADROOM_CHROMIUM` where set, else the first of chromium, chromium-browser and google-chrome
on the PATH (`find_chromium`). Each call starts one browser process (`--headless`, the new headless mode of
current Chromium, with `--no-sandbox --disable-gpu` and a throwaway profile) and kills its process group if
it runs past the timeout; every failure is a BrowserError with one line saying what happened.

Console messages come from Chromium's log on stderr (`--enable-logging=stderr`), one `CONSOLE` entry per
message, uncaught exceptions included ("Uncaught Error: ..."). Chromium logs a web page's console messages at
one level whatever their kind, so console.log and console.error cannot be told apart there: every message
counts as an error (`BrowserView.errors`). A report runs no script, so anything on its console is unexpected.

    python -m reports.browser screenshot report.html report.png [--width 1600 --height 2400]
    python -m reports.browser check report.html     # prints the console messages; exit 1 if there are any
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV = "HEADROOM_CHROMIUM"
CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 60.0
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Every run: headless (the new mode where `--headless` means it), no sandbox (CI runs as root), no GPU, and
# nothing started beside the page (first-run UI, extensions, updates, background requests).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
         "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
         "--disable-component-update", "--mute-audio", "--enable-logging=stderr", "--v=0")

# A console entry in Chromium's log: `[pid:tid:time:INFO:CONSOLE:12] "text", source: URL (12)` (recent releases,
# Debian's 156 among them) or `[...:INFO:CONSOLE(12)] "text", source: URL (12)` (older ones). The text may span
# lines.
_CONSOLE = re.compile(r'^\[[^\]\n]*:CONSOLE(?::\d+|\(\d+\))\] "(?P<text>.*?)", '
                      r"source: (?P<source>.*?) \((?P<line>\d+)\)$", re.MULTILINE | re.DOTALL)
# Lines of Chromium's log that say nothing about the page (no D-Bus in a container, no GPU, the launcher).
_NOISE = re.compile(r"dbus|D-Bus|vaapi|drmGetDevices|sandbox_linux|unexpected operator|bluez|Floss|UPower", re.I)


class BrowserError(RuntimeError):
    """Chromium missing, failing or too slow: one line saying which."""


@dataclass(frozen=True)
class ConsoleMessage:
    text: str
    source: str
    line: int

    @property
    def uncaught(self) -> bool:
        """An exception no script caught (Chromium logs those on the console as `Uncaught ...`)."""
        return self.text.startswith("Uncaught")

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.text}"


@dataclass(frozen=True)
class BrowserView:
    """A page after load: its DOM serialized as HTML, and the messages it wrote to the console."""

    dom: str
    console: tuple[ConsoleMessage, ...]

    @property
    def errors(self) -> tuple[ConsoleMessage, ...]:
        """Every console message (see the module docstring: the log does not say which were errors)."""
        return self.console


def find_chromium() -> str | None:
    """The browser to drive: `$HEADROOM_CHROMIUM` where set (a path or a name on the PATH; None if it is
    neither), else the first of CANDIDATES on the PATH; None where there is none."""
    chosen = os.environ.get(ENV)
    if chosen:
        return shutil.which(chosen)
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def parse_console(log: str) -> tuple[ConsoleMessage, ...]:
    """The page's console messages in Chromium's stderr log, in order."""
    return tuple(ConsoleMessage(m["text"], m["source"], int(m["line"])) for m in _CONSOLE.finditer(log))


def render_in_browser(html_path: Path | str, timeout: float = TIMEOUT_S, chromium: str | None = None) -> BrowserView:
    """Open `html_path` and return its DOM after load (`--dump-dom`) and its console messages."""
    url = _file_url(html_path)
    stdout, stderr = _run(["--dump-dom", url], f"opening {html_path}", timeout, chromium)
    if not stdout.strip():
        raise BrowserError(f"chromium returned no DOM for {html_path}{_last_words(stderr)}")
    return BrowserView(dom=stdout, console=parse_console(stderr))


def screenshot(html_path: Path | str, png_path: Path | str, width: int = 1600, height: int = 2400,
               timeout: float = TIMEOUT_S, chromium: str | None = None) -> Path:
    """Save the top `width` x `height` CSS pixels of the page at `html_path` as a PNG (at scale 1, no scrollbars);
    the file is replaced only once the browser has written a whole PNG."""
    if width < 1 or height < 1:
        raise BrowserError(f"a screenshot needs a positive size, not {width}x{height}")
    url = _file_url(html_path)
    png_path = Path(png_path)
    with tempfile.TemporaryDirectory(prefix="headroom-shot-") as scratch:
        shot = Path(scratch) / "shot.png"
        _, stderr = _run([f"--screenshot={shot}", f"--window-size={width},{height}", "--hide-scrollbars",
                          "--force-device-scale-factor=1", url], f"taking a screenshot of {html_path}", timeout,
                         chromium)
        if not shot.is_file() or not shot.read_bytes().startswith(PNG_SIGNATURE):
            raise BrowserError(f"chromium wrote no PNG for {html_path}{_last_words(stderr)}")
        png_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(shot, png_path)
    return png_path


def _file_url(html_path: Path | str) -> str:
    path = Path(html_path)
    if not path.is_file():
        raise BrowserError(f"{html_path}: no such file")
    return path.resolve().as_uri()


def _run(args: list[str], what: str, timeout: float, chromium: str | None) -> tuple[str, str]:
    """Run the browser with FLAGS + `args` in a throwaway profile; (stdout, stderr). Output goes to files, not
    pipes, so a renderer outliving the browser cannot hold the call open; past `timeout` seconds the whole
    process group (browser, renderers, GPU process) is killed."""
    executable = chromium or find_chromium()
    if executable is None:
        raise BrowserError(f"no Chromium found: install chromium (Debian: apt-get install chromium) or set ${ENV}")
    with tempfile.TemporaryDirectory(prefix="headroom-chromium-", ignore_cleanup_errors=True) as scratch:
        scratch = Path(scratch)
        command = [executable, *FLAGS, f"--user-data-dir={scratch / 'profile'}", *args]
        with open(scratch / "stdout", "wb") as out, open(scratch / "stderr", "wb") as err:
            try:
                process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                           start_new_session=True)
            except OSError as exc:
                raise BrowserError(f"cannot start {executable} ({exc.strerror or exc})") from None
            try:
                returncode = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(process)
                raise BrowserError(f"{Path(executable).name} did not finish {what} within {timeout:g} s (killed; "
                                   "a page that opens an alert() or another dialog never finishes)") from None
        stdout = (scratch / "stdout").read_text(encoding="utf-8", errors="replace")
        stderr = (scratch / "stderr").read_text(encoding="utf-8", errors="replace")
    if returncode != 0:
        raise BrowserError(f"{Path(executable).name} exited with {returncode} {what}{_last_words(stderr)}")
    return stdout, stderr


def _kill_group(process: subprocess.Popen) -> None:
    """Kill the browser's own process group (it was started as a session leader) and reap the browser."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _last_words(stderr: str) -> str:
    """The last line of Chromium's stderr that is about the page or the browser, as `: line` (or nothing)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip() and not _NOISE.search(line)]
    return f": {lines[-1][:300]}" if lines else ""


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m reports.browser", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    shot = sub.add_parser("screenshot", help="save a PNG of an HTML file as headless Chromium draws it")
    shot.add_argument("html", type=Path)
    shot.add_argument("png", type=Path)
    shot.add_argument("--width", type=int, default=1600)
    shot.add_argument("--height", type=int, default=2400)
    check = sub.add_parser("check", help="print an HTML file's console messages; exit 1 if there are any")
    check.add_argument("html", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.command == "screenshot":
            out = screenshot(args.html, args.png, args.width, args.height)
            print(f"wrote {out} ({args.width}x{args.height})")
            return 0
        view = render_in_browser(args.html)
    except BrowserError as exc:
        print(f"reports.browser: {exc}", file=sys.stderr)
        return 2
    for message in view.console:
        print(message)
    print(f"{args.html}: {len(view.console)} console message(s)")
    return 1 if view.console else 0


if __name__ == "__main__":
    sys.exit(main())
