"""A cell entry point that fails on purpose, to test isolation; the behaviour is the cell's size.

The `faulty` workload has one size per behaviour; it is registered in the cell's process by
`main` and, for the runner to resolve its cells, in the test process by `registered`. `raise` and
`oom` go through the real process entry with a measurement that raises; the others kill or stall
the process in ways no Python handler can catch.
"""

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from harness.measure import process
from suites.workloads import WORKLOADS, gpt
from suites.workloads.base import SizeSpec

BEHAVIOURS = ("raise", "oom", "segfault", "exit", "hang")
FAULTY = dataclasses.replace(
    gpt.WORKLOAD, name="faulty",
    sizes={b: SizeSpec(b, "smoke", gpt.WORKLOAD.sizes["smoke"].config, batch_size=4, seq_len=8) for b in BEHAVIOURS})


@contextlib.contextmanager
def registered():
    """The faulty workload in the registry while the block runs."""
    WORKLOADS[FAULTY.name] = FAULTY
    try:
        yield
    finally:
        del WORKLOADS[FAULTY.name]


def main(argv):
    WORKLOADS[FAULTY.name] = FAULTY
    behaviour = json.loads(Path(argv[0]).read_text())["cell"]["size"]
    if behaviour == "raise":
        process.measure = lambda *a, **k: (_ for _ in ()).throw(KeyError("injected failure"))
    elif behaviour == "oom":
        def out_of_memory(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        process.measure = out_of_memory
    elif behaviour == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif behaviour == "exit":
        os._exit(3)
    elif behaviour == "hang":
        time.sleep(600)
    return process.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
