"""Kernels registered with `torch.library` only while a context is open: how the trace lends the CPU
device what a GPU would do (its autocast lists, its fused kernels), then gives the CPU its own back.

Re-entrant and process-wide: the outermost entry registers, its exit destroys the library, which restores
what was there before (torch before 2.14 refuses a second Python registration of the same kernel, so
nested entries share the first one's). While open, every thread sees the lent kernels.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterable


class ScopedKernels:
    """`with scoped():` registers `kernels()` ((op name, kernel, dispatch key) triples) in the aten library."""

    def __init__(self, kernels: Callable[[], Iterable[tuple[str, Callable, str]]]) -> None:
        self._kernels = kernels
        self._lock = threading.Lock()
        self._depth = 0
        self._library = None

    @property
    def active(self) -> bool:
        """Whether a context is open (the kernels are registered)."""
        return self._depth > 0

    @contextlib.contextmanager
    def __call__(self):
        import torch

        with self._lock:
            if self._depth == 0:
                library = torch.library.Library("aten", "IMPL")
                try:
                    with warnings.catch_warnings():
                        # Re-registering a kernel the key already has warns "Overriding a previously
                        # registered kernel"; that is the point, and destroying the library restores it.
                        warnings.simplefilter("ignore")
                        for name, kernel, key in self._kernels():
                            library.impl(name, kernel, key)
                except BaseException:
                    library._destroy()
                    raise
                self._library = library
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._library._destroy()
                    self._library = None
