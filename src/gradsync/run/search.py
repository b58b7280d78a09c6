"""The search sweeper: Optuna's ask/tell API behind Hydra's public Sweeper API, for
`gradsync-train -m hydra/sweeper=optuna ...` (hydra_plugins/gradsync_search holds the Sweeper
class Hydra instantiates; config/hydra.py its settings; docs/sweeps.md). Optuna and SQLAlchemy
are an extra (gradsync[search]); without them the search is refused in one line naming it.

It asks Optuna for trials, runs each as a job of the sweep (any launcher), and tells Optuna how
it went: the objective(s) (hydra.sweeper.objective, names of the sweep summary's columns, e.g.
eval_loss) read from the summary the job returned, or a failed trial (Optuna's FAIL state) for a
job that was refused, failed, or did not produce a finite value of every objective: no stand-in
value steers the sampler. The job's row in the sweep summary says the same (run/sweep.py).

The search space is Hydra's override syntax, and means what it means in a grid: choice(a,b,c)
one of those values; range(start, stop[, step]) one of exactly the values a grid runs (Python's
range: range(2,6) is 2, 3, 4, 5; an integer range is ordered for the sampler, a float range is
the grid's list of values); interval(low, high) any number in [low, high] (tag(log, ...): drawn
on a log scale; tag(int, ...): integers), which a grid cannot run.

The study lives in a database (hydra.sweeper.storage; by default sqlite:///<sweep dir>/study.db)
under a name of the sweep's own (hydra.sweeper.study_name; by default its dir's name and a hash
of its path), so a sweep killed by any signal and started again with the same command (the same
hydra.sweep.dir) continues it: the trials that ended are not run again, the one that was running
when the sweep died is marked failed (its job row: lost) and counts as one of the n_trials, and
the study ends with n_trials trials, each once. Job numbers are trial numbers. Each trial records
its sweep dir (user attribute gradsync_sweep): searches sharing one study (the same storage and
study_name, given on purpose) never fail each other's running trials, they share its n_trials.
What the summary needs to find the study is in <sweep dir>/optuna.json.

Refused in one line, exit 2, before any trial starts and with the study file as it was: bad
settings (an unknown objective, a direction other than minimize/maximize, n_trials or n_jobs
below 1, an empty range, an interval whose low is not below its high, a parameter Hydra cannot
compose), a study file that is not an SQLite database, damaged, truncated or read-only, a study
written by an earlier Optuna (optuna storage upgrade reads it), a study whose directions,
objectives or parameter kinds differ from the search's, a study missing trials the sweep dir
recorded.
"""

from __future__ import annotations

import hashlib
import math
import sqlite3
import urllib.parse
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.types import TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf

from gradsync.components import ConfigError, locate, require
from gradsync.config.validate import first_line
from gradsync.run import sweep
from gradsync.train.metrics import final_metrics

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
OWNER = "gradsync_sweep"  # a trial's user attribute: the sweep dir that asked for it
ERROR = "gradsync_error"  # a failed trial's user attribute: why it failed


class SearchRefused(ConfigError):
    """The study cannot be used as it is (its file, its schema, its settings): one line naming
    the file and the cause, exit code 2, the file untouched."""

    kind = "search refused"


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
    if len(set(names)) != len(names):
        raise ConfigError(f"hydra.sweeper.objective: {', '.join(names)} names one value twice")
    return names, directions


def check_settings(n_trials: Any, n_jobs: Any, storage: Any, study_name: Any) -> None:
    """The search's own settings, before anything is written."""
    for key, value, what in (("n_trials", n_trials, "trials in the study"),
                             ("n_jobs", n_jobs, "trials asked at once")):
        require(type(value) is int and value >= 1, f"hydra.sweeper.{key}",
                f"an integer >= 1 ({what})", value)
    require(isinstance(storage, str) and bool(storage.strip()), "hydra.sweeper.storage",
            "a database URL, e.g. sqlite:///<path>/study.db", storage)
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(storage)
    except ArgumentError:
        raise ConfigError(f"hydra.sweeper.storage={storage!r} is not allowed: a database URL, "
                          "e.g. sqlite:///<path>/study.db") from None
    if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
        raise ConfigError(f"hydra.sweeper.storage={storage!r} is not allowed: a database in "
                          "memory ends with the sweep's process (a restart and the summary read "
                          "the study back): give a file, sqlite:///<path>/study.db")
    require(study_name is None or (isinstance(study_name, str) and 0 < len(study_name.strip())
                                   and len(study_name) <= 512),
            "hydra.sweeper.study_name", "null (the sweep's own) or a name of 1 to 512 "
            "characters", study_name)


