"""Schema migrations: a results frame written by an older headroom brought up to the current schema, one
version at a time. A column added by a version is unknown (empty) in older rows, never a made-up 0."""

from __future__ import annotations

import pandas as pd


def _v1_to_v2(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 2 added `noisy`: derive it from the coefficient of variation v1 already recorded."""
    from harness.records import DEFAULT_NOISE_THRESHOLD  # records imports this module: read at call time

    cv = pd.to_numeric(frame["step_time_cv"], errors="coerce")
    frame["noisy"] = [None if pd.isna(v) else bool(v > DEFAULT_NOISE_THRESHOLD) for v in cv]
    frame["schema_version"] = 2
    return frame


def _v2_to_v3(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 3 added projection columns (reserved under other allocator settings, device overhead,
    fit, error against the measured twin): unknown for rows written before them."""
    for column in ("peak_reserved_expandable_bytes", "peak_reserved_async_bytes", "device_overhead_bytes", "fits",
                   "peak_error_vs_measured", "step_time_error_vs_measured"):
        frame[column] = None
    frame["schema_version"] = 3
    return frame


def _v3_to_v4(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 4 added the reserved-memory error against the measured twin, the BLAS workspaces the
    projection counts inside the allocator and the CUDA allocator's retries: unknown before it."""
    frame["reserved_error_vs_measured"] = None
    frame["library_workspace_bytes"] = None
    frame["alloc_retries"] = None
    frame["schema_version"] = 4
    return frame


def _v4_to_v5(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 5 added the allocator setting of measured CUDA rows: not recorded before it."""
    frame["allocator"] = None
    frame["schema_version"] = 5
    return frame


def _v5_to_v6(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 6 added the mean step time, which throughput already encoded: batch / throughput."""
    batch = pd.to_numeric(frame["batch_size"], errors="coerce")
    throughput = pd.to_numeric(frame["throughput_samples_s"], errors="coerce")
    frame["step_time_ms_mean"] = [None if pd.isna(b) or pd.isna(t) or not t else 1e3 * b / t
                                  for b, t in zip(batch, throughput, strict=True)]
    frame["schema_version"] = 6
    return frame


def _v6_to_v7(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 7 added the projected rows' intervals; rows written before had none (unknown, not zero)."""
    for column in ("step_time_ms_low", "step_time_ms_high", "step_time_cells", "peak_reserved_low_bytes",
                   "peak_reserved_high_bytes", "peak_reserved_cells", "interval_basis"):
        frame[column] = None
    frame["schema_version"] = 7
    return frame


SERVING_COLUMNS = ("gen_len", "ttft_ms", "decode_ms_per_token_p50", "decode_ms_per_token_p90", "decode_tokens_s",
                   "prefill_tokens_s", "kv_cache_bytes", "decode_bytes_per_step", "decode_bandwidth_util")


def _v7_to_v8(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 8 added generation (serving) columns; a decoder's inference before it was one forward of
    the whole sequence, so its rows have none (unknown, not zero)."""
    for column in SERVING_COLUMNS:
        frame[column] = None
    frame["schema_version"] = 8
    return frame


NVML_COLUMNS = ("nvml_process_bytes", "nvml_device_used_bytes", "power_w_mean", "energy_j_per_sample",
                "sm_clock_mhz_mean", "temperature_c_max", "energy_usd_per_million_samples")


def _v8_to_v9(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 9 added NVML's readings of measured CUDA rows; none were sampled before it (unknown)."""
    for column in NVML_COLUMNS:
        frame[column] = None
    frame["schema_version"] = 9
    return frame


DISTRIBUTED_COLUMNS = ("rank", "comm_bytes_per_step")
OFFLOAD_AND_WARMUP_COLUMNS = ("host_bytes", "warmup_s")
ACCURACY_COLUMNS = ("accuracy_seeds", "accuracy_delta_ci95", "accuracy_verdict", "accuracy_agreement", "accuracy_kl",
                    "accuracy_basis")


def _v9_to_v10(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 10 added the accuracy measurement's seeds, interval, verdict, fidelity and basis, and the rank and
    communication of parallel cells; no row had an accuracy or ran on several ranks before it (unknown)."""
    for column in (*ACCURACY_COLUMNS, *DISTRIBUTED_COLUMNS):
        frame[column] = None
    frame["schema_version"] = 10
    return frame


def _v10_to_v11(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 11 added offloaded host bytes and the warm-up's seconds: neither was recorded before it."""
    for column in OFFLOAD_AND_WARMUP_COLUMNS:
        frame[column] = None
    frame["schema_version"] = 11
    return frame


def _v11_to_v12(frame: pd.DataFrame) -> pd.DataFrame:
    """Schema 12 added the projection's communication error against its measured twin (whose bytes are now
    counted as sent, harness/measure/comm_volume.py): unknown before it."""
    frame["comm_error_vs_measured"] = None
    frame["schema_version"] = 12
    return frame


# version -> function taking a frame of that version to the next one.
MIGRATIONS = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5, 5: _v5_to_v6, 6: _v6_to_v7, 7: _v7_to_v8,
              8: _v8_to_v9, 9: _v9_to_v10, 10: _v10_to_v11, 11: _v11_to_v12}


def migrate(frame: pd.DataFrame, version: int) -> pd.DataFrame:
    """Bring a frame written by schema `version` up to SCHEMA_VERSION, one step at a time."""
    from harness.records import SCHEMA_VERSION

    while version < SCHEMA_VERSION:
        frame = MIGRATIONS[version](frame)
        version += 1
    return frame
