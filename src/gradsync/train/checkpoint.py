"""Checkpoint files: written atomically (temporary file, fsync, rename) so a crash mid-write never
leaves a torn file under the final name; readable with ``torch.load(weights_only=True)``.

``checkpoints/step_<step>.pt`` holds the training state; ``step_<step>.json`` beside it is written
after it and holds its size, sha256, step and config. A checkpoint is complete when both exist
and intact when the digest matches: torch.load notices a truncated file but not flipped bytes
inside a tensor. ``last.pt`` is a hard link to the newest checkpoint of the run.

A sharded engine's checkpoint (engine=fsdp|hsdp; train/sharded_checkpoint.py) is a
directory ``step_<step>.dcp`` that every rank writes its part of; its sidecar lists every file
with its size and sha256, and the run's ``last.pt`` is a consolidated file of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import IO, Any, cast

import torch

from gradsync.config.renames import renamed_record, upgrade_renamed_keys
from gradsync.core.files import flatten, replacing, write_json_atomic
from gradsync.train import dcp_safe
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


def progress_of(meta: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's (or its sidecar's) progress under today's names (config/renames.py
    RECORD_RENAMED: an older checkpoint's epoch_step is epoch_windows)."""
    return renamed_record(meta["progress"])


SHARDED_SUFFIX = ".dcp"  # a sharded checkpoint: a directory


def is_sharded(path: Path) -> bool:
    return path.suffix == SHARDED_SUFFIX


def sharded_files(path: Path) -> dict[str, Path]:
    """The files of a sharded checkpoint, by their path inside it."""
    return {str(f.relative_to(path)): f for f in sorted(path.rglob("*")) if f.is_file()}


def digest(path: Path) -> tuple[int, str, dict[str, list[Any]] | None]:
    """(bytes, sha256, files) of a checkpoint: a file's own; a sharded checkpoint's total bytes,
    the sha256 of its per-file digests and every file's [bytes, sha256]."""
    if not is_sharded(path):
        return path.stat().st_size, sha256_file(path), None
    files: dict[str, list[Any]] = {rel: [f.stat().st_size, sha256_file(f)]
                                   for rel, f in sharded_files(path).items()}
    listing = "".join(f"{rel} {size} {sha}\n" for rel, (size, sha) in files.items())
    return (sum(int(size) for size, _ in files.values()),
            hashlib.sha256(listing.encode()).hexdigest(), files)


