"""gradsync's search sweeper (hydra/sweeper=optuna): Hydra instantiates sweepers only from the
hydra_plugins package, so the class lives here, on Hydra's public ``Sweeper`` API, and hands
the work to gradsync.run.search (imported when a search starts: Hydra's plugin scan imports
this module on every start, and Optuna is an extra, gradsync[search])."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class OptunaSearch(Sweeper):
    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.search: Any = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction,
              config: DictConfig) -> None:
        from gradsync.run.search import Search

        self.hydra_context, self.config = hydra_context, config  # validate_batch_is_legal's
        self.search = Search(self, task_function, **self.settings)

    def sweep(self, arguments: list[str]) -> None:
        self.search.sweep(arguments)

    def compose_check(self, batch: Sequence[Sequence[str]]) -> None:
        """Hydra composes each job's overrides as it would the job's (Sweeper's own check)."""
        self.validate_batch_is_legal(batch)
