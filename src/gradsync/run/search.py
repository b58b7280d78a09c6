"""The search sweeper: Optuna through Hydra's own plugin (hydra-optuna-sweeper), for
`gradsync-train -m hydra/sweeper=optuna ...` (registered by config/hydra.py; docs/sweeps.md).

It asks Optuna for trials, runs each as a job of the sweep (any launcher), and tells Optuna how
it went: the objective(s) (hydra.sweeper.objective, names of the sweep summary's columns, e.g.
eval_loss) read from the summary the job returned, or a failed trial (Optuna's FAIL state) for a
job that was refused, failed, or did not produce a finite value of every objective: no stand-in
value steers the sampler. The job's row in the sweep summary says the same (run/sweep.py).

The study lives in a database (hydra.sweeper.storage; by default sqlite:///<sweep dir>/study.db)
under a stable name, so a sweep killed by any signal and started again with the same command
(the same hydra.sweep.dir) continues it: the trials that ended are not run again, the one that
was running when the sweep died is marked failed (its job row: lost) and counts as one of the
n_trials, and the study ends with n_trials trials, each once. Job numbers are trial numbers.
What the summary needs to find the study is in <sweep dir>/optuna.json.

Bad input (an unknown objective, a direction other than minimize/maximize, an objective the
sweep's runs do not produce) raises ConfigError before any trial starts: one line, exit 2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.types import HydraContext, TaskFunction
from hydra_plugins.hydra_optuna_sweeper._impl import (
    OptunaSweeperImpl,
    create_params_from_overrides,
)
from omegaconf import DictConfig, ListConfig

from gradsync.config.validate import ConfigError
from gradsync.run import sweep
from gradsync.train.metrics import final_metrics

optuna = sweep.import_optuna()

# The summary values a trial can optimise (train/metrics.final_metrics).
ALWAYS = ("eval_loss", "final_train_loss", "allreduce_bytes", "allreduce_calls",
          "sync_backwards", "samples_per_s", "train_s", "wall_s", "peak_rss_mb")
# Produced only by some runs: the objective, what produces it, whether the sweep's config does.
ONLY_WHEN = {
    "noise_scale": ("noise_scale.enabled=true",
                    lambda cfg: bool(cfg.noise_scale.enabled)),
    "reduce_scatter_bytes": ("a sharded engine (engine=fsdp or hsdp)",
                             lambda cfg: _sharded(cfg.engine.name)),
    "all_gather_bytes": ("a sharded engine (engine=fsdp or hsdp)",
                         lambda cfg: _sharded(cfg.engine.name)),
    "max_replica_drift": ("sync=local_sgd or sync=diloco",
                          lambda cfg: str(cfg.sync.get("_target_", "")).endswith(
                              (".local_sgd", ".diloco"))),
}
# Produced by some runs, depending on the data (accuracy: a `correct` metric, perplexity: token
# data) or the engine's memory measure: checked on each run (without it: a failed trial).
PER_RUN = ("eval_accuracy", "eval_perplexity", "comm_bytes_per_step", "grad_held_bytes",
           "peak_mem_mb")
DIRECTIONS = ("minimize", "maximize")


def _sharded(engine: str) -> bool:
    from gradsync.engines import ENGINES  # torch: only when the objective asks

    return engine in ENGINES and bool(ENGINES[engine].engine.capabilities.sharded)


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple, ListConfig)):
        return list(value)
    return [value]


def check_objectives(objective: Any, direction: Any, task_cfg: DictConfig) -> tuple[
        list[str], list[str]]:
    """The objectives and their directions, one each (a lone direction serves every objective),
    or ConfigError naming what is wrong."""
    names = [str(n) for n in _as_list(objective)]
    directions = [getattr(d, "name", str(d)) for d in _as_list(direction)]
    if not names:
        raise ConfigError("hydra.sweeper.objective: at least one summary value, e.g. eval_loss")
    for name in names:
        if name in ONLY_WHEN:
            what, produced = ONLY_WHEN[name]
            if not produced(task_cfg):
                raise ConfigError(f"hydra.sweeper.objective={name}: the sweep's runs do not "
                                  f"produce it (only {what} does)")
        elif name not in ALWAYS and name not in PER_RUN:
            raise ConfigError(f"hydra.sweeper.objective={name}: not a value a run produces; one "
                              f"of {', '.join(ALWAYS + tuple(ONLY_WHEN) + PER_RUN)}")
    bad = [d for d in directions if d not in DIRECTIONS]
    if bad:
        raise ConfigError(f"hydra.sweeper.direction={bad[0]}: minimize or maximize (or a list, "
                          "one per objective)")
    if len(directions) == 1:
        directions *= len(names)
    if len(directions) != len(names):
        raise ConfigError(f"hydra.sweeper.direction: {len(directions)} directions for "
                          f"{len(names)} objectives ({', '.join(names)}): one, or one each")
    return names, directions


def objective_values(result: Any, names: list[str]) -> tuple[list[float] | None, str]:
    """What a job's result gives Optuna: the objectives' values, or None and why the trial
    failed."""
    if not isinstance(result, dict) or result.get("status") != "completed":
        error = result.get("error", "") if isinstance(result, dict) else repr(result)
        return None, f"the run did not complete: {error}"
    metrics = final_metrics(result)
    values = []
    for name in names:
        value = metrics.get(name)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None, f"objective {name} is {value!r} (the run does not produce a finite value)"
        values.append(float(value))
    return values, ""


class OptunaSearch:
    """The sweeper hydra_plugins.gradsync_search.OptunaSearch hands its work to:
    hydra-optuna-sweeper's settings (sampler, storage, study_name, n_trials, n_jobs, params,
    ...) plus objective; its search space parsing, our trial loop (resume, failed trials)."""

    def __init__(self, objective: Any, direction: Any, **plugin: Any) -> None:
        self.objective = objective
        self.direction = direction
        self.impl = OptunaSweeperImpl(direction=direction, **plugin)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.names, self.directions = check_objectives(self.objective, self.direction, config)
        if not isinstance(self.impl.sampler, optuna.samplers.BaseSampler):
            raise ConfigError("hydra.sweeper.sampler: a grid is the basic sweeper's "
                              "(hydra/sweeper=basic, a,b,c values); pick tpe, random or cmaes")
        self.impl.setup(hydra_context=hydra_context, task_function=task_function, config=config)
        self.config = config

    def sweep(self, arguments: list[str]) -> None:
        impl = self.impl
        impl._process_searchspace_config()
        space, fixed = create_params_from_overrides(
            impl._parse_sweeper_params_config() + list(arguments))
        space = {**(impl.search_space_distributions or {}), **space}
        for name in fixed:
            space.pop(name, None)
        if not space:
            raise ConfigError("hydra/sweeper=optuna: nothing to search; give a parameter as "
                              "choice(...), interval(...), range(...) or tag(log, interval(...))")
        study = optuna.create_study(study_name=impl.study_name, storage=impl.storage,
                                    sampler=impl.sampler, directions=self.directions,
                                    load_if_exists=True)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        state = optuna.trial.TrialState
        trials = study.get_trials(deepcopy=False)
        if not trials:  # a new study: an earlier sweep's job records there are not its own
            sweep.forget_jobs(sweep_dir)
        for trial in trials:  # its sweep was killed while it ran: failed, not run again
            if trial.state == state.RUNNING:
                study.tell(trial.number, state=state.FAIL)
        job_of = {int(k): v for k, v in sweep.read_study(sweep_dir).get("jobs", {}).items()}
        info = {"storage": impl.storage, "study_name": study.study_name,
                "objectives": self.names, "directions": self.directions}
        to_go = impl.n_trials - len(trials)
        while to_go > 0:
            batch = [study.ask() for _ in range(min(to_go, impl.n_jobs))]
            overrides = impl._configure_trials(batch, space, fixed)
            first = batch[0].number  # job number = trial number: new jobs get new dirs
            job_of |= {t.number: t.number for t in batch}
            sweep.write_study(sweep_dir, {**info, "jobs": job_of})
            assert impl.launcher is not None  # setup made it
            returns = impl.launcher.launch(overrides, initial_job_idx=first)
            for trial, ret in zip(batch, returns, strict=True):
                self._tell(study, trial, ret)
            to_go -= len(batch)
        sweep.write_study(sweep_dir, {**info, "jobs": job_of})

    def _tell(self, study: Any, trial: Any, ret: JobReturn) -> None:
        """study, trial: optuna's Study and Trial."""
        # what the job returned (its summary), or the exception it raised
        values, why = objective_values(ret._return_value, self.names)
        if values is None:
            trial.set_user_attr("gradsync_error", why)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            study.tell(trial, values=values)
