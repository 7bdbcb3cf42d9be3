"""Import PyTorch's MemTracker without the rest of its package.

`torch.distributed._tools/__init__.py` imports the FSDP memory tracker and the runtime estimator, which
pull in FSDP and TorchInductor: about half a second of every `headroom project` call for modules the
trace never uses. Python offers no way to import a submodule without its package's __init__, so this
loads `mem_tracker` under a bare stand-in for the package (its own imports of sibling modules work
through the stand-in's path), then removes the stand-in so that a later plain import of the package
runs the real __init__ (which reuses the already imported module). Any surprise falls back to the
plain import.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
import warnings
from contextlib import contextmanager

PACKAGE = "torch.distributed._tools"


def import_mem_tracker() -> types.ModuleType:
    """The `torch.distributed._tools.mem_tracker` module, imported without its package's __init__."""
    name = f"{PACKAGE}.mem_tracker"
    if name in sys.modules or PACKAGE in sys.modules:
        return importlib.import_module(name)
    try:
        import torch.distributed  # noqa: F401  (the parent package, imported as usual)

        spec = importlib.util.find_spec(PACKAGE)
        stand_in = types.ModuleType(PACKAGE)
        stand_in.__path__ = list(spec.submodule_search_locations)
        stand_in.__spec__ = spec
        stand_in.__package__ = PACKAGE
        sys.modules[PACKAGE] = stand_in
        try:
            return importlib.import_module(name)
        finally:
            # The stand-in goes; the submodules it imported stay in sys.modules for the real package.
            if sys.modules.get(PACKAGE) is stand_in:
                del sys.modules[PACKAGE]
    except Exception:  # a torch whose package layout differs: pay for the full import
        sys.modules.pop(name, None)
        return importlib.import_module(name)


@contextmanager
def quiet_module_tracking():
    """Silence ModTracker's "the module hierarchy tracking maybe be messed up" (MemTracker and FlopCounterMode
    track which module each op runs in with it): it warns where a model re-enters a module it is already inside
    (Transformers' models do), which moves no byte between the tracker's categories and no FLOP from the total,
    the only figures read here, so to a user it says nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The module hierarchy tracking maybe be messed up")
        yield
