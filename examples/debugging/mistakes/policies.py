"""Sync policies that get synchronisation wrong, each the way people do (docs/debugging.md)."""

from __future__ import annotations

from gradsync.sync.averaging import Averager


class NeverSync:
    """Every micro-batch inside no_sync(): the widely copied accumulation loop whose
    all-reduce never comes. gradsync stops it before its first optimizer step."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return False


class SyncsFirst:
    """The off-by-one: the window's *first* micro-batch synchronises, the rest stay in
    no_sync(), so the optimizer step would follow backwards whose gradients never left their
    rank. Stopped before the step, like NeverSync; the trace shows where the sync went."""

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return micro_index == 0


class NeverAverages(Averager):
    """An averager of the whole model that never averages, yet says the replicas are in sync."""

    whole_model = True  # the loop lets windows end without an all-reduce

    def in_sync(self) -> bool:
        return True  # the lie the replica check catches


class ForgetsToAverage:
    """Local SGD that never averages, yet tells the loop its replicas are in sync: nothing
    stops the replicas drifting apart but trainer.check_replicas."""

    def __init__(self) -> None:
        self.averager = NeverAverages()

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return False
