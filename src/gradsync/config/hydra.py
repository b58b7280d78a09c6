"""Hydra's side of the config: the schemas of the groups with a fixed shape in its ConfigStore
(``schema/<group>/<option>``; their YAML files extend them and state only what differs, so a
wrong type or an unknown key fails at composition), where the YAML files are, composition, and
the overrides gradsync rewrites before Hydra reads them. Only this package and run/ (the entry
point, its callbacks, the search, the summary's override parser) import Hydra or OmegaConf
(make lint holds it: pyproject.toml [tool.importlinter]). Hydra's public API only
(hydra.compose, initialize_config_dir, its ConfigStore and exception types), never hydra._internal.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from gradsync.components import ConfigError, hints, locate, type_text
from gradsync.config.renames import refuse_renamed_overrides
from gradsync.config.schema import (
    SCHEMA_GROUPS,
    CompileConfig,
    LossConfig,
    NoiseScaleConfig,
    TrainerConfig,
)


@dataclass
class Config:
    model: Any = MISSING
    optimizer: Any = MISSING
    schedule: Any = MISSING
    sync: Any = MISSING
    precision: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    engine: Any = MISSING  # its schema: the engine's own settings (run/main.py registers them)
    compile: CompileConfig = field(default_factory=CompileConfig)
    noise_scale: NoiseScaleConfig = field(default_factory=NoiseScaleConfig)
    lr_scheduler: Any = MISSING
    loss: LossConfig = field(default_factory=LossConfig)
    lr_scaling: Any = MISSING
    seed: int = 0
    resume: str = "none"  # none | auto | a checkpoint file or run dir
    logger: Any = None  # experiment trackers by name (conf/logger/; train/trackers.py)
    network: Any = None  # where the ranks talk (conf/network/; its schema: run/network.py)


# hydra/sweeper=optuna's class (a search: run/search.py); Hydra takes sweepers from
# hydra_plugins only
SEARCH_SWEEPER = "hydra_plugins.gradsync_search.OptunaSearch"


# hydra/sweeper/sampler=<name>: Optuna's samplers (a null setting: the sampler's own default)
@dataclass
class TPESampler:
    _target_: str = "optuna.samplers.TPESampler"
    seed: int | None = None
    n_startup_trials: int = 10  # random trials before TPE models the others
    n_ei_candidates: int = 24
    multivariate: bool | None = None
    group: bool = False
    constant_liar: bool | None = None  # trials asked at once (n_jobs > 1) avoid each other
    consider_endpoints: bool | None = None
    prior_weight: float | None = None


@dataclass
class RandomSampler:
    _target_: str = "optuna.samplers.RandomSampler"
    seed: int | None = None


@dataclass
class CmaEsSampler:
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: int | None = None
    n_startup_trials: int = 1
    sigma0: float | None = None
    popsize: int | None = None
    use_separable_cma: bool = False
    with_margin: bool = False
    lr_adapt: bool = False


@dataclass
class NSGAIISampler:
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: int | None = None
    population_size: int = 50
    mutation_prob: float | None = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5


@dataclass
class QMCSampler:
    _target_: str = "optuna.samplers.QMCSampler"
    seed: int | None = None
    qmc_type: str = "sobol"
    scramble: bool = False


# motpe: Optuna 3 folded MOTPESampler into TPESampler (several objectives: MOTPE's algorithm)
SAMPLERS = {"tpe": TPESampler, "random": RandomSampler, "cmaes": CmaEsSampler,
            "nsgaii": NSGAIISampler, "qmc": QMCSampler, "motpe": TPESampler}


@dataclass
class SearchConf:
    """hydra/sweeper=optuna: gradsync's search (run/search.py; docs/sweeps.md)."""

    _target_: str = SEARCH_SWEEPER
    _recursive_: bool = False  # the sampler is built by the search (optuna: an extra)
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING
    # the sweep summary's value(s) to optimise: eval_loss, or [eval_loss,allreduce_bytes]
    objective: Any = "eval_loss"
    direction: Any = "minimize"  # minimize | maximize, or a list: one per objective
    # a shared database holds several sweeps' studies
    storage: Any = "sqlite:///${hydra.sweep.dir}/study.db"
    # null: the sweep's own (its dir's name and a hash of its path; a restart of the sweep
    # finds it again in <sweep dir>/optuna.json), so two searches never share a study unless
    # given one name
    study_name: str | None = None
    n_trials: int = 20  # in the study, counting those an earlier start of this sweep ran
    n_jobs: int = 1  # trials asked at once (hydra/launcher=joblib runs them in parallel)
    # the search space: {key: choice(...) | range(...) | interval(...) | a fixed value}
    params: dict[str, str] | None = None


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="schema_config", node=Config)
    for group, options in SCHEMA_GROUPS.items():
        for option, cls in options.items():
            cs.store(group=f"schema/{group}", name=option, node=cls)
    # hydra/sweeper=optuna: gradsync's search; composes without optuna installed (the search
    # refuses to start without it, in one line naming gradsync[search])
    cs.store(group="hydra/sweeper", name="optuna", node=SearchConf, provider="gradsync")
    for name, sampler in SAMPLERS.items():
        cs.store(group="hydra/sweeper/sampler", name=name, node=sampler, provider="gradsync")
    from hydra.core.plugins import Plugins

    from hydra_plugins.gradsync_search import OptunaSearch

    # registered by hand too: Hydra's scan of the hydra_plugins namespace (pkgutil) does not
    # list a package that an editable install (`make install`, pip install -e) maps there
    Plugins.instance().register(OptunaSearch)