# --- the search space -------------------------------------------------------------------------
def search_space(lines: Sequence[str], config_loader: Any = None) -> tuple[
        dict[str, Any], dict[str, str]]:
    """Overrides (hydra.sweeper.params as key=value, then the command line's: a later one for
    the same key wins) as Optuna distributions by key, and the fixed overrides every job gets
    (key -> the override as written)."""
    parser = OverridesParser.create(config_loader=config_loader)
    try:
        parsed = parser.parse_overrides(list(lines))
    except Exception as e:  # Hydra's parse errors: the override and what is wrong
        raise ConfigError(f"hydra/sweeper=optuna: {first_line(str(e))}") from None
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in parsed:
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = str(override.input_line)
    return space, fixed


def distribution(override: Override) -> Any:
    """One sweep override as an Optuna distribution, with a grid's meaning (module docstring)."""
    d = import_optuna().distributions
    value: Any = override.value()
    text = str(override.input_line)
    tags = set(getattr(value, "tags", ()) or ())
    if override.is_choice_sweep():
        return d.CategoricalDistribution(_choices(override, text))
    if override.is_range_sweep():
        values = _choices(override, text)
        if not values:
            raise ConfigError(f"{text}: an empty range (as in a grid, the end is left out: "
                              "range(2,6) is 2, 3, 4, 5)")
        integers = all(isinstance(v, int) and not isinstance(v, bool) for v in values)
        if integers and not value.shuffle:
            step, log = abs(value.step), "log" in tags
            if log and (step != 1 or min(values) < 1):
                raise ConfigError(f"{text}: tag(log, range(...)) needs step 1 and values >= 1")
            return d.IntDistribution(min(values), max(values), step=step, log=log)
        if "log" in tags:
            raise ConfigError(f"{text}: tag(log, ...) of a range of floats: use "
                              "tag(log, interval(low, high))")
        return d.CategoricalDistribution(values)  # the grid's values, exactly
    if override.is_interval_sweep():
        low, high = value.start, value.end
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ConfigError(f"{text}: interval(low, high) needs finite numbers, low < high")
        log = "log" in tags
        if log and low <= 0:
            raise ConfigError(f"{text}: tag(log, interval(low, high)) needs low > 0")
        if "int" in tags:
            if low != int(low) or high != int(high):
                raise ConfigError(f"{text}: tag(int, interval(low, high)) needs integer ends")
            return d.IntDistribution(int(low), int(high), log=log)
        return d.FloatDistribution(low, high, log=log)
    raise ConfigError(f"{text}: not a search space: choice(...), range(...) or interval(...)")


def _choices(override: Override, text: str) -> list[Any]:
    out = list(override.sweep_iterator(transformer=Transformer.encode))
    bad = [v for v in out if not isinstance(v, (str, int, float, bool, type(None)))]
    if bad:
        raise ConfigError(f"{text}: a search picks numbers, strings, booleans or null, not "
                          f"{bad[0]!r}")
    return out


