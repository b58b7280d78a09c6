"""The Hydra callback of a sweep (conf/config.yaml registers it under hydra.callbacks): the
sweep summary once a multirun ends (run/sweep.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from gradsync.run import sweep


class SweepSummary(Callback):
    """When a multirun ends it writes the sweep summary from the job dirs, prints it, and ends
    the sweep with exit code 1 if any job failed: sys.exit, because Hydra turns exceptions
    raised in callbacks into warnings. target_loss
    (hydra.callbacks.sweep_summary.target_loss): the eval loss the to-target columns measure;
    null: the worst final eval loss among the completed jobs."""

    def __init__(self, target_loss: float | None = None) -> None:
        self.target_loss = target_loss

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            result = sweep.write_summary(sweep_dir, self.target_loss)
        except Exception as e:  # a warning and exit code 0 otherwise
            print(f"gradsync: sweep summary failed: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        print(f"\n{result.markdown}", flush=True)
        if result.failed:
            print(f"gradsync: sweep: {result.failed} of {result.jobs} jobs failed; see "
                  f"{sweep_dir / 'sweep_summary.md'}", file=sys.stderr, flush=True)
            sys.exit(1)
