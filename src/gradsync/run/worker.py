"""One rank: logging, process group, seed, data, model, DDP, optimizer, loop, outputs.

A worker holds no Hydra state: it gets the resolved config as plain data and the run dir.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gradsync.components import build
from gradsync.config.schema import RunConfig
from gradsync.data.bundle import DataBundle, evaluate, train_loader
from gradsync.run.devices import (
    cpu_threads,
    device_name,
    local_placement,
    peak_memory_mb,
    rank_device,
    usable_cpus,
)
from gradsync.run.faults import (
    PROCESS_FLAG,
    StopAgreement,
    inject_failure,
    report_failure,
    signal_name,
)
from gradsync.run.ranks import is_rank0
from gradsync.run.slurm import task_has_own_cpus, watched_signals
from gradsync.sync.averaging import float_state
from gradsync.sync.comm import CommCounts, install_counting_hook
from gradsync.sync.policies import Policy
from gradsync.sync.shm_allreduce import over_shared_memory, shm_hook
from gradsync.torch_compat import ddp_buffer_sync
from gradsync.train import checkpoint
from gradsync.train import state as trainstate
from gradsync.train.loop import LoopSettings, Parts, Progress, train
from gradsync.train.metrics import RunLog, peak_rss_mb
from gradsync.train.normalize import build_normalizer
from gradsync.train.precision import build_precision
from gradsync.train.repro import (
    prepare_cuda_determinism,
    seed_everything,
    seed_rank,
    set_deterministic,
)
from gradsync.train.schedules import build_schedule, total_optimizer_steps

log = logging.getLogger("gradsync")


def setup_logging(run_dir: Path, rank: int) -> None:
    """Workers inherit no Hydra logging: every rank logs to logs/rank<r>.log, rank 0 also to
    stderr."""
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"[%(asctime)s][rank {rank}][%(levelname)s] %(message)s")
    log.handlers.clear()
    to_file = logging.FileHandler(run_dir / "logs" / f"rank{rank}.log")
    to_file.setFormatter(fmt)
    log.addHandler(to_file)
    if rank == 0:  # before the process group exists: the rank the launcher gave this worker
        to_console = logging.StreamHandler(sys.stderr)
        to_console.setFormatter(fmt)
        to_console.addFilter(lambda record: not record.exc_info)  # tracebacks: file only
        log.addHandler(to_console)
    log.setLevel(logging.INFO)
    log.propagate = False


def pick_backend(requested: str) -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


def build_parts(cfg: RunConfig, rank: int, world_size: int, device: torch.device) -> Parts:
    """Everything the loop needs, built from the run's config, on an initialised process
    group. Components come from their ``_target_``; each gets the run-time arguments it names."""
    tr, seed, micro = cfg.trainer, cfg.seed, cfg.micro_batch_size
    set_deterministic(tr.deterministic, device.type)
    seed_everything(seed)  # the same on every rank and for every world size: model init
    data: DataBundle = build(cfg.data, {"seed": seed}, extra=("micro_batch_size",))
    loader, sampler = train_loader(data.train, micro, rank, world_size, seed, data.collate,
                                   tr.num_workers, pin_memory=device.type == "cuda")
    model = build(cfg.model, data.sizes).to(device)
    seed_rank(seed, rank)  # from here on each rank draws from its own streams
    precision = build_precision(cfg.precision, device.type)
    counts = CommCounts()  # DDP's all-reduces, and a policy's own (local SGD's averaging)
    policy = Policy(build(cfg.sync, {"uses_scaler": precision.scaler is not None,
                                     "world_size": world_size, "counts": counts}))
    ignored = policy.bind(model)
    if ignored:  # the policy syncs these itself: DDP neither broadcasts nor all-reduces them
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=tr.gradient_as_bucket_view,
        bucket_cap_mb=tr.bucket_cap_mb,
        # replicas that train apart keep their own buffers until the policy averages them
        **ddp_buffer_sync(not policy.syncs_parameters),
    )
    inner = policy.comm_hook()
    if device.type == "cpu" and world_size > 1 and tr.allreduce != "process_group":
        # a slot holds the gradients, or what a policy's averaging sends (float buffers too)
        params, buffers = float_state(model)
        inner = over_shared_memory(inner, params + buffers if policy.syncs_parameters
                                   else params, tr.allreduce)
    install_counting_hook(ddp, inner, counts)
    shared = inner.hook is shm_hook
    transport = "shared_memory" if shared else "process_group"
    if shared:  # a policy that averages by itself may use the same slots
        policy.use_shared_memory(inner.state)
    optimizer = build(cfg.optimizer)(ddp.parameters())
    schedule = build_schedule(cfg.schedule, world_size, micro)
    total = total_optimizer_steps(schedule, tr.max_epochs, tr.max_steps, len(sampler), micro)
    normalizer = build_normalizer(cfg.loss.normalize, data.unit, world_size, device,
                                  data.tokens_per_sample)
    settings = LoopSettings(
        world_size=world_size, micro_batch_size=micro, max_epochs=tr.max_epochs,
        max_steps=tr.max_steps, total_steps=total, log_every=tr.log_every,
        eval_every=tr.eval_every, clip_grad_norm=tr.clip_grad_norm,
        checkpoint_every=tr.checkpoint_every, check_finite=precision.name == "fp32",
        check_replicas=tr.check_replicas if world_size > 1 else 0, allreduce=transport)
    return Parts(
        ddp=ddp,
        optimizer=optimizer,
        lr_scheduler=build(cfg.lr_scheduler, {"optimizer": optimizer, "total_steps": total}),
        loader=loader,
        sampler=sampler,
        schedule=schedule,
        policy=policy,
        precision=precision,
        loss=data.loss,
        evaluate=lambda: evaluate(ddp.module, data, rank, world_size, device),
        counts=counts,
        device=device,
        s=settings,
        normalizer=normalizer,
    )


def run_training(cfg: RunConfig, run_dir: Path,
                 device: torch.device | None = None) -> dict[str, Any]:
    """Train on the already initialised default process group (on `device`: by default the
    CPU on gloo, else this env:// rank's GPU); rank 0 writes the outputs. Returns the summary
    (on every rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if device is None:
        device = rank_device(dist.get_backend(), rank, world_size, spawned=False)
    p = build_parts(cfg, rank, world_size, device)
    tr = cfg.trainer
    # CPU-side agreement and RNG gathering, never a GPU sync (new_group's own default timeout
    # is 30 minutes: use the job's)
    control = (dist.new_group(backend="gloo", timeout=timedelta(seconds=tr.timeout_s))
               if world_size > 1 else None)
    ckpt_dir = run_dir / checkpoint.CKPT_DIR

    def save(p: Parts, state: Progress) -> None:  # p passed in: no Parts <-> closure cycle
        out = trainstate.capture(p, state, cfg.plain, control)
        if out is not None:
            checkpoint.write(out, ckpt_dir, tr.keep_checkpoints)

    p.checkpoint = save
    p.stop = StopAgreement(PROCESS_FLAG, control, world_size)
    if tr.fail_at_step >= 1:
        p.after_window.append(inject_failure(tr.fail_at_step, rank == world_size - 1))
    try:
        resumed_from = resume_path(cfg, run_dir, world_size, control)
        state = Progress()
        if resumed_from is not None:
            state = trainstate.restore(p, checkpoint.load(resumed_from), rank)
            log.info("resumed from %s at optimizer step %d", resumed_from, state.step)
        run_log = RunLog(run_dir, active=is_rank0(), total_steps=p.s.total_steps,
                         progress_bar=tr.progress_bar, start_window=state.windows)
        try:
            state = train(p, state, run_log)
            summary = summarize(cfg, p, state)
            newest = checkpoint.complete(ckpt_dir) if ckpt_dir.is_dir() else []
            summary.update(status="interrupted" if p.stop.agreed else "completed",
                           stopped_by=signal_name(p.stop.agreed) if p.stop.agreed else None,
                           checkpoint=str(newest[0]) if newest else None,
                           resumed_from=str(resumed_from) if resumed_from else None)
            run_log.summary(summary)
            if p.stop.agreed:
                log.info("stopped by %s after optimizer step %d", summary["stopped_by"],
                         state.step)
            if is_rank0() and newest:
                checkpoint.link_last(newest[0])
        finally:
            run_log.close()
    finally:
        if control is not None:
            dist.destroy_process_group(control)
    return summary


def resume_path(cfg: RunConfig, run_dir: Path, world_size: int,
                group: Any) -> Path | None:
    """The checkpoint every rank starts from: rank 0's choice. The job resolves `resume` to a
    path (or none) before it starts the workers; callers of run_training that pass `auto` get
    the same resolution here. Under torchrun each node's job resolved it on its own disk."""
    resume = cfg.resume
    mine = None
    if resume == "auto":
        mine = checkpoint.resolve_resume(resume, run_dir, cfg.plain, world_size, notes=[])
    elif resume != "none":
        mine = Path(resume)
    if world_size == 1:
        return mine
    chosen = [str(mine) if mine else None]
    dist.broadcast_object_list(chosen, src=0, group=group)
    path = Path(chosen[0]) if chosen[0] else None
    readable: list[Any] = [None] * world_size
    dist.all_gather_object(readable, path is None or path.is_file(), group=group)
    blind = [r for r, ok in enumerate(readable) if not ok]
    if blind:  # every rank raises alike: none is left waiting in a collective
        raise checkpoint.ResumeError(f"ranks {blind} cannot read rank 0's checkpoint {path}: "
                                     "resuming across nodes needs a shared filesystem")
    return path


def summarize(cfg: RunConfig, p: Parts, state: Progress) -> dict[str, Any]:
    """Per-rank counters gathered to every rank; the largest worker's peak RSS."""
    c = p.counts
    o = p.policy.overflow
    a = p.policy.averaging  # AveragingCounts: local SGD, DiLoCo
    mine = {"sync_backwards": c.sync_backwards, "allreduce_calls": c.allreduce_calls,
            "allreduce_bytes": c.allreduce_bytes, "peak_rss_mb": peak_rss_mb(),
            "amp_aborted_windows": o.aborted_windows, "allreduce_skipped": o.allreduce_skipped,
            "overflow_flag_allreduces": o.flag_allreduces, "threads": torch.get_num_threads(),
            "peak_gpu_mem_mb": peak_memory_mb(p.device), "device": device_name(p.device),
            "averaging": None if a is None else asdict(a), "groups": c.groups}
    gathered: list[Any] = [None] * p.s.world_size
    dist.all_gather_object(gathered, mine)

    def per_rank(key: str) -> list[Any]:
        return [g[key] for g in gathered]

    accum = sorted({p.schedule.accum_steps(e) for e in range(p.s.max_epochs)})
    return {
        "optimizer_steps": state.step,
        "epochs_completed": state.epoch,
        "samples_seen": state.samples_seen,
        "final_train_loss": state.last_loss,
        "eval": state.last_eval,
        "samples_per_s": state.samples_seen / state.train_s if state.train_s > 0 else 0.0,
        "train_s": state.train_s,
        "sync_backwards": per_rank("sync_backwards"),
        "allreduce_calls": per_rank("allreduce_calls"),
        "allreduce_bytes": per_rank("allreduce_bytes"),
        "peak_rss_mb": max(per_rank("peak_rss_mb")),
        "peak_gpu_mem_mb": per_rank("peak_gpu_mem_mb") if p.device.type == "cuda" else None,
        "threads": per_rank("threads"),
        "device": gathered[0]["device"],
        "windows": state.windows,
        "amp_skipped_steps": state.skipped_steps,
        "amp_final_scale": p.precision.scale,
        "amp_aborted_windows": per_rank("amp_aborted_windows"),
        "allreduce_skipped": per_rank("allreduce_skipped"),
        "overflow_flag_allreduces": per_rank("overflow_flag_allreduces"),
        "world_size": p.s.world_size,
        "accum_steps": accum[0] if len(accum) == 1 else accum,
        "micro_batch_size": p.s.micro_batch_size,
        "sync_policy": p.policy.name,
        "loss_normalize": p.normalizer.name,
        "precision": p.precision.name,
        "backend": dist.get_backend(),
        "allreduce": p.s.allreduce,
        "seed": cfg.seed,
    } | (averaging_summary(per_rank("averaging")) if a is not None else {}) \
      | group_summary(per_rank("groups"))


def group_summary(per_rank: list[dict[str, list[int]]]) -> dict[str, Any]:
    """sync.groups: each group's all-reduce calls and bytes per rank (`rest`: the parameters
    no rule matched)."""
    if not per_rank[0]:
        return {}
    return {"allreduce_groups": {g: {"calls": [r[g][0] for r in per_rank],
                                     "bytes": [r[g][1] for r in per_rank]}
                                 for g in per_rank[0]}}


def averaging_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Local SGD / DiLoCo: averaging rounds, each rank's own skipped fp16 steps, and the largest
    replica drift measured before an averaging on any rank."""
    return {"averagings": per_rank[0]["averagings"],
            "local_skipped_steps": [r["local_skipped_steps"] for r in per_rank],
            "max_replica_drift": max(r["max_replica_drift"] for r in per_rank)}


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: int,
                       store_port: int | None) -> dist.Store | None:
    """Join the job's group: through the launcher's TCPStore (spawned workers; returned), or
    through torchrun's env:// variables (store_port None)."""
    timeout = timedelta(seconds=timeout_s)
    if store_port is None:
        dist.init_process_group(backend, timeout=timeout)
        return None
    store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return store


def worker_main(rank: int, world_size: int, cfg: RunConfig, run_dir: str,
                store_port: int | None) -> None:
    """Entry point of one rank (spawned by the launcher, or the torchrun process itself)."""
    # SIGTERM/SIGINT (and SLURM's SIGUSR1/2): finish the step, checkpoint, stop (faults.py)
    PROCESS_FLAG.install(watched_signals())
    run_path = Path(run_dir)
    setup_logging(run_path, rank)
    tr = cfg.trainer
    spawned = store_port is not None
    threads = tr.threads_per_worker or cpu_threads(
        local_placement(rank, world_size, spawned)[1],
        own_mask=not spawned and task_has_own_cpus(usable_cpus()))
    torch.set_num_threads(threads)
    backend = pick_backend(tr.backend)
    device = rank_device(backend, rank, world_size, spawned)
    if device.type == "cuda":
        prepare_cuda_determinism(tr.deterministic)  # before the first CUDA call
        torch.cuda.set_device(device)  # this rank's context, on its own GPU only
    init_process_group(backend, rank, world_size, tr.timeout_s, store_port)
    log.info("rank %d/%d up: backend=%s device=%s threads=%d pid=%d", rank, world_size, backend,
             device, threads, os.getpid())
    try:
        run_training(cfg, run_path, device)
    except Exception as e:
        report_failure(e)  # to the launcher that spawned this rank (faults.py)
        log.exception("rank %d failed (traceback in logs/rank%d.log)", rank, rank)
        raise
    finally:
        dist.destroy_process_group()
