"""Checkpoint files: written atomically (temporary file, fsync, rename) so a crash mid-write never
leaves a torn file under the final name; readable with ``torch.load(weights_only=True)``.

``checkpoints/step_<step>.pt`` holds the training state; ``step_<step>.json`` beside it is written
after it and holds its size, sha256, step and config. A checkpoint is complete when both exist
and intact when the digest matches: torch.load notices a truncated file but not flipped bytes
inside a tensor. ``last.pt`` is a hard link to the newest checkpoint of the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import IO, Any, cast

import torch

from gradsync.train.files import replacing
from gradsync.train.metrics import write_json_atomic
from gradsync.train.repro import config_hash

CKPT_DIR = "checkpoints"


class ResumeError(ValueError):
    """A resume that cannot go ahead: reported as one line, nothing in the run dir touched."""


def _fsync_dir(path: Path) -> None:
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class _Writes:
    """A file as torch.save sees it, keeping the OSError of a failed write: torch.save turns it
    into a RuntimeError that has lost its cause ("unexpected pos 64 vs 0")."""

    def __init__(self, f: Any):
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path, binary=True, tmp=path.with_name(f".{path.name}.tmp")) as f:
        writes = _Writes(f)
        try:
            torch.save(obj, cast(IO[bytes], writes))
        except RuntimeError:
            if writes.error is not None:  # a full disk, say: raised as what it is
                raise writes.error from None
            raise
    _fsync_dir(path.parent)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def step_path(ckpt_dir: Path, step: int) -> Path:
    return ckpt_dir / f"step_{step:08d}.pt"


def write(state: dict[str, Any], ckpt_dir: Path, keep: int) -> Path:
    """Write one step's checkpoint and its sidecar, then drop all but the newest `keep`."""
    path = step_path(ckpt_dir, state["step"])
    save_atomic(state, path)
    meta = {"file": path.name, "step": state["step"], "bytes": path.stat().st_size,
            "sha256": sha256_file(path), "world_size": state["world_size"],
            "config_hash": state["config_hash"], "config": state["config"]}
    write_json_atomic(path.with_suffix(".json"), meta)
    _fsync_dir(ckpt_dir)
    for old in complete(ckpt_dir)[keep:]:
        old.with_suffix(".json").unlink()  # incomplete first: never a .json without its .pt
        old.unlink(missing_ok=True)
    return path


def link_last(path: Path) -> None:
    """Point checkpoints/last.pt at `path` (a hard link, a copy where links are refused)."""
    tmp = path.with_name(".last.pt.tmp")
    tmp.unlink(missing_ok=True)
    try:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, path.with_name("last.pt"))
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def complete(ckpt_dir: Path) -> list[Path]:
    """Checkpoints with their sidecar, newest first."""
    found = [p for p in ckpt_dir.glob("step_*.pt") if p.with_suffix(".json").exists()]
    return sorted(found, key=lambda p: p.name, reverse=True)


# what write() puts in a sidecar and resuming reads: a sidecar without them is corrupt
SIDECAR = {"step": int, "bytes": int, "sha256": str, "world_size": int, "config_hash": str,
           "config": dict}


def verify(path: Path) -> dict[str, Any]:
    """The sidecar of an intact checkpoint; ResumeError saying what is wrong otherwise."""
    side = path.with_suffix(".json")
    if not path.is_file():
        raise ResumeError(f"{path}: no such checkpoint file")
    try:
        meta = json.loads(side.read_text())
    except (OSError, ValueError):
        raise ResumeError(f"{path}: incomplete checkpoint ({side.name} missing or "
                          "unreadable)") from None
    wrong = [key for key, kind in SIDECAR.items()
             if not isinstance(meta, dict) or not isinstance(meta.get(key), kind)
             or isinstance(meta.get(key), bool)]
    if wrong:
        raise ResumeError(f"{path}: corrupt checkpoint ({side.name} lacks a valid "
                          f"{', '.join(wrong)})")
    size = path.stat().st_size
    if size != meta["bytes"]:
        raise ResumeError(f"{path}: truncated or corrupt checkpoint ({size} bytes, "
                          f"{meta['bytes']} written)")
    if sha256_file(path) != meta["sha256"]:
        raise ResumeError(f"{path}: corrupt checkpoint (sha256 differs from the one written)")
    return meta


def newest_intact(ckpt_dir: Path, notes: list[str]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies; each one skipped on the way is noted."""
    for path in complete(ckpt_dir):
        try:
            return path, verify(path)
        except ResumeError as e:
            notes.append(f"skipping {e}")
    return None


def resolve_resume(resume: str, run_dir: Path, cfg: dict[str, Any], world_size: int,
                   notes: list[str]) -> Path | None:
    """Where a run starts from: None (fresh) or an intact, compatible checkpoint.

    resume: `none` (refused if the run dir already holds checkpoints: nothing is overwritten),
    `auto` (the newest intact checkpoint in the run dir, falling back past corrupt ones; fresh
    if there are none), or a path (a checkpoint file, or a run dir / checkpoints dir)."""
    own = run_dir / CKPT_DIR
    if resume == "none":
        if own.is_dir() and complete(own):
            raise ResumeError(f"{run_dir} already holds checkpoints of an earlier run: "
                              "pass resume=auto to continue it, or choose another "
                              "hydra.run.dir")
        return None
    if resume == "auto" or Path(resume).is_dir():
        where = own if resume == "auto" else Path(resume)
        if (where / CKPT_DIR).is_dir():
            where = where / CKPT_DIR
        found = newest_intact(where, notes) if where.is_dir() else None
        if found is None:
            if resume == "auto" and not notes:
                return None
            raise ResumeError(f"resume={resume}: no intact checkpoint in {where}")
        path, meta = found
    else:
        path = Path(resume)
        meta = verify(path)
    refuse_incompatible(path, meta, cfg, world_size)
    return path.resolve()


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


# Whatever a checkpoint's state depends on: only trainer.* (more steps or epochs, cadences,
# threads...) may change, and the world size may not (each rank's data share and RNG stream).
MAY_CHANGE = ("trainer.", "resume")


def refuse_incompatible(path: Path, meta: dict[str, Any], cfg: dict[str, Any],
                        world_size: int) -> None:
    if meta["world_size"] != world_size:
        raise ResumeError(f"{path} was written by {meta['world_size']} "
                          f"processes, this run has {world_size}")
    if meta["config_hash"] == config_hash(cfg):
        return
    old = _flatten(meta["config"])
    new = _flatten(json.loads(json.dumps(cfg)))  # the sidecar's JSON types (str dict keys)
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(MAY_CHANGE) or old.get(key) == new.get(key):
            continue
        raise ResumeError(
            f"{path} was trained with {key}={old.get(key)!r}, this run has "
            f"{key}={new.get(key)!r}; only trainer settings other than the world size (more "
            "steps or epochs, cadences) may change on resume: use a new run dir")