def as_override(key: str, value: Any) -> str:
    """A trial's value as its job's override (strings come encoded by Hydra's parser)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    elif value is None:
        value = "null"
    elif isinstance(value, float):
        value = repr(value)
    return f"{key}={value}"


def to_try(space: dict[str, Any], fixed: dict[str, str]) -> list[list[str]]:
    """Overrides that compose every choice and both ends of every range or interval: what
    Hydra is asked to compose before any trial starts (a key or group option it does not
    know fails there, not in each trial)."""
    d = import_optuna().distributions

    def ends(dist: Any) -> list[Any]:
        if isinstance(dist, d.CategoricalDistribution):
            return list(dist.choices)
        return [dist.low, dist.high]

    first = {k: ends(v)[0] for k, v in space.items()}
    batch = []
    for key, dist in space.items():
        for value in ends(dist):
            batch.append([*fixed.values(), *(as_override(k, value if k == key else v)
                                             for k, v in first.items())])
    return batch


# --- the study ---------------------------------------------------------------------------------
def import_optuna() -> Any:
    return sweep.import_optuna()


def default_study_name(sweep_dir: Path) -> str:
    """The sweep's own study name: its dir's name and a hash of its absolute path."""
    where = sweep_dir.absolute()
    return f"{where.name}-{hashlib.sha256(str(where).encode()).hexdigest()[:8]}"


def sqlite_file(storage: str) -> Path | None:
    """The file of a SQLite storage URL (None: another database)."""
    from sqlalchemy.engine import make_url

    url = make_url(storage)
    if url.get_backend_name() != "sqlite" or not url.database:
        return None
    return Path(url.database)


def check_study_file(path: Path) -> None:
    """An existing study file: an SQLite database that passes its own quick check and takes a
    write (one rolled back: the file stays as it was); SearchRefused naming the file and the
    cause otherwise. A new file: its directory exists (sqlite makes the file)."""
    if not path.exists():
        if not path.parent.is_dir():
            raise SearchRefused(f"{path}: its directory does not exist "
                                "(hydra.sweeper.storage)")
        return
    if path.is_dir():
        raise SearchRefused(f"{path}: a directory, not a study database")
    uri = f"file:{urllib.parse.quote(str(path.absolute()))}?mode=rw"
    try:
        db = sqlite3.connect(uri, uri=True, timeout=30, isolation_level=None)
    except sqlite3.Error as e:
        raise SearchRefused(f"{path}: cannot be opened ({e})") from None
    try:
        verdict = db.execute("PRAGMA quick_check").fetchone()[0]
        if verdict != "ok":
            raise SearchRefused(f"{path}: damaged (SQLite's quick_check: {verdict})")
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        if tables and "version_info" not in tables:  # Optuna's tables would go into it
            raise SearchRefused(f"{path}: another program's database (tables "
                                f"{', '.join(sorted(tables)[:3])}...), not an Optuna study")
        db.execute("BEGIN IMMEDIATE")
        db.execute("CREATE TABLE gradsync_write_probe (x)")
        db.execute("ROLLBACK")
    except sqlite3.DatabaseError as e:
        said = str(e)
        cause = {"file is not a database": "not an SQLite database",
                 "database disk image is malformed": "damaged or truncated"}.get(said, said)
        if "readonly" in said or "read-only" in said:
            cause = "read-only: a search writes each trial into it"
        raise SearchRefused(f"{path}: {cause} ({said})") from None
    finally:
        db.close()


def _written_by(path: Path | None) -> str:
    """The Optuna version a study file's schema was set up by (its version_info table)."""
    if path is None:
        return "an earlier Optuna"
    try:
        with sqlite3.connect(f"file:{urllib.parse.quote(str(path.absolute()))}?mode=ro",
                             uri=True) as db:
            return f"optuna {db.execute('SELECT library_version FROM version_info').fetchone()[0]}"
    except (sqlite3.Error, TypeError):
        return "an earlier Optuna"


def open_storage(storage: str) -> Any:
    """Optuna's RDBStorage for the URL, the file checked first (SQLite), or SearchRefused."""
    optuna = import_optuna()
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    path = sqlite_file(storage)
    where = str(path) if path else make_url(storage).render_as_string(hide_password=True)
    if path is not None:
        check_study_file(path)
    # a write another search holds (the same storage) is waited for, not an error
    kwargs = {"connect_args": {"timeout": 60}} if path is not None else {}
    try:
        return optuna.storages.RDBStorage(storage, engine_kwargs=kwargs)
    except RuntimeError as e:
        if "storage upgrade" not in str(e):
            raise
        raise SearchRefused(
            f"{where}: a study written by {_written_by(path)} (gradsync's search before Optuna "
            f"4); optuna {optuna.__version__} reads it once its tables are upgraded in place: "
            f"copy the file, then run: optuna storage upgrade --storage {storage}") from None
    except SQLAlchemyError as e:
        raise SearchRefused(f"{where}: {first_line(str(getattr(e, 'orig', None) or e))}") \
            from None


