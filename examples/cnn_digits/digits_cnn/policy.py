"""A sync policy of one's own: synchronise every micro-batch for the first windows (a warm-up
whose every intermediate gradient is global), then only the last micro-batch of each window.

A policy needs only should_sync (gradsync.sync.policy.SyncPolicy's one method). This one counts
the windows it has seen end (at each window's last micro-batch), and keeps that count in
checkpoints through state_dict / load_state_dict, so a resumed run continues exactly."""

from __future__ import annotations

from typing import Any

from gradsync.components import CheckContext, checks, require


def _check(args: dict[str, Any], ctx: CheckContext) -> None:
    require(args["warmup_windows"] >= 0, "sync.warmup_windows", "an integer >= 0",
            args["warmup_windows"])


@checks(_check)
class WarmupAlways:
    name = "warmup_always"

    def __init__(self, warmup_windows: int = 10):
        self.warmup_windows = warmup_windows
        self.windows_done = 0

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        last = micro_index == window_size - 1
        sync = self.windows_done < self.warmup_windows or last
        self.windows_done += last  # this window ends with this micro-batch
        return sync

    def state_dict(self) -> dict[str, int]:
        return {"windows_done": self.windows_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.windows_done = state["windows_done"]
