"""Checkpoints: written atomically (temporary file, fsync, rename) so a crash mid-write never
leaves a torn file under the final name; readable with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_atomic(obj: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)