def check_study(study: Any, where: str, names: list[str], directions: list[str],
                space: dict[str, Any]) -> None:
    """A study the search continues asks what this search asks: the same directions and
    objectives, each parameter drawn from a distribution of the same kind."""
    optuna = import_optuna()
    theirs = [d.name.lower() for d in study.directions]
    if theirs != directions:
        raise SearchRefused(f"{where}: study {study.study_name} was made to {', '.join(theirs)}; "
                            f"this search asks to {', '.join(directions)}: keep them, or give "
                            "hydra.sweeper.study_name a new name")
    objectives = study.metric_names
    if objectives is not None and list(objectives) != names:
        raise SearchRefused(f"{where}: study {study.study_name} optimises "
                            f"{', '.join(objectives)}; this search {', '.join(names)}: keep "
                            "them, or give hydra.sweeper.study_name a new name")
    for trial in study.get_trials(deepcopy=False):
        for key, dist in space.items():
            if key in trial.distributions:
                try:
                    optuna.distributions.check_distribution_compatibility(
                        trial.distributions[key], dist)
                except ValueError:
                    raise SearchRefused(
                        f"{where}: study {study.study_name}'s trial {trial.number} drew {key} "
                        f"from {trial.distributions[key]}, this search from {dist}: keep its "
                        "kind (and a choice's values), or give hydra.sweeper.study_name a new "
                        "name") from None


def instantiate_sampler(node: Any) -> Any:
    """The sampler of hydra.sweeper.sampler (a null setting: the sampler's own default)."""
    settings = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) \
        else dict(node)
    assert isinstance(settings, dict)
    target = str(settings.pop("_target_"))
    args = {str(k): v for k, v in settings.items() if v is not None}
    try:
        return locate(target, "hydra.sweeper.sampler._target_")(**args)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"hydra.sweeper.sampler ({target}): {first_line(str(e))}") from None


def objective_values(result: Any, names: list[str]) -> tuple[list[float] | None, str]:
    """What a job's result gives Optuna: the objectives' values, or None and why the trial
    failed."""
    if isinstance(result, BaseException):
        return None, f"the run did not complete: {type(result).__name__}: {result}"
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


def fail_lost_trials(study: Any, sweep_dir: Path) -> list[int]:
    """The trials this sweep dir asked for that are still running: its earlier start died while
    they ran (this start holds the sweep dir's lock). Marked failed; another sweep's running
    trials are left alone. Returns their numbers."""
    state = import_optuna().trial.TrialState
    mine = str(sweep_dir.absolute())
    lost = [t.number for t in study.get_trials(deepcopy=False, states=(state.RUNNING,))
            if t.user_attrs.get(OWNER, mine) == mine]  # none: asked by an earlier gradsync
    for number in lost:
        study.tell(number, state=state.FAIL)
    return lost


def contiguous(trials: list[Any]) -> list[list[Any]]:
    """Trials in runs of consecutive numbers (a launch numbers its jobs from its first)."""
    runs: list[list[Any]] = []
    for trial in trials:
        if runs and runs[-1][-1].number + 1 == trial.number:
            runs[-1].append(trial)
        else:
            runs.append([trial])
    return runs


