"""What one FSDP2 rank computes with under a MixedPrecisionPolicy (`fsdp:mp=bf16`): every block all-gathered
in bf16 and run in it, so no fp32 weight is cast per op and autocast's cast cache holds no 16-bit copies.
The projection traces the rank's model with its parameters in that dtype; parallel.py then restores the
fp32 shards, gradients and optimizer state the rank really keeps.
"""

from __future__ import annotations

from suites.techniques.base import Phase, Run, Technique
from suites.techniques.parallel import GATHER_DTYPES


def gathered_in(dtype: str) -> Technique:
    """A projection-only technique: the model's floating-point parameters in `dtype`, as FSDP2 gathers them."""

    def apply(run: Run) -> None:
        for parameter in run.model.parameters():
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(GATHER_DTYPES[dtype])
        if run.precision == "fp32":  # no autocast: every op computes in the gathered dtype
            run.precision = dtype
        run.notes.append(f"traced with the parameters in {dtype}, as FSDP2 gathers them; fp32 shards, gradients "
                         "and optimizer state restored per rank")

    return Technique(id=f"gathered-in:{dtype}", phase=Phase.PARALLEL, changes_numerics=True,
                     summary=f"parameters as FSDP2 gathers them, in {dtype} (projection only)",
                     check=lambda profile, workload, mode: None, apply=apply)
