"""English text for language modelling: the documentation strings of Python's standard library.

The docstrings of a fixed list of standard-library modules (every module, class and function docstring,
read from the source with `ast`, so nothing is imported or run) are English prose with code in it, and
ship with every Python. Each docstring goes to the train, validation or test split by a hash of its
text, so the splits stay disjoint and deterministic even where a Python version adds or drops a few.
Text is modelled as UTF-8 bytes (a 256-symbol vocabulary), the setting bits per byte are quoted in.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import tokenize
import zlib
from dataclasses import dataclass

# Pure-Python modules present in CPython 3.11-3.13, chosen for prose-rich docstrings.
MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser", "contextlib", "copy",
    "csv", "dataclasses", "datetime", "difflib", "doctest", "email.message", "email.utils", "enum",
    "fractions", "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac", "html.parser",
    "http.client", "http.cookiejar", "http.server", "imaplib", "inspect", "ipaddress", "json", "locale",
    "logging", "logging.handlers", "mailbox", "mimetypes", "numbers", "optparse", "pathlib", "pdb",
    "pkgutil", "platform", "plistlib", "poplib", "pprint", "pydoc", "queue", "random", "re", "sched", "selectors",
    "shlex", "shutil", "smtplib", "socket", "socketserver", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "tokenize", "traceback", "typing", "unittest.case", "unittest.mock",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile",
    "_pydecimal", "_pyio",
)
MIN_CHARS = 40  # shorter docstrings ("Return self.") are boilerplate, not prose
SEPARATOR = b"\n\n"
TEST_BUCKET, VAL_BUCKET, BUCKETS = 0, 1, 10  # crc32 % 10: one tenth test, one tenth validation


@dataclass(frozen=True)
class Corpus:
    """The three splits as byte strings, how many docstrings each holds, and a fingerprint of the whole."""

    train: bytes
    val: bytes
    test: bytes
    documents: tuple[int, int, int]
    modules: int
    sha256: str

    def describe(self) -> str:
        return (f"{sum(self.documents):,} docstrings of {self.modules} stdlib modules, "
                f"{len(self.train):,}/{len(self.val):,}/{len(self.test):,} bytes train/val/test, "
                f"sha256 {self.sha256[:12]}")


def _source_path(name: str) -> str | None:
    spec = importlib.util.find_spec(name)
    origin = spec.origin if spec else None
    return origin if origin and origin.endswith(".py") else None


def docstrings(module: str) -> list[str]:
    """The module's, its classes' and its functions' docstrings, in source order (empty if not found)."""
    path = _source_path(module)
    if path is None:
        return []
    with tokenize.open(path) as handle:  # honours the file's encoding declaration
        tree = ast.parse(handle.read())
    nodes = (n for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef
                                                         | ast.AsyncFunctionDef))
    texts = (ast.get_docstring(node, clean=True) for node in nodes)
    return [text for text in texts if text and len(text) >= MIN_CHARS]


def bucket(text: str) -> int:
    return zlib.crc32(text.encode()) % BUCKETS


@functools.lru_cache(maxsize=1)
def load() -> Corpus:
    """The corpus, read once per process; RuntimeError if the standard library's sources are missing."""
    seen: set[str] = set()
    splits: dict[str, list[bytes]] = {"train": [], "val": [], "test": []}
    found = 0
    for module in MODULES:
        texts = docstrings(module)
        found += bool(texts)
        for text in texts:
            if text in seen:
                continue
            seen.add(text)
            b = bucket(text)
            splits["test" if b == TEST_BUCKET else "val" if b == VAL_BUCKET else "train"].append(text.encode())
    if not splits["test"] or not splits["train"]:
        raise RuntimeError("the standard library's Python sources were not found (a stripped Python without .py "
                           "files?); the text tasks need them")
    joined = {name: SEPARATOR.join(parts) for name, parts in splits.items()}
    digest = hashlib.sha256(b"".join(joined[k] for k in ("train", "val", "test"))).hexdigest()
    return Corpus(train=joined["train"], val=joined["val"], test=joined["test"],
                  documents=(len(splits["train"]), len(splits["val"]), len(splits["test"])),
                  modules=found, sha256=digest)
