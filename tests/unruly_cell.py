"""A cell entry point that misbehaves in ways a runner must survive, chosen by the UNRULY environment
variable; it imports neither torch nor the harness, so it starts in milliseconds.

helper: starts a process that outlives the cell holding its stderr (its pid to UNRULY_PID), writes its
        row, exits.
chatty: writes megabytes to stderr, then one last line, and exits without a row.
greedy: allocates more memory than the runner's --cell-memory allows.
newer:  writes a row with a field this runner does not know (a checkout updated mid-run).
sleeper: writes its pid to the file UNRULY_PID names and sleeps.
"""

import json
import os
import subprocess
import sys
from pathlib import Path


def _row(spec: dict, **extra) -> dict:
    cell = spec["cell"]
    return {"run_id": spec["run_id"], "workload": cell["workload"], "size": cell["size"], "mode": cell["mode"],
            "technique": cell["technique"], "gpu": cell["gpu"], "source": "measured", "status": "ok",
            "cell_id": "unruly", **extra}


def main(argv):
    spec, result = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    behaviour = os.environ["UNRULY"]
    if behaviour == "helper":
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], stderr=sys.stderr)
        if "UNRULY_PID" in os.environ:
            Path(os.environ["UNRULY_PID"]).write_text(str(helper.pid))
        result.write_text(json.dumps(_row(spec)))
    elif behaviour == "chatty":
        for _ in range(5000):
            sys.stderr.write("x" * 1000 + "\n")
        sys.stderr.write("the last line\n")
        return 3
    elif behaviour == "greedy":
        block = bytearray(3 << 30)  # noqa: F841 (held until exit)
        result.write_text(json.dumps(_row(spec)))
    elif behaviour == "sleeper":
        import time

        Path(os.environ["UNRULY_PID"]).write_text(str(os.getpid()))
        time.sleep(120)
    elif behaviour == "newer":
        result.write_text(json.dumps(_row(spec, column_from_the_future=1)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
