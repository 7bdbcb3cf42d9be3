"""A cell entry point that fails on purpose, chosen by the cell's size field, to test isolation.

`raise` and `oom` go through the real `harness.cell.main` with a measurement that raises; the
others kill or stall the process in ways no Python handler can catch.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from harness import cell


def main(argv):
    behaviour = json.loads(Path(argv[0]).read_text())["cell"]["size"]
    if behaviour == "raise":
        cell.measure_cell = lambda *a, **k: (_ for _ in ()).throw(KeyError("injected failure"))
    elif behaviour == "oom":
        def out_of_memory(*a, **k):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        cell.measure_cell = out_of_memory
    elif behaviour == "segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif behaviour == "exit":
        os._exit(3)
    elif behaviour == "hang":
        time.sleep(600)
    return cell.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
