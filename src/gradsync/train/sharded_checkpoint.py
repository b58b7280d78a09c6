"""Checkpoints of a sharded engine (engine=fsdp|hsdp): torch.distributed.checkpoint.

``checkpoints/step_<step>.dcp/`` is a directory every rank writes its own shards into (DCP's
``__<rank>_0.distcp`` files and its ``.metadata``: the model's and the optimizer's sharded state,
by parameter name), plus ``train_state.pt`` from rank 0: everything else a checkpoint holds
(LR scheduler, policy, schedule, progress, each rank's RNG streams and counters, the config;
train/state.py), readable with ``torch.load(weights_only=True)``.

Atomic as the single-file checkpoints are: the ranks write into ``.step_<step>.dcp.tmp/``
(DCP fsyncs every file), rank 0 renames it to its final name once every rank has written, then
writes the sidecar ``step_<step>.json`` with every file's size and sha256 (train/checkpoint.py
``seal``): a checkpoint without its sidecar is incomplete and never resumed from. DCP's
``.metadata`` and its non-tensor values are pickles: they are read restricted, so a planted one
runs nothing (train/dcp_safe.py). A failure inside DCP (torch's ``CheckpointException``, a
``BaseException``) is a ``CheckpointError``: one line naming the checkpoint and the first rank's
error.

Loading reshards: a checkpoint written by W ranks loads on W' ranks (each rank reads the pieces
of the shards it now owns), where the checkpoint's position in its epoch is a window boundary at
W' (train/checkpoint.py ``epoch_position``).

At the end of a run rank 0 also writes ``checkpoints/last.pt``: the consolidated model (the full
state dict, gathered; the same parameter names and shapes as the unsharded model's, as
torch_ddp's ``last.pt`` holds it) and the run's state, for deployment and comparison; the
optimizer's state stays in the sharded checkpoint it names (``sharded``).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradsync.core.ranks import is_rank0
from gradsync.train import checkpoint, dcp_safe
from gradsync.train import state as trainstate
from gradsync.train.loop import Parts, Progress

SHARDED = ("model", "optimizer")  # what DCP keeps; train_state.pt the rest
STATE_FILE = "train_state.pt"


class CheckpointError(RuntimeError):
    """A sharded checkpoint that could not be written or read: one line."""


@contextmanager
def _one_line(path: Path, doing: str) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException, its str ~100 lines of every rank's
    traceback) as one line: the checkpoint, and the error of the lowest rank that failed."""
    from torch.distributed.checkpoint import CheckpointException

    try:
        yield
    except CheckpointException as e:
        rank, (exc, _) = min(e.failures.items()) if e.failures else (-1, (e, None))
        line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{doing} {path} failed on rank {rank}: {type(exc).__name__}: "
                              f"{line}") from None


def _barrier(group: Any) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier(group=group)


def _tensors(p: Parts) -> dict[str, Any]:
    """The sharded state DCP saves and loads in place: model and optimizer by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return {"model": p.engine.state_dict(),
            "optimizer": get_optimizer_state_dict(p.engine.module, p.optimizer)}


def write(p: Parts, state: Progress, cfg: dict[str, Any], group: Any, ckpt_dir: Path,
          keep: int) -> Path:
    """Collective: every rank writes its shards of this step's checkpoint; rank 0 the rest,
    then makes it complete. group: a CPU (gloo) group for DCP's coordination (None: world 1)."""
    import torch.distributed.checkpoint as dcp

    rest = trainstate.capture(p, state, cfg, group, skip=SHARDED)
    final = checkpoint.step_path(ckpt_dir, state.step).with_suffix(checkpoint.SHARDED_SUFFIX)
    tmp = final.with_name(f".{final.name}.tmp")
    if is_rank0():
        shutil.rmtree(tmp, ignore_errors=True)  # a killed run's partial write
        tmp.mkdir(parents=True)
    _barrier(group)
    with _one_line(tmp, "writing"):
        dcp.save(_tensors(p), storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                 process_group=group)
    _barrier(group)  # every rank's files are written (and fsynced)
    if is_rank0():
        assert rest is not None
        checkpoint.save_atomic(rest, tmp / STATE_FILE)
        checkpoint.remove(final)  # a sidecar-less leftover of a killed run, never resumed from
        tmp.rename(final)
        checkpoint.seal(final, rest, keep, progress=rest["progress"],
                        engine=p.engine.name)
    _barrier(group)  # no rank goes on (or is told to stop) before the checkpoint is complete
    return final


def load(p: Parts, path: Path, rank: int, group: Any) -> Progress:
    """Load a sharded checkpoint into freshly built parts, resharding it to this world size;
    returns the Progress to continue from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    tensors = _tensors(p)
    with _one_line(path, "reading"):
        dcp.load(tensors, storage_reader=dcp_safe.reader(path), planner=dcp_safe.planner(),
                 process_group=group)
    p.engine.load_state_dict(tensors["model"])
    set_optimizer_state_dict(p.engine.module, p.optimizer, tensors["optimizer"])
    rest = checkpoint.load(path / STATE_FILE)
    state = trainstate.restore(p, rest, rank, skip=SHARDED)
    if rest["world_size"] != p.world_size:  # where the same samples end at this world size
        window = p.schedule.window_size(state.epoch)
        found = checkpoint.epoch_position(checkpoint.progress_of(rest), rest["config"],
                                          rest["world_size"], window, p.world_size)
        assert found is not None, "refused before the ranks started (refuse_misaligned)"
        state.epoch, state.epoch_windows = found
        state.epoch_micro = state.epoch_windows * window  # full windows before this point
    return state


def write_last(p: Parts, newest: Path) -> None:
    """Collective: rank 0 writes checkpoints/last.pt, the consolidated model and the state of
    `newest` (the sharded checkpoint of the run's last step, which the model now holds)."""
    full = p.engine.full_state_dict()  # type: ignore[attr-defined]
    if not is_rank0():
        return
    rest = checkpoint.load(newest / STATE_FILE)
    checkpoint.save_atomic(rest | {"model": full, "sharded": newest.name},
                           newest.with_name("last.pt"))
