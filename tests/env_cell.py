"""A cell entry point whose stack sets an environment variable, to test that the cell's process
restarts with it: the variable must be there when the process starts, before `import torch`."""

import os
import sys

SETTING = "HEADROOM_TEST_ALLOC_SETTING"
SEEN_AT_START = os.environ.get(SETTING)  # read before anything imports torch

from harness.measure import process  # noqa: E402  (after the read above, on purpose)
from suites.techniques import TECHNIQUES  # noqa: E402
from suites.techniques.base import Phase, Technique, always  # noqa: E402


def _set_environment(run) -> None:
    run.env[SETTING] = "on"
    run.notes.append(f"{SETTING} at process start: {SEEN_AT_START}")


TECHNIQUES["test-env"] = Technique(id="test-env", phase=Phase.RUNTIME, changes_numerics=False,
                                   summary="sets an environment variable (test only)", check=always,
                                   apply=_set_environment)

if __name__ == "__main__":
    sys.exit(process.main(sys.argv[1:]))