def remove(path: Path) -> None:
    if is_sharded(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
    return seal(path, state, keep)


def seal(path: Path, state: dict[str, Any], keep: int, **extra: Any) -> Path:
    """A written checkpoint (a file, or a sharded checkpoint's directory, under its final name)
    made complete: its sidecar, then all but the newest `keep` dropped. extra: what else the
    sidecar records."""
    size, sha, files = digest(path)
    meta = {"file": path.name, "step": state["step"], "bytes": size, "sha256": sha,
            "world_size": state["world_size"], "config_hash": state["config_hash"],
            "config": state["config"]} | ({"files": files} if files else {}) | (
            {"numerics": state["numerics"]} if state.get("numerics") else {}) | extra
    write_json_atomic(path.with_suffix(".json"), meta)
    _fsync_dir(path.parent)
    for old in complete(path.parent)[keep:]:
        old.with_suffix(".json").unlink()  # incomplete first: never a .json without its .pt
        remove(old)
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
    """Checkpoints with their sidecar (files, or sharded checkpoints' directories), newest
    first."""
    found = [p for pattern in ("step_*.pt", f"step_*{SHARDED_SUFFIX}")
             for p in ckpt_dir.glob(pattern) if p.with_suffix(".json").exists()]
    return sorted(found, key=lambda p: p.stem, reverse=True)


# what write() puts in a sidecar and resuming reads: a sidecar without them is corrupt
SIDECAR = {"step": int, "bytes": int, "sha256": str, "world_size": int, "config_hash": str,
           "config": dict}


def sidecar(path: Path) -> dict[str, Any]:
    """A checkpoint's sidecar as written ({} if it cannot be read: verify says why)."""
    try:
        meta = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def verify(path: Path) -> dict[str, Any]:
    """The sidecar of an intact checkpoint; ResumeError saying what is wrong otherwise."""
    side = path.with_suffix(".json")
    if not (path.is_dir() if is_sharded(path) else path.is_file()):
        kind = "directory" if is_sharded(path) else "file"
        raise ResumeError(f"{path}: no such checkpoint {kind}")
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
    if is_sharded(path):
        verify_files(path, meta)
    size = path.stat().st_size if not is_sharded(path) else sum(
        f.stat().st_size for f in sharded_files(path).values())
    if size != meta["bytes"]:
        raise ResumeError(f"{path}: truncated or corrupt checkpoint ({size} bytes, "
                          f"{meta['bytes']} written)")
    if digest(path)[1] != meta["sha256"]:
        raise ResumeError(f"{path}: corrupt checkpoint (sha256 differs from the one written)")
    if is_sharded(path):
        try:
            dcp_safe.check(path)  # a pickle that would run code when a rank reads it
        except dcp_safe.UnsafeCheckpoint as e:
            raise ResumeError(str(e)) from None
    return meta


def verify_files(path: Path, meta: dict[str, Any]) -> None:
    """A sharded checkpoint holds every file its sidecar lists, each of the size written."""
    listed = meta.get("files")
    if not isinstance(listed, dict) or not listed:
        raise ResumeError(f"{path}: corrupt checkpoint ({path.with_suffix('.json').name} lists "
                          "no files)")
    present = sharded_files(path)
    for rel, entry in listed.items():
        if rel not in present:
            raise ResumeError(f"{path}: incomplete checkpoint ({rel} missing)")
        if not isinstance(entry, list) or present[rel].stat().st_size != entry[0]:
            raise ResumeError(f"{path}: truncated or corrupt checkpoint ({rel})")


def newest_intact(ckpt_dir: Path, notes: list[str]) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies; each one skipped on the way is noted."""
    for path in complete(ckpt_dir):
        try:
            return path, verify(path)
        except ResumeError as e:
            notes.append(f"skipping {e}")
    return None


def resolve_resume(resume: str, run_dir: Path, cfg: dict[str, Any], world_size: int,
                   notes: list[str], *, sharded: bool) -> Path | None:
    """Where a run starts from: None (fresh) or an intact, compatible checkpoint. sharded:
    whether the run's engine shards the model (its capabilities), so resumes from a sharded
    checkpoint.

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
    if resume == "auto" or (Path(resume).is_dir() and not is_sharded(Path(resume))):
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
    refuse_incompatible(path, meta, cfg, world_size, sharded=sharded)
    return path.resolve()


def epoch_position(progress: dict[str, Any], old_cfg: dict[str, Any], old_world: int,
                   new_window: int, new_world: int) -> tuple[int, int] | None:
    """Where a checkpoint stands in its epoch, as the windows of new_window micro-batches on
    new_world ranks cut it: (epoch, windows done). Every rank's window k holds the global sample
    positions [k W N m, (k+1) W N m) of the epoch (data/loader.py train_loader: the same global
    order on any world size), so the position carries over when the samples consumed are a
    whole number of the new windows. None when they are not."""
    from gradsync.config.schema import RunConfig
    from gradsync.train.schedules import build_schedule

    epoch, done = progress["epoch"], progress["epoch_windows"]
    old = RunConfig.from_plain(old_cfg)
    micro = old.micro_batch_size
    old_window = build_schedule(old.schedule, old_world).window_size(epoch)
    consumed = done * old_window * micro * old_world
    window = new_window * micro * new_world
    return (epoch, consumed // window) if consumed % window == 0 else None


def refuse_misaligned(path: Path, meta: dict[str, Any], cfg: dict[str, Any],
                      world_size: int) -> None:
    """A sharded checkpoint resumes at another world size (torch.distributed.checkpoint
    reshards) where its position in the epoch is a window boundary there too."""
    if not isinstance(meta.get("progress"), dict):
        raise ResumeError(f"{path}: corrupt checkpoint (its sidecar lacks a valid progress)")
    from gradsync.config.schema import RunConfig
    from gradsync.train.schedules import build_schedule

    run = RunConfig.from_plain(cfg)
    p = progress_of(meta)
    window = build_schedule(run.schedule, world_size).window_size(p["epoch"])
    if epoch_position(p, meta["config"], meta["world_size"], window, world_size) is None:
        raise ResumeError(f"{path} stopped after window {p['epoch_windows']} of epoch "
                          f"{p['epoch']} "
                          f"on {meta['world_size']} ranks, which is not a window boundary on "
                          f"{world_size} ranks; resume from a checkpoint at an epoch's start, or "
                          "keep the global batch (schedule=global_batch)")


# Whatever a checkpoint's state depends on: only trainer.* (more steps or epochs, cadences,
# threads...), engine.* (the engine, within its kind: refuse_incompatible), compile.*,
# noise_scale.* (once all trainer.*), logger.* (the trackers) and network.* (the links the ranks
# talk over: the same bits on any) may change, and the world size
# may not (each rank's data share and RNG stream).
MAY_CHANGE = ("trainer.", "engine.", "compile.", "noise_scale.", "resume", "logger.", "network.")


def refuse_incompatible(path: Path, meta: dict[str, Any], cfg: dict[str, Any],
                        world_size: int, *, sharded: bool) -> None:
    engine = cfg["engine"]["name"]
    if is_sharded(path) != sharded:
        kind = "a sharded checkpoint (fsdp, hsdp)" if is_sharded(path) else \
            "a replicated model's checkpoint"
        raise ResumeError(f"{path} is {kind}; this run has engine={engine}")
    if meta["world_size"] != world_size:
        if not is_sharded(path):
            raise ResumeError(f"{path} was written by {meta['world_size']} "
                              f"processes, this run has {world_size}")
        refuse_misaligned(path, meta, cfg, world_size)
    if meta["config_hash"] == config_hash(cfg):
        return
    old = flatten(upgrade_renamed_keys(meta["config"]))  # written before a rename: its new names
    new = flatten(json.loads(json.dumps(cfg)))  # the sidecar's JSON types (str dict keys)
    for key in sorted(old.keys() | new.keys()):
        if key.startswith(MAY_CHANGE) or old.get(key) == new.get(key):
            continue
        raise ResumeError(
            f"{path} was trained with {key}={old.get(key)!r}, this run has "
            f"{key}={new.get(key)!r}; only trainer settings other than the world size (more "
            "steps or epochs, cadences) may change on resume: use a new run dir")


# --- one's own loop's checkpoints (docs/own-loop.md) ---------------------------------------------
def save_checkpoint(ckpt_dir: str | Path, step: int, keep: int = 3,
                    **state: Any) -> Path | None:
    """`state` (state_dicts and plain numbers) as a checkpoint of optimizer step `step`:
    written by rank 0 alone (no collective), atomically, with its sidecar (size, sha256) and
    what this process computes with (core/numerics.py); the newest `keep` kept. The path on
    rank 0, None on the others."""
    import torch.distributed as dist

    from gradsync.core import numerics

    up = dist.is_available() and dist.is_initialized()
    if up and dist.get_rank() != 0:
        return None
    return write({**state, "step": step, "world_size": dist.get_world_size() if up else 1,
                  "config": {}, "config_hash": config_hash({}),
                  "numerics": numerics.fingerprint(numerics.bits_in_force())},
                 Path(ckpt_dir), keep)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """The newest intact checkpoint of directory `path` (or the file it names), its digest
    checked (ResumeError saying what is wrong otherwise). Where what it was written with
    differs from what this process computes with, one line on stderr names what differs: the
    continuation will not be bitwise the uninterrupted run."""
    import sys

    from gradsync.core import numerics

    where, notes = Path(path), list[str]()
    found = newest_intact(where, notes) if where.is_dir() else (where, verify(where))
    for note in notes:
        print(f"gradsync: {note}", file=sys.stderr)
    if found is None:
        raise ResumeError(f"{where}: no intact checkpoint")
    ckpt = load(found[0])
    differ = numerics.differences(ckpt.get("numerics"),
                                  numerics.fingerprint(numerics.bits_in_force()))
    if differ:
        print(f"gradsync: {found[0]}: the numerics differ from the checkpoint's "
              f"({'; '.join(differ)}): the continuation is not bitwise the uninterrupted run",
              file=sys.stderr)
    return ckpt
