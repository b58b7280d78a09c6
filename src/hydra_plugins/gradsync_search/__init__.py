"""gradsync's search sweeper (hydra/sweeper=optuna): Hydra instantiates sweepers only from the
hydra_plugins package, so the class lives here and hands everything to gradsync.run.search
(imported when a search starts: Hydra's plugin scan imports this module on every start)."""

from __future__ import annotations

from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSearch(Sweeper):
    def __init__(self, **settings: Any) -> None:
        from gradsync.run.sweep import import_optuna

        import_optuna()  # before the plugin's module imports it
        from gradsync.run.search import OptunaSearch as Search

        self.search = Search(**settings)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        self.search.setup(hydra_context=hydra_context, task_function=task_function,
                          config=config)

    def sweep(self, arguments: list[str]) -> None:
        self.search.sweep(arguments)