def to_plain(cfg: DictConfig) -> dict[str, Any]:
    """Resolve interpolations and drop OmegaConf types: plain, picklable data. A value left
    ``???`` is a ConfigError naming its full key and what it takes."""
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise ConfigError(missing_value(cfg, e.full_key or str(e))) from None
    assert isinstance(plain, dict)
    return plain  # type: ignore[return-value]


def missing_value(cfg: DictConfig, key: str) -> str:
    """One line for a mandatory value (``???``) left unset: the full key, and, where the
    component's target or the group's schema says, the type it takes."""
    parent, _, name = key.rpartition(".")
    try:
        node = OmegaConf.select(cfg, parent) if parent else cfg
        target = node.get("_target_") if isinstance(node, DictConfig) else None
        schema = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        hint = (hints(locate(target)).get(name) if target else
                typing.get_type_hints(schema).get(name) if dataclasses.is_dataclass(schema)
                else None)
    except Exception:  # a node that does not resolve: the key alone
        hint = None
    what = "" if hint is None else f"{target or 'it'} takes {type_text(hint)}; "
    return f"{key}: missing (??? in the config): {what}set it, e.g. {key}=..."


def conf_dir() -> str:
    """The configs: the repo's top-level conf/ when running from a source checkout (an editable
    install: people read and edit them there), else the copy shipped inside the package."""
    repo_conf = Path(__file__).resolve().parents[3] / "conf"
    if (repo_conf / "config.yaml").is_file():
        return str(repo_conf)
    return str(Path(__file__).resolve().parents[1] / "conf")


CONF_DIR = conf_dir()

# Mappings an override replaces whole (Hydra merges `key={...}` into the existing mapping, and
# refuses a new key of it in struct mode): `key={0:2,3:8}` becomes `key=null ++key={0:2,3:8}`.
REPLACED_MAPPINGS = ("schedule.window_size_by_epoch",)


def replace_mappings(overrides: list[str]) -> list[str]:
    out = []
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in REPLACED_MAPPINGS and value.startswith("{") and value.endswith("}") \
                and "},{" not in value.replace(" ", ""):
            out += [f"{key}=null", f"++{key}={value}"]
        else:
            out.append(arg)
    return out


def compose(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """The config the command line composes from these overrides, outside a Hydra job (the
    resolvers the config uses must be registered: run/main.py register_resolvers)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    refuse_renamed_overrides(overrides)
    register_configs()
    with initialize_config_dir(config_dir=config_dir or CONF_DIR, version_base="1.3"):
        return hydra_compose("config", overrides=replace_mappings(overrides))


def command_line(argv: list[str]) -> argparse.Namespace:
    """The parts of a gradsync-train command line that decide what Hydra composes: its
    overrides, --config-dir, --config-path, --config-name, --multirun (the rest of Hydra's
    flags are taken and ignored)."""
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--config-dir", "-cd")
    parser.add_argument("--config-path", "-cp")
    parser.add_argument("--config-name", "-cn")
    parser.add_argument("--multirun", "-m", action="store_true")
    for flag, short in (("--cfg", "-c"), ("--package", "-p"), ("--info", "-i")):
        parser.add_argument(flag, short, nargs="?")
    args, _ = parser.parse_known_args(argv)
    return args


def compose_command_line(argv: list[str], app: Callable[..., Any],
                         leave_out: str) -> DictConfig | None:
    """The config Hydra composes for this command line (its overrides, --config-dir,
    --config-path, --config-name, hydra.searchpath, experiment presets) as the entry point's app
    ``app`` composes it, without the overrides of key ``leave_out``: what a composition that
    failed on that key chose. Through Hydra's public compose API (a --config-dir joins the
    search path as hydra.searchpath does). None where it cannot tell (a multirun that sweeps,
    or a composition that fails for another reason)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = command_line(argv)
        parsed = OverridesParser.create().parse_overrides(args.overrides)
    except Exception:
        return None
    if args.multirun and any(o.is_sweep_override() for o in parsed):
        return None  # which job failed is the sweeper's to know
    kept = [str(o.input_line) for o in parsed if o.key_or_group.lstrip("+~") != leave_out]
    config_dir = Path(args.config_path or CONF_DIR)
    if not config_dir.is_absolute():  # Hydra's --config-path: relative to the app's file
        config_dir = Path(inspect.getfile(inspect.unwrap(app))).parent / config_dir
    if args.config_dir is not None:
        searched = [o for o in parsed if o.key_or_group == "hydra.searchpath"]
        extra = f"file://{os.path.abspath(args.config_dir)}"
        if searched:  # the command line's own hydra.searchpath, the --config-dir first
            kept.remove(str(searched[0].input_line))
            paths = [extra, *searched[0].value()]  # type: ignore[misc]
        else:
            paths = [extra]
        kept.append(f"hydra.searchpath=[{','.join(paths)}]")
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return hydra_compose(args.config_name or "config", overrides=replace_mappings(kept))
    except Exception:
        return None
    finally:
        GlobalHydra.instance().clear()


def node_of(cfg: DictConfig | None, group: str) -> dict[str, Any] | None:
    """A group's node of a composed config as plain data (None: none there)."""
    try:
        node = OmegaConf.to_container(cfg[group], resolve=True) if cfg is not None else None
    except Exception:
        return None
    return node if isinstance(node, dict) else None  # type: ignore[return-value]
