"""One rank: logging, process group, seed, data, model, engine, optimizer, loop.

A worker holds no Hydra state: it gets the checked ``RunConfig``, its placement and the run dir,
and returns the run's summary (the job process writes summary.json: run/summary.py).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gradsync.components import build
from gradsync.config.schema import RunConfig
from gradsync.core import numerics
from gradsync.core.devices import check_own_gpu, cpu_threads, usable_cpus
from gradsync.core.memory import MemoryMeter
from gradsync.core.ranks import is_rank0
from gradsync.core.seeds import seed_everything, seed_rank
from gradsync.data.contract import FirstBatchChecked, build_data
from gradsync.data.evaluation import evaluate
from gradsync.data.loader import train_loader
from gradsync.engines import build_engine, settings_of
from gradsync.engines.compiled import Compile
from gradsync.engines.trace import TRACE_DIR
from gradsync.models import model_call
from gradsync.run import summary as run_summary
from gradsync.run.faults import (
    PROCESS_FLAG,
    StopAgreement,
    report_failure,
    signal_name,
)
from gradsync.run.placement import Placement, of_process_group
from gradsync.run.slurm import task_has_own_cpus, watched_signals
from gradsync.sync.comm import CommCounts
from gradsync.sync.policy import as_policy
from gradsync.train import checkpoint, lr_scaling, sharded_checkpoint
from gradsync.train import noise_scale as noise
from gradsync.train import state as trainstate
from gradsync.train.loop import Parts, Progress, train
from gradsync.train.metrics import RunLog, tracking_of
from gradsync.train.normalize import build_normalizer, resolve, shared_steps
from gradsync.train.precision import build_precision
from gradsync.train.repro import prepare_cuda_determinism, record_numerics, set_deterministic
from gradsync.train.schedules import build_schedule, total_optimizer_steps
from gradsync.train.weight_decay import build_optimizer

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


def build_parts(cfg: RunConfig, rank: int, world_size: int, device: torch.device) -> Parts:
    """Everything the loop needs, built from the run's config, on an initialised process
    group. Components come from their ``_target_``; each gets the run-time arguments it names."""
    tr, seed, micro = cfg.trainer, cfg.seed, cfg.micro_batch_size
    memory = MemoryMeter(device)
    set_deterministic(tr.deterministic, device.type)
    seed_everything(seed)  # the same on every rank and for every world size: model init
    data = build_data(cfg.data.node, seed)
    loader, sampler = train_loader(data.train, micro, rank, world_size, seed, data.collate,
                                   tr.num_workers, pin_memory=device.type == "cuda")
    model_node, call = model_call(cfg.model.node)  # _forward_: how the loop calls the model
    model = build(model_node, data.sizes).to(device)
    seed_rank(seed, rank)  # from here on each rank draws from its own streams
    counts = CommCounts()  # the engine's all-reduces, and a policy's own (local SGD's averaging)
    policy = as_policy(build(cfg.sync.node, {"uses_scaler": cfg.precision.name == "fp16",
                                             "world_size": world_size, "counts": counts}),
                       cfg.sync.target)
    precision = build_precision(cfg.precision, device.type, policy)  # its overflow handling
    unit = resolve(cfg.loss.normalize, data.unit)  # the loss's unit: samples or tokens
    meter = (noise.NoiseScale(world_size, device, unit, cfg.noise_scale.decay,
                              model.parameters()) if noise.measures(cfg) else None)
    probe = {"probe": meter.probe} if meter is not None and meter.probe is not None else {}
    engine = build_engine(cfg.engine.name, policy, settings_of(cfg.engine), model=model,
                          device=device, world_size=world_size, rank=rank, counts=counts,
                          memory=memory, precision=cfg.precision.name,
                          compile=Compile(cfg.compile.backend, cfg.compile.mode,
                                          cfg.compile.dynamic) if cfg.compile.enabled else None,
                          **probe)
    # the optimizer's parameters in groups where optimizer.no_decay says (train/weight_decay.py)
    optimizer = build_optimizer(cfg.optimizer.node, engine.module, engine.parameters())
    schedule = build_schedule(cfg.schedule, world_size, units_per_sample=(
        data.tokens_per_sample if unit == "tokens" else 1.0))
    scaling, tick = cfg.lr_scaling, lr_scaling.clock(cfg.lr_scaling.name, cfg.schedule.name)
    reference = lr_scaling.reference_batch(scaling, world_size, micro, schedule.window_size(0))
    if tick == "steps":
        total = total_optimizer_steps(schedule, tr.max_epochs, tr.max_steps, len(sampler), micro)
    else:  # the number of steps is not known in advance: the horizon in reference batches
        largest = world_size * micro * schedule.largest(tr.max_epochs)
        total = lr_scaling.horizon(tr.max_epochs, tr.max_steps,
                                   len(data.train), reference, largest)  # type: ignore[arg-type]
    lr_scheduler = build(cfg.lr_scheduler.node, {"optimizer": optimizer, "total_steps": total})
    if lr_scaling.needed(scaling.name, cfg.schedule.name):
        lr_scheduler = lr_scaling.ScaledLR(lr_scheduler, optimizer, scaling.name, reference, tick)
    normalizer = build_normalizer(cfg.loss.normalize, data.unit, world_size, device,
                                  data.tokens_per_sample,
                                  policy.averager.local_step if policy.averager else shared_steps,
                                  uniform=data.uniform_length)
    return Parts(
        engine=engine,
        optimizer=optimizer,
        lr_scheduler=lr_scheduler,
        loader=loader,
        sampler=sampler,
        schedule=schedule,
        policy=policy,
        precision=precision,
        loss=FirstBatchChecked(data, cfg.data.target),  # the loss and correct contracts
        evaluate=lambda: evaluate(engine.module, data, rank, world_size, device, call=call),
        normalizer=normalizer,
        device=device,
        trainer=tr,
        world_size=world_size,
        micro_batch_size=micro,
        total_steps=total,
        noise=meter,
        call=call,
    )


def run_training(cfg: RunConfig, run_dir: Path,
                 placement: Placement | None = None) -> dict[str, Any]:
    """Train on the already initialised default process group (placed by `placement`: by
    default as one env:// rank of that group); rank 0 writes the outputs. Returns the summary
    (on every rank)."""
    placement = placement or of_process_group()
    rank, world_size = placement.rank, placement.world_size
    device = placement.device()
    p = build_parts(cfg, rank, world_size, device)
    tr = cfg.trainer
    p.numerics = numerics.fingerprint(tr.bits)  # threads and deterministic flags set
    if is_rank0():
        record_numerics(run_dir / "run_info.json", p.numerics)
    plain = cfg.to_plain()  # what checkpoints record
    # CPU-side agreement and RNG gathering, never a GPU sync (new_group's own default timeout
    # is 30 minutes: use the job's)
    control = (dist.new_group(backend="gloo", timeout=timedelta(seconds=tr.timeout_s))
               if world_size > 1 else None)
    ckpt_dir = run_dir / checkpoint.CKPT_DIR

    # checkpoints through torch.distributed.checkpoint
    sharded = p.engine.capabilities.sharded

    def save(p: Parts, state: Progress) -> None:  # p passed in: no Parts <-> closure cycle
        if sharded:
            sharded_checkpoint.write(p, state, plain, control, ckpt_dir, tr.keep_checkpoints)
            return
        out = trainstate.capture(p, state, plain, control)
        if out is not None:
            checkpoint.write(out, ckpt_dir, tr.keep_checkpoints)

    p.checkpoint = save
    p.stop = StopAgreement(PROCESS_FLAG, control, world_size)
    if p.engine.trace:  # the job process merges the ranks' files into trace.json
        p.engine.trace.open(run_dir / TRACE_DIR / f"rank{rank}.jsonl")
    try:
        resumed_from = agreed_resume(cfg.resume, world_size, control)
        state, differ = Progress(), []
        if resumed_from is not None:
            state = (sharded_checkpoint.load(p, resumed_from, rank, control) if sharded else
                     trainstate.restore(p, checkpoint.load(resumed_from), rank))
            log.info("resumed from %s at optimizer step %d", resumed_from, state.step)
            differ = numerics.differences(checkpoint.sidecar(resumed_from).get("numerics"),
                                          p.numerics)
            if differ and is_rank0():
                log.warning("resume: the numerics differ from the checkpoint's (%s): the "
                            "continuation is not bitwise the uninterrupted run "
                            "(docs/reproducibility.md)", "; ".join(differ))
        run_log = RunLog(run_dir, active=is_rank0(), total_steps=p.total_steps,
                         progress_bar=tr.progress_bar, start_window=state.windows,
                         **(tracking_of(cfg) if is_rank0() else {}))
        try:
            p.engine.memory.start()
            state = train(p, state, run_log)
            summary = run_summary.summarize(p, state, cfg.seed)
            if p.engine.compiled and not any(summary["compile"]["graphs"]) and is_rank0():
                log.warning("compile.enabled=true compiled no graph of this model: it ran eager "
                            "(docs/components.md \"Compile\": an nn.Sequential under torch's "
                            "DDP is one)")
            newest = checkpoint.complete(ckpt_dir) if ckpt_dir.is_dir() else []
            summary.update(status="interrupted" if p.stop.agreed else "completed",
                           stopped_by=signal_name(p.stop.agreed) if p.stop.agreed else None,
                           checkpoint=str(newest[0]) if newest else None,
                           resumed_from=str(resumed_from) if resumed_from else None,
                           resumed_numerics_differ=differ if resumed_from else None)
            summary["trackers"] = run_log.finish(summary)  # each tracker's uri and run id
            if p.stop.agreed:
                log.info("stopped by %s after optimizer step %d", summary["stopped_by"],
                         state.step)
            if sharded and newest:
                sharded_checkpoint.write_last(p, newest[0])  # collective: gathers the model
            elif is_rank0() and newest:
                checkpoint.link_last(newest[0])
        finally:
            run_log.close()
    finally:
        if p.engine.trace:
            p.engine.trace.close()
        if control is not None:
            dist.destroy_process_group(control)
    return summary


def agreed_resume(resume: str, world_size: int, group: Any) -> Path | None:
    """The checkpoint every rank starts from: rank 0's (the job resolved `resume` to a path, or
    none, before it started the ranks; under torchrun each node's job resolved it on its own
    disk), readable by every rank."""
    mine = None if resume == "none" else Path(resume)
    if world_size == 1:
        return mine
    chosen = [str(mine) if mine else None]
    dist.broadcast_object_list(chosen, src=0, group=group)
    path = Path(chosen[0]) if chosen[0] else None
    readable: list[Any] = [None] * world_size
    dist.all_gather_object(readable, path is None or path.exists(), group=group)
    blind = [r for r, ok in enumerate(readable) if not ok]
    if blind:  # every rank raises alike: none is left waiting in a collective
        raise checkpoint.ResumeError(f"ranks {blind} cannot read rank 0's checkpoint {path}: "
                                     "resuming across nodes needs a shared filesystem")
    return path


def init_process_group(backend: str, rank: int, world_size: int, timeout_s: int,
                       store_port: int | None,
                       store_host: str = "127.0.0.1") -> dist.Store | None:
    """Join the job's group: through the launcher's TCPStore (spawned workers; returned), or
    through torchrun's env:// variables (store_port None)."""
    timeout = timedelta(seconds=timeout_s)
    if store_port is None:
        dist.init_process_group(backend, timeout=timeout)
        return None
    store = dist.TCPStore(store_host, store_port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    return store


def _check_own_gpu(device: torch.device, timeout_s: int) -> None:
    """Two ranks placed on one GPU (srun tasks sharing a view): one line on every rank, not
    nccl's "Duplicate GPU detected" at DDP's first broadcast (devices.check_own_gpu)."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        check_own_gpu(str(torch.cuda.get_device_properties(device).uuid), device.index or 0,
                      group)
    finally:
        dist.destroy_process_group(group)


def worker_main(placement: Placement, cfg: RunConfig, run_dir: str,
                store_port: int | None, store_host: str = "127.0.0.1",
                probe: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """Entry point of one rank (started by the launcher, or the torchrun process itself);
    returns the run's summary. probe: a collective every rank runs once the group is up,
    before training (network=shaped: the links' latency); its result (rank 0's) rides in the
    summary as ``link_probe``."""
    # SIGTERM/SIGINT (and SLURM's SIGUSR1/2): finish the step, checkpoint, stop (faults.py)
    PROCESS_FLAG.install(watched_signals())
    run_path = Path(run_dir)
    rank, world_size = placement.rank, placement.world_size
    setup_logging(run_path, rank)
    tr = cfg.trainer
    # portable bits: a fixed thread count (the bits depend on it), one unless set
    threads = tr.threads_per_worker or (1 if tr.bits == "portable" else cpu_threads(
        placement.local_world_size,
        own_mask=not placement.spawns and task_has_own_cpus(usable_cpus())))
    torch.set_num_threads(threads)
    device = placement.device()
    if tr.bits == "portable" and numerics.pins_missing():  # the launcher or the entry point
        raise numerics.NumericsError(  # ... put them there: a rank started some other way
            f"trainer.bits=portable: rank {rank} runs without the pins "
            f"({'; '.join(numerics.pins_missing())})")
    for line in numerics.apply(tr.bits, device.type):
        if rank == 0:
            log.info(line)
    if device.type == "cuda":
        prepare_cuda_determinism(tr.deterministic)  # before the first CUDA call
        torch.cuda.set_device(device)  # this rank's context, on its own GPU only
    init_process_group(placement.backend, rank, world_size, tr.timeout_s, store_port,
                       store_host)
    log.info("rank %d/%d up: backend=%s device=%s threads=%d pid=%d", rank, world_size,
             placement.backend, device, threads, os.getpid())
    try:
        if device.type == "cuda" and world_size > 1:  # before nccl's first collective
            _check_own_gpu(device, tr.timeout_s)
        probed = probe() if probe is not None else None
        summary = run_training(cfg, run_path, placement)
        if probed is not None and summary:
            summary["link_probe"] = probed
        return summary
    except BaseException as e:  # torch's CheckpointException, say, is no Exception
        report_failure(e)  # to the launcher that spawned this rank (faults.py)
        log.exception("rank %d failed (traceback in logs/rank%d.log)", rank, rank)
        raise
    finally:
        dist.destroy_process_group()
