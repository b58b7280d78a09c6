"""gradsync: DDP training whose sync policies decide, micro-batch by micro-batch, whether a
backward runs inside ``no_sync()`` or synchronises.

Two ways in: ``gradsync-train`` (a Hydra experiment: README.md), or these pieces in a loop of
one's own (docs/own-loop.md), which gradsync's own loop (train/loop.py) is written with too:

    engine = gradsync.engine(model, policy)              # torch's DDP (or gradsync, fsdp)
    loader = gradsync.loader(dataset, micro_batch_size=16)
    normalizer = gradsync.normalizer(policy)
    for window in gradsync.windows(loader, epoch, window_size=4):
        for micro in window:
            with engine.micro_batch(window.should_sync(policy, micro)):
                sums, counts = loss(micro.real(engine(micro.x)), micro.y)
                normalizer.micro_loss(window, micro.index, sums, counts).backward()
        gradsync.optimizer_step(engine, optimizer, policy, normalizer)
"""

from typing import Any

__version__ = "0.1.0"

# A rank a launcher spawned dies with it from this line on, before anything of the job is
# imported (core/lifeline.py); elsewhere nothing happens.
from gradsync.core.lifeline import bind_from_environment  # noqa: E402

bind_from_environment()

# The public pieces, each imported when first asked for (`import gradsync` stays light: every
# rank imports it first): name -> its module.
API = {
    "engine": "gradsync.engines",
    "loader": "gradsync.data.loader",
    "windows": "gradsync.train.windows",
    "normalizer": "gradsync.train.normalize",
    "run_window": "gradsync.train.loop",
    "optimizer_step": "gradsync.train.loop",
    "save_checkpoint": "gradsync.train.checkpoint",
    "load_checkpoint": "gradsync.train.checkpoint",
    "fingerprint": "gradsync.core.numerics",
    "seed_everything": "gradsync.core.seeds",
    "seed_rank": "gradsync.core.seeds",
    "SyncPolicy": "gradsync.sync.policy",
    "AlwaysSync": "gradsync.sync.policies",
    "AccumulateSync": "gradsync.sync.policies",
    "AmpAwareSync": "gradsync.sync.policies",
    "local_sgd": "gradsync.sync.local_sgd",
    "diloco": "gradsync.sync.local_sgd",
    "Averager": "gradsync.sync.averaging",
}
__all__ = sorted(API)


def __getattr__(name: str) -> Any:
    if name not in API:
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(API[name]), name)
    globals()[name] = value
    return value
