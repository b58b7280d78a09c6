"""gradsync-train: compose the config with Hydra, check it once into a ``RunConfig``, place the
job, resolve where it resumes from, and launch the ranks (lightning-hydra-template's shape:
compose, instantiate, run).

The entry point and config/ are the only places that know Hydra. Bad input ends in one line on
stderr and exit code 2, before any worker starts; set HYDRA_FULL_ERROR=1 for the traceback.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gradsync.components import cwd_importable, describe
from gradsync.config.errors import first_line, one_line
from gradsync.config.hydra import (
    CONF_DIR,
    compose,
    register_configs,
    replace_mappings,
    to_plain,
)
from gradsync.config.renames import refuse_renamed_overrides
from gradsync.config.schema import RunConfig
from gradsync.config.validate import RUNTIME, ConfigError
from gradsync.core.numerics import NumericsError, check_portable
from gradsync.core.ranks import is_rank0
from gradsync.engines import capabilities
from gradsync.engines import schemas as engine_schemas
from gradsync.engines.trace import TRACE_DIR
from gradsync.engines.trace import merge as merge_trace
from gradsync.run import slurm, sweep
from gradsync.run import summary as run_summary
from gradsync.run.faults import exit_now, signal_name
from gradsync.run.inspect import INSPECT_PARAMS, parameters_table
from gradsync.run.launch import (
    Interrupted,
    WorkerFailed,
    adopt_submitit_ranks,
    launch,
    rank0_now,
)
from gradsync.run.network import (
    NetworkConfig,
    NetworkError,
    network_config,
    process_group_engine,
)
from gradsync.run.placement import Placement, check_cuda, env_launched, place_job
from gradsync.run.preflight import preflight
from gradsync.run.rundir import Claim, RunDirBusy, remove_if_unused, staging_name
from gradsync.train.checkpoint import ResumeError, resolve_resume
from gradsync.train.metrics import final_metrics, flat_hparams, write_hparams
from gradsync.train.repro import run_info, write_run_info
from gradsync.train.trackers import TENSORBOARD


def register_resolvers() -> None:
    """The resolvers conf/config.yaml uses. Under torchrun and submitit every rank runs this app:
    the run dir is named with rank 0's clock and only rank 0 writes Hydra's own files (.hydra/,
    the job's log file); under SLURM the run dir is named after the job and `resume` defaults
    to auto (slurm.py); Hydra's files go to a dir of this start's own until it is accepted
    (rundir.py)."""
    resolvers: dict[str, tuple[Callable[..., Any], bool]] = {
                 "rank0_now": (rank0_now, True),
                 "if_rank0": (lambda value, other: value if is_rank0() else other, False),
                 "run_name": (lambda fmt: slurm.run_name() or rank0_now(fmt), True),
                 "default_resume": (slurm.default_resume, False),
                 "hydra_staging": (staging_name, False)}
    for name, (fn, cache) in resolvers.items():
        OmegaConf.register_new_resolver(name, fn, use_cache=cache, replace=True)


def register_schemas() -> None:
    """Hydra's schemas: the settings' (config/hydra.py) and each engine's own settings
    (schema/engine/<name>, made from the dataclass its module registers: gradsync.engines)."""
    from hydra.core.config_store import ConfigStore

    register_configs()
    for name, schema in engine_schemas().items():
        ConfigStore.instance().store(group="schema/engine", name=name, node=schema)
    for name in ("local", "shaped"):  # the launcher's own settings (run/network.py)
        ConfigStore.instance().store(group="schema/network", name=name, node=NetworkConfig)


def compose_plain(overrides: list[str]) -> dict[str, Any]:
    """The config the command line composes from these overrides, as plain data (not yet
    checked): for tests and benchmarks that run the pieces without a Hydra job."""
    register_schemas()
    register_resolvers()
    return to_plain(compose(overrides))


_inspecting = False  # +inspect=params: print the parameter table instead of training


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> dict[str, Any]:
    adopt_submitit_ranks()
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    staged = run_dir / hc.output_subdir if hc.output_subdir else None
    if _inspecting:
        try:
            print(parameters_table(preflight(to_plain(cfg))))
        except Exception as e:  # raised inside Hydra's job, which would print its own line
            if _traceback_wanted():
                raise
            print(f"gradsync: config error: {_config_message(e)}", file=sys.stderr)
            sys.exit(2)
        return {}
    try:
        # rank 0 holds the run dir; Hydra's files become its .hydra/ once the start is accepted
        with Claim(run_dir, staged, lock=is_rank0()) as claim:
            return _start(cfg, hc.mode, run_dir, claim)
    except RunDirBusy as e:
        return _fail(hc.mode, run_dir, "run dir in use", str(e), 2, record=False)


def _start(composed: DictConfig, mode: RunMode | None, run_dir: Path, claim: Claim) -> dict:
    try:
        plain = to_plain(composed)
        tr = plain["trainer"]
        placement = place_job(tr["backend"], tr["devices"])
        network = network_config(plain.get("network"))
        said = None
        if network.shaped:  # the gradients cross the links, as every other collective
            plain["engine"], said = process_group_engine(plain["engine"])
        network.check_job(placement.world_size, placement.backend, placement.spawns)
        if said and is_rank0():
            print(f"gradsync: {said}", file=sys.stderr, flush=True)
        cfg = preflight(plain, placement)
        if placement.backend == "nccl":
            check_cuda(placement, cfg.precision.name)
        if cfg.trainer.bits == "portable":
            check_portable(placement.launched_by if not placement.spawns else None)
    except Exception as e:  # a component's own check may raise anything: still one line
        if _traceback_wanted():
            raise
        return _refuse(mode, run_dir, claim, "config error", _config_message(e))
    if mode == RunMode.MULTIRUN:  # its trackers' parent runs are the sweep's
        cfg.sweep_dir = str(HydraConfig.get().sweep.dir)
    try:
        cfg.resume = _resolve_resume(cfg, placement, run_dir)
    except ResumeError as e:
        return _refuse(mode, run_dir, claim, "resume refused", str(e))
    claim.accept()
    try:
        return _train(cfg, placement, mode, run_dir, claim.fd, network)
    except Exception as e:  # a full disk, say: reported as what it is, not as a config error
        if _traceback_wanted():
            raise
        return _fail(mode, run_dir, "error", f"{type(e).__name__}: {e}", 1)


def _config_message(e: Exception) -> str:
    """A config check's error as one line: a ConfigError's own words, anything else (a
    component's own check) with its type."""
    return first_line(str(e) if isinstance(e, (ConfigError, NumericsError))
                      else f"{type(e).__name__}: {e}")


def _refuse(mode: RunMode | None, run_dir: Path, claim: Claim, kind: str, message: str) -> dict:
    """A start refused before training: a new run dir goes (a sweep keeps the job's .hydra/ to
    list it as failed), an earlier run's files stay as they were."""
    new = _is_new(run_dir)
    if mode == RunMode.RUN:
        remove_if_unused(run_dir)
    elif new:
        claim.accept()
    return _fail(mode, run_dir, kind, message, 2, record=new)


def _traceback_wanted() -> bool:
    return os.environ.get("GRADSYNC_TRACEBACK") == "1"


def _train(cfg: RunConfig, placement: Placement, mode: RunMode | None, run_dir: Path,
           lock: int | None, network: NetworkConfig | None = None) -> dict:
    if is_rank0():
        _write_run_info(cfg, placement, run_dir)
    started = time.perf_counter()
    try:  # the ranks this process starts hold the run dir's lock too
        try:
            signum, summary = launch(cfg, placement, run_dir, lock, network)
        finally:  # what every rank recorded, a failed run's too (engines/trace.py)
            if (run_dir / TRACE_DIR).is_dir() and is_rank0():
                _merge_trace(run_dir)
    except NetworkError as e:  # the links could not be made (what was made is gone)
        return _fail(mode, run_dir, "network refused", str(e), 2)
    except WorkerFailed as e:  # under torchrun this process is the rank that failed: its
        # training (kept alive by the error's context) must not be freed (faults.exit_now)
        return _fail(mode, run_dir, "training failed", str(e), 1, hard=not placement.spawns)
    except Interrupted as e:
        print(f"gradsync: {e}", file=sys.stderr, flush=True)
        _end_sweep(signal_name(e.signum))
        sys.exit(128 + e.signum)
    if not is_rank0():
        return {}
    if signum and summary["status"] == "interrupted":  # the workers may have got SIGTERM
        summary["stopped_by"] = signal_name(signum)
    summary["wall_s"] = time.perf_counter() - started  # the whole job: spawn, set-up, training
    run_summary.write(run_dir, summary)
    if summary["status"] == "interrupted":
        try:
            run_summary.stopped(run_dir, summary, cfg.trainer.requeue)
        finally:
            _end_sweep(summary["stopped_by"])
    if any(c.target == TENSORBOARD for c in cfg.logger.values()):  # the HParams tab's row
        write_hparams(run_dir / "tb", flat_hparams(cfg.to_plain()), final_metrics(summary),
                      summary["optimizer_steps"])
    run_summary.report(run_dir, summary)
    return summary


def _merge_trace(run_dir: Path) -> None:
    try:
        merge_trace(run_dir)
    except (OSError, ValueError, KeyError) as e:  # the ranks' files stay for a merge by hand
        print(f"gradsync: trace.json not written ({type(e).__name__}: {e}); merge with "
              f"python -m gradsync.engines trace {run_dir}", file=sys.stderr, flush=True)


def _end_sweep(signal: str) -> None:
    """A signal stopped this job: in a sweep whose jobs run in this process it ends the sweep
    (run/sweep.py interrupted: the sweep dir let go, a line saying how far it got)."""
    for line in sweep.interrupted(signal):
        print(line, file=sys.stderr, flush=True)


def _fail(mode: RunMode | None, run_dir: Path, kind: str, message: str, code: int,
          record: bool = True, hard: bool = False) -> dict:
    """One line and a non-zero exit for a single run; in a sweep, a failed row and the sweep
    goes on (SweepSummary makes it exit 1 at the end). record=False leaves the run dir's
    summary.json alone; hard: the exit frees nothing (faults.exit_now). A run that failed
    after it started training (exit code 1) names its run dir first (the error stays last)."""
    error = f"{kind}: {message}"
    failed = (run_summary.failed(run_dir, error) if record and is_rank0()
              else {"status": "failed", "error": error})
    if code == 1 and record and is_rank0() and run_dir.is_dir():
        print(f"gradsync: run dir: {run_dir} (each rank's log and traceback: "
              "logs/rank<r>.log)", file=sys.stderr, flush=True)
    print(f"gradsync: {error}", file=sys.stderr, flush=True)
    if mode == RunMode.RUN:
        if hard:
            exit_now(code)
        sys.exit(code)
    return failed  # raising would make Hydra's sweeper stop and skip on_multirun_end


def _is_new(run_dir: Path) -> bool:
    """A start refused in a run dir that holds an earlier run's outputs must not overwrite
    them."""
    return not (run_dir / run_summary.SUMMARY).exists()


def _resolve_resume(cfg: RunConfig, placement: Placement, run_dir: Path) -> str:
    """The checkpoint to start from (refusing incompatible ones), once for the job: its path,
    or none."""
    notes: list[str] = []
    try:
        path = resolve_resume(cfg.resume, run_dir, cfg.to_plain(), placement.world_size, notes,
                              sharded=capabilities(cfg.engine.name).sharded)
    finally:
        for note in notes:
            print(f"gradsync: resume: {note}", file=sys.stderr, flush=True)
    if path and is_rank0():
        print(f"gradsync: resuming from {path}", file=sys.stderr, flush=True)
    return str(path) if path else "none"


def _write_run_info(cfg: RunConfig, placement: Placement, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    plain = cfg.to_plain()
    resumed = None if cfg.resume == "none" else cfg.resume
    info = run_info(plain, Path(CONF_DIR).parent, placement.backend, placement.world_size,
                    resumed)
    info["launched_by"] = placement.launched_by
    for group in RUNTIME:  # what a component says of itself: e.g. a corpus's SHA-256
        described = describe(plain[group], RUNTIME[group])
        if described is not None:
            info[group] = described
    write_run_info(run_dir / "run_info.json", info)


MULTIRUN_FLAGS = {"-m", "--multirun", "hydra.mode=MULTIRUN"}


def main() -> None:
    global _inspecting
    # The job process computes little (the config check builds the data and a meta model): one
    # intra-op thread. With more, OpenMP starts its thread team here, and a rank forked from this
    # process inherits that team's state without its threads: its first parallel GEMM waits
    # forever (libgomp is not fork-safe). Each rank sets its own threads (run/worker.py).
    torch.set_num_threads(1)
    try:  # a plain srun task becomes an env:// rank, as under torchrun
        slurm.adopt_srun_ranks()
    except slurm.SlurmEnvError as e:
        print(f"gradsync: config error: {e}", file=sys.stderr)
        sys.exit(2)
    if env_launched() and MULTIRUN_FLAGS & set(sys.argv[1:]):
        # Each job of a sweep joins a process group again through the same torchrun store,
        # which outlives the previous job's group: the second job hangs there. Refuse up front.
        print("gradsync: config error: a multirun (-m) under torchrun is not supported: run one "
              "job per torchrun, or sweep through hydra/launcher=slurm (one SLURM job per run)",
              file=sys.stderr)
        sys.exit(2)
    if any(a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" and not a.split("=", 1)[1].strip()
           for a in sys.argv[1:] if "=" in a):
        print("gradsync: config error: hydra.run.dir='' is not allowed: a directory path (empty "
              "would write into the current directory)", file=sys.stderr)
        sys.exit(2)
    # Hydra prints its own multi-line errors unless HYDRA_FULL_ERROR=1, which makes it raise:
    # we then print one line ourselves, or the traceback if the user asked for it.
    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    before = {k: os.environ.get(k) for k in ("HYDRA_FULL_ERROR", "GRADSYNC_TRACEBACK")}
    os.environ["HYDRA_FULL_ERROR"] = "1"
    if user_wants_traceback:
        os.environ["GRADSYNC_TRACEBACK"] = "1"
    cwd_importable()  # a user's own _target_ modules, next to where they run
    register_schemas()
    register_resolvers()
    scratch = None
    if INSPECT_PARAMS in sys.argv[1:]:
        # composed by Hydra as any run is (--config-dir, search paths, experiments), in a
        # scratch run dir that goes afterwards: nothing is trained, nothing is left
        _inspecting = True
        scratch = tempfile.mkdtemp(prefix="gradsync-inspect-")
        sys.argv[1:] = [a for a in sys.argv[1:] if a != INSPECT_PARAMS] + [
            f"hydra.run.dir={scratch}", "hydra.output_subdir=null"]
    sys.argv[1:] = replace_mappings(sys.argv[1:])
    try:
        refuse_renamed_overrides(sys.argv[1:])  # an old option's name: one line naming the new
        hydra_main()
    except KeyboardInterrupt:  # a Ctrl-C before the workers started (they handle it after)
        print("gradsync: interrupted before training started", file=sys.stderr)
        _end_sweep("SIGINT")
        sys.exit(128 + signal.SIGINT)
    except Exception as e:  # raised while Hydra composed the config (or inspect checked it)
        if user_wants_traceback:
            raise
        message = str(e) if isinstance(e, ConfigError) else one_line(e, sys.argv[1:], hydra_main)
        kind = getattr(e, "kind", "config error")  # e.g. the search's: "search refused"
        print(f"gradsync: {kind}: {first_line(message)}", file=sys.stderr)
        sys.exit(2)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        _inspecting = False
        for key, value in before.items():  # called in-process (tests, a notebook): as it was
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


if __name__ == "__main__":
    main()