class Search:
    """The search of one sweep: hydra_plugins.gradsync_search.OptunaSearch (the Hydra Sweeper)
    hands it its settings (config/hydra.py SearchConf) at setup."""

    def __init__(self, sweeper: Any, task_function: TaskFunction, *, sampler: Any,
                 objective: Any, direction: Any, storage: Any, study_name: str | None,
                 n_trials: int, n_jobs: int, params: Any = None) -> None:
        import_optuna()  # gradsync[search], or one line naming it
        config = sweeper.config
        self.sweeper, self.config = sweeper, config
        self.names, self.directions = check_objectives(objective, direction, config)
        check_settings(n_trials, n_jobs, storage, study_name)
        self.storage, self.study_name = str(storage), study_name
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.sampler = instantiate_sampler(sampler)
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=sweeper.hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> None:
        optuna = import_optuna()
        sweep_dir = Path(self.config.hydra.sweep.dir)
        lines = [f"{k}={v}" for k, v in self.params.items()] + list(arguments)
        space, fixed = search_space(lines, self.sweeper.hydra_context.config_loader)
        if not space:
            raise ConfigError("hydra/sweeper=optuna: nothing to search; give a parameter as "
                              "choice(...), range(...), interval(...) or "
                              "tag(log, interval(...))")
        self.sweeper.compose_check(to_try(space, fixed))
        try:
            recorded = sweep.read_study(sweep_dir)
        except (OSError, ValueError) as e:
            raise SearchRefused(f"{sweep_dir / sweep.STUDY}: not the record a search writes "
                                f"({type(e).__name__}: {e}); move it away to start a new "
                                "study") from None
        name = self.study_name or recorded.get("study_name") or default_study_name(sweep_dir)
        ours = recorded.get("study_name") == name and recorded.get("storage") == self.storage
        job_of = {int(k): v for k, v in recorded.get("jobs", {}).items()} if ours else {}
        storage = open_storage(self.storage)
        path = sqlite_file(self.storage)
        where = str(path) if path else self.storage
        if job_of and name not in optuna.study.get_all_study_names(storage):
            raise SearchRefused(f"{where}: holds no study {name}, which {sweep_dir} ran "
                                f"{len(job_of)} trials of: the file was replaced or truncated; "
                                "put it back, or start the search in a new hydra.sweep.dir")
        with warnings.catch_warnings():  # metric names: 'experimental' since Optuna 3.2
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(study_name=name, storage=storage, sampler=self.sampler,
                                        directions=self.directions, load_if_exists=True)
            check_study(study, where, self.names, self.directions, space)
            if study.metric_names is None:
                study.set_metric_names(self.names)
        known = {t.number for t in study.get_trials(deepcopy=False)}
        missing = sorted(set(job_of) - known)
        if missing:
            raise SearchRefused(f"{where}: study {name} lacks trials {missing}, which {sweep_dir} "
                                "ran: the file was replaced or truncated; put it back, or start "
                                "the search in a new hydra.sweep.dir")
        if not job_of:  # an earlier sweep's job records there are not this study's
            sweep.forget_jobs(sweep_dir)
        fail_lost_trials(study, sweep_dir)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        info = {"storage": self.storage, "study_name": name, "objectives": self.names,
                "directions": self.directions}
        mine = str(sweep_dir.absolute())
        while (to_go := self.n_trials - len(study.get_trials(deepcopy=False))) > 0:
            batch = [study.ask(space) for _ in range(min(to_go, self.n_jobs))]
            for trial in batch:
                trial.set_user_attr(OWNER, mine)
            job_of |= {t.number: t.number for t in batch}  # job number = trial number
            sweep.write_study(sweep_dir, {**info, "jobs": job_of})
            for run in contiguous(batch):
                overrides = [[*fixed.values(), *(as_override(k, v) for k, v in t.params.items())]
                             for t in run]
                returns = self.launcher.launch(overrides, initial_job_idx=run[0].number)
                for trial, ret in zip(run, returns, strict=True):
                    self._tell(study, trial, ret)
        sweep.write_study(sweep_dir, {**info, "jobs": job_of})

    def _tell(self, study: Any, trial: Any, ret: JobReturn) -> None:
        """study, trial: optuna's Study and Trial."""
        values, why = objective_values(sweep.job_value(ret), self.names)
        if values is None:
            trial.set_user_attr(ERROR, why)
            study.tell(trial, state=import_optuna().trial.TrialState.FAIL)
        else:
            study.tell(trial, values=values)
