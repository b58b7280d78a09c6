"""The Hydra callback of a sweep (conf/config.yaml registers it under hydra.callbacks): the
sweep owns its sweep dir while it runs, each job records itself and its outcome there, the
sweep's experiment trackers get a parent run for its jobs' runs (train/trackers.py), and the
sweep summary is written once the multirun ends (run/sweep.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gradsync.components import ConfigError, build, locate
from gradsync.config.hydra import SEARCH_SWEEPER
from gradsync.core.ranks import is_rank0
from gradsync.run import sweep
from gradsync.run.rundir import RunDirBusy
from gradsync.train import trackers


class SweepSummary(Callback):
    """Before a multirun's first job it claims the sweep dir (a second sweep there is refused
    in one line, exit code 2); each job records its start and its outcome in the sweep dir
    (in whichever process runs it); when the multirun ends it writes the sweep summary from
    those records, prints it, lets go of the sweep dir, and ends the sweep with exit code 1,
    naming them, if any job failed or was lost: sys.exit, because Hydra turns exceptions
    raised in callbacks into warnings. target_loss
    (hydra.callbacks.sweep_summary.target_loss): the eval loss the to-target columns measure;
    null: the worst final eval loss among the completed jobs."""

    def __init__(self, target_loss: float | None = None) -> None:
        self.target_loss = target_loss

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:  # before anything runs: the sweep dir is this sweep's (sweep.claim)
            sweep.claim(sweep_dir, keep_jobs=_is_search(config))
        except RunDirBusy as e:
            print(f"gradsync: sweep dir in use: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        sweep.plan(sweep_dir, planned_jobs(config))
        try:  # the parent runs of the jobs' runs (a search started again: its own)
            earlier = trackers.read_file(sweep_dir) if _is_search(config) else {}
            parents = {name: t.start_sweep(sweep_dir.absolute(), earlier.get(name))
                       for name, t in _sweep_trackers(config).items()}
        except ConfigError as e:  # an extra that is not installed, say
            print(f"gradsync: config error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        if parents:
            trackers.write_file(sweep_dir, parents)
        else:  # none now: an earlier sweep's parents there are not this one's
            (sweep_dir / trackers.TRACKERS_FILE).unlink(missing_ok=True)

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        job = _sweep_job(config)
        if job:
            print(sweep.progress_line(job[0], job[1]), flush=True)
            sweep.job_started(*job)

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        job = _sweep_job(config)
        if job:  # what the job returned, or the exception it raised
            sweep.job_ended(*job, sweep.job_value(job_return))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            result = sweep.write_summary(sweep_dir, self.target_loss)
        except Exception as e:  # a warning and exit code 0 otherwise
            print(f"gradsync: sweep summary failed: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        finally:
            sweep.release(sweep_dir)
        parents = trackers.read_file(sweep_dir)
        counts = {"total": result.jobs, "completed": result.jobs - result.failed,
                  "failed": result.failed}
        for name, tracker in _sweep_trackers(config).items():
            if name in parents:
                try:
                    parents[name] = tracker.finish_sweep(parents[name], sweep_dir.absolute(),
                                                         counts)
                    trackers.write_file(sweep_dir, parents)
                except Exception as e:  # the summary stands; the tracker says what it lacks
                    print(f"gradsync: sweep: logger.{name}'s sweep run not finished: "
                          f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        print(f"\n{result.markdown}", flush=True)
        if result.failed:
            print(result.failure_line(sweep_dir), file=sys.stderr, flush=True)
            sys.exit(1)


def _sweep_job(config: DictConfig) -> tuple[Path, int, Path, list[str]] | None:
    """A multirun job's sweep dir, number, own dir and overrides (for sweep.job_*); None for a
    single run (Hydra calls a run's job callbacks too), and on all but rank 0 of a job of
    several submitit tasks (one record)."""
    hc = config.hydra
    if hc.mode != RunMode.MULTIRUN or not is_rank0():
        return None
    return (Path(hc.sweep.dir), int(hc.job.num), Path(hc.runtime.output_dir),
            list(OmegaConf.to_container(hc.overrides.task)))  # type: ignore[arg-type]


def planned_jobs(config: DictConfig) -> int | None:
    """How many jobs the multirun plans: a search's n_trials; for Hydra's grid sweeper the
    product of the sweep's value lists (hydra.sweeper.params and the command line's, as the
    sweeper splits them); None for another sweeper, or overrides it cannot split."""
    sweeper = config.hydra.sweeper
    if _is_search(config):
        return int(sweeper.n_trials) if sweeper.get("n_trials") else None
    if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    params = [f"{k}={v}" for k, v in (sweeper.get("params") or {}).items()]
    try:
        parsed = OverridesParser.create().parse_overrides(
            [*params, *OmegaConf.to_container(config.hydra.overrides.task)])  # type: ignore[misc]
        return sum(len(b) for b in BasicSweeper.split_arguments(parsed, None))
    except HydraException:
        return None


def _is_search(config: DictConfig) -> bool:
    """A search (run/search.py) may continue its study: its jobs' records stay."""
    target = str(config.hydra.sweeper.get("_target_", ""))
    return target == SEARCH_SWEEPER


def _sweep_trackers(config: DictConfig) -> dict[str, Any]:
    """The sweep's trackers that keep a run of the sweep (start_sweep, finish_sweep: MLflow's
    parent run, W&B's group), built from its logger group."""
    nodes = OmegaConf.to_container(config.get("logger") or {}, resolve=True)
    assert isinstance(nodes, dict)
    return {str(name): build(node) for name, node in nodes.items()
            if hasattr(locate(node["_target_"], f"logger.{name!s}._target_"), "start_sweep")}
