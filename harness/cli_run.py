"""`headroom run`: plan the cells, run each in its own process (measured here, projected for other GPUs),
then the stages a run adds (accuracy, the run's ledger twins, the serving matrix, the fragmentation
probe) and the report, with progress on stderr.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

from harness.cli import EXIT_CELLS_FAILED, _user_workloads
from harness.cli_args import UsageError, _profiles, printable


def _check_ranks(plan, local, world_size: int) -> None:
    """Refuse more ranks than this machine can hold before any starts: torchrun runs them all here, one
    GPU each with NCCL, or one process each on the CPU (gloo), where past a few per core they only queue."""
    if world_size == 1 or not any(cell.world_size > 1 for cell in plan.measured):
        return
    if local.vendor == "cpu":
        most, what = max(8, 4 * (os.cpu_count() or 1)), f"{os.cpu_count()} CPU cores"
    else:
        import torch

        most, what = torch.cuda.device_count(), "GPUs (one per rank)"
    if world_size > most:
        raise UsageError(f"--world-size {world_size}: this machine runs at most {most} ranks ({what}); "
                         f"project more GPUs instead: headroom project --dp {world_size} ...")


def _run_info(args, whole) -> dict:
    """What a run is asked, kept in its folder (records.RUN_INFO): the settings a resume must repeat, and which
    slice of which plan it is (`plan`: a digest of the whole plan's cells), so a report can tell a merge of
    shards that lacks one."""
    import hashlib

    from harness.plan import parse_shard

    plan = hashlib.sha256("\n".join(sorted(cell.cell_id for cell in whole.cells)).encode()).hexdigest()[:12]
    shard = "/".join(str(part) for part in parse_shard(args.shard)) if args.shard else None
    return {"warmup": args.warmup, "steps": args.steps, "repeats": args.repeats,
            "noise_threshold": args.noise_threshold, "shard": shard, "plan": plan}


def cmd_run(args) -> int:
    from rich.console import Console

    from harness.measure.local import MeasureSettings
    from harness.plan import plan_run
    from harness.profiles import detect_local, resolve_gpus
    from harness.records import DEFAULT_NOISE_THRESHOLD, ResultsStore, new_run_id
    from harness.runner import DEFAULT_CELL_TIMEOUT_S, RunnerOptions, default_cell_memory, interrupt, run_plan

    if args.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise UsageError("--tensorboard needs the tensorboard package: pip install tensorboard (nox installs it)")
    if args.resume and not args.out:
        raise UsageError("--resume continues the run in a results folder: give it with --out results/<run-id>")
    if args.retry_failed and not args.resume:
        raise UsageError("--retry-failed reruns the failed cells of an earlier run: give it with --resume")
    console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
    profiles = _profiles(args)
    local = detect_local(profiles)
    gpus = resolve_gpus(args.gpu, profiles) if args.gpu else None
    settings = MeasureSettings(warmup=args.warmup, steps=args.steps, repeats=args.repeats,
                               noise_threshold=args.noise_threshold or DEFAULT_NOISE_THRESHOLD,
                               memory_timeline=args.memory_timeline, profile=args.profile, usd_per_kwh=args.usd_per_kwh,
                               tensorboard_dir=str(args.tensorboard.resolve()) if args.tensorboard else None)
    plan = plan_run(local, gpus, workloads=(args.workload or []) + _user_workloads(args) or None,
                    stacks=args.technique, modes=args.mode, scale=args.scale, sizes=args.size,
                    batch_size=args.batch_size, profiles=profiles, require_device=args.require_device,
                    prompt_len=args.prompt_len, gen_len=args.gen_len, world_size=args.world_size)
    _check_ranks(plan, local, args.world_size)
    if args.shard:
        from harness.plan import parse_shard, shard

        whole, plan = plan, shard(plan, *parse_shard(args.shard))
    else:
        whole = plan
    measured, projected, foreign, cells = plan.measured, plan.projected, plan.foreign, plan.cells
    run_id = new_run_id()
    store = ResultsStore(args.out or Path("results") / run_id)
    run_id = store.open(run_id, resume=args.resume)
    store.keep_run_info(_run_info(args, whole), args.resume)
    out = store.root
    options = RunnerOptions(run_id=run_id, cell_timeout_s=args.cell_timeout or DEFAULT_CELL_TIMEOUT_S,
                            settings=dataclasses.replace(settings, artifacts_dir=str(out.resolve())),
                            profiles_dir=args.profiles,
                            cell_memory_bytes=args.cell_memory or default_cell_memory(),
                            heartbeat=lambda cell, seconds: console.print(
                                f"  ... {cell.describe()}: still running, {seconds:.0f} s of its "
                                f"{args.cell_timeout or DEFAULT_CELL_TIMEOUT_S:g} s limit (--cell-timeout)"))
    scope = f"sizes {', '.join(args.size)}" if args.size else f"scale {plan.scale}"  # --size picks over scales
    console.print(f"headroom run {run_id}: {len(measured)} measured cells on {local.name} ({local.id}), "
                  f"{scope}; {len(projected)} projected cells" + (f" (scale {plan.projected_scale} "
                                                                              "for other GPUs)"
                                                         if foreign else "") + f" -> {printable(str(out))}")
    if foreign:
        console.print(f"PROJECTED: {', '.join(g.id for g in foreign)} not on this machine (local device: {local.id}); "
                      f"their figures are projected from traces, not measured")
    started = time.perf_counter()

    def progress(index, total, cell, record):
        elapsed = time.perf_counter() - started
        if record is None:
            console.print(f"[{index}/{total}] {cell.describe()}: already recorded, skipped")
            return
        detail = record.reason
        if record.status == "ok":
            speed = (f"p50 {record.step_time_ms_p50:.2f} ms, {record.throughput_samples_s:.1f} samples/s, "
                     if record.step_time_ms_p50 is not None else "")
            # One repeat has no spread to measure: its cv is unknown, not 0%.
            spread = record.step_time_cv
            cv = "n/a (1 repeat)" if spread is None or spread != spread else f"{spread:.1%}"
            detail = (speed + f"peak {record.peak_allocated_bytes / 2**20:.1f} MiB"
                      + (f", NOISY (cv {cv}, mean {record.step_time_ms_mean:.2f} ms)" if record.noisy else ""))
        console.print(f"[{index}/{total} {elapsed:5.0f}s] {cell.describe()}: {record.status}  {detail}")
        # A file asked for (--memory-timeline, --profile, --tensorboard) that could not be kept is said here, not
        # only in the row's notes: the figures stand, the file does not exist.
        for lost in (part for part in (record.notes or "").split("; ") if " not kept: " in part):
            console.print(f"  warning: {lost}")

    # SIGTERM and SIGHUP end the run as Ctrl-C does: finished cells stay saved and --resume goes on (the
    # runner defers them while it traces in-process, where an exception inside autograd would abort).
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        signal.signal(getattr(signal, name), interrupt)
    records = run_plan(cells, profiles, store, options, on_done=progress, resume=args.resume,
                       retry_failed=args.retry_failed)
    from harness.cli_accuracy import accuracy_stage

    accuracy = accuracy_stage(args, whole, local, store, console)  # the whole plan's stacks (shard 1 measures)
    frame = store.write_frame()
    from harness.cli_speed import write_run_ledger

    write_run_ledger(frame, profiles, out, console)
    matrix = None
    if args.serve_matrix or plan.day_one:
        from harness.cli_serving import run_matrix

        matrix = run_matrix(plan, profiles, out, console, full=args.serve_matrix)
    fragmentation = None
    if plan.day_one:  # a first run judges every claim it can: C4 needs the probe
        from harness.cli_fragmentation import run_probe

        fragmentation = run_probe(plan, profiles, out, console)
    if not args.no_report:
        try:
            from reports.build import write_report
            from reports.timelines import timeline_files

            write_report([frame], out / "report.html", matrix, timeline_files([out]), fragmentation, accuracy=accuracy)
        except Exception as exc:  # the rows are saved; a report problem (a checkout updated mid-run) must not hide that
            console.print(f"headroom: report.html not written ({type(exc).__name__}: {str(exc)[:200]}); "
                          f"the results are saved: headroom report {out} --out FILE.html")
    counts = frame["status"].value_counts().to_dict()
    console.print(f"done in {time.perf_counter() - started:.0f}s: {len(records)} cells run, "
                  f"{len(frame)} rows ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}) "
                  f"-> {printable(str(out))}/results.parquet, results.csv"
                  + ("" if args.no_report else ", report.html"))
    failed = frame["status"].isin(["error", "timeout"]).sum()
    return EXIT_CELLS_FAILED if failed else 0
