"""A cell entry point for torchrun that hangs on one rank, for tests/test_parallel.py: rank 0 writes its row at
once, rank 1 sleeps until the runner's timeout kills the group. Imports neither torch nor the harness."""

import json
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    spec, result = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(600)
    cell = spec["cell"]
    row = {"run_id": spec["run_id"], "workload": cell["workload"], "size": cell["size"], "mode": cell["mode"],
           "technique": cell["technique"], "gpu": cell["gpu"], "source": "measured", "status": "ok",
           "cell_id": "rank-cell", "world_size": 2, "peak_allocated_bytes": 1024}
    result.with_name(f"{result.stem}.rank{rank}{result.suffix}").write_text(json.dumps(row))
