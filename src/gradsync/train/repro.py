"""Reproducibility: deterministic algorithms, the config hash and run_info.json (the seeds:
core/seeds.py)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.deterministic

from gradsync.core.files import write_json_atomic


def prepare_cuda_determinism(setting: bool | None) -> None:
    """Before a rank's first CUDA call: deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG in
    the environment when it creates its handle, which may happen long before the model's first
    GEMM (off by default on CUDA: setting None)."""
    if setting:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def set_deterministic(setting: bool | None, device_type: str) -> bool:
    """Turn torch's deterministic algorithms on or off; returns the effective setting.

    None (trainer.deterministic's default): on for CPU, without torch's fill of every new
    tensor with NaN (``torch.utils.deterministic.fill_uninitialized_memory``, a check that no
    kernel reads memory it has not written: no kernel that is correct gives other bits without
    it, and it costs a write of every new tensor, on a GPT on CPU ~1 % of a step, much more
    where the ranks' threads contend); off for CUDA, where the deterministic kernels cost speed.
    True: torch's deterministic mode as torch ships it, the fill included (and cuBLAS's
    workspace setting on CUDA). False: off."""
    on = device_type == "cpu" if setting is None else setting
    if on and device_type == "cuda":
        prepare_cuda_determinism(setting)
    torch.use_deterministic_algorithms(on)
    torch.utils.deterministic.fill_uninitialized_memory = setting is not None  # type: ignore[attr-defined]
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False
    return on


def config_hash(cfg: dict[str, Any]) -> str:
    """sha256 of the resolved config, `resume`, `logger` and `network` left out (where a run
    continues from, what it logs to and which links its ranks talk over are not what it is)."""
    body = {k: v for k, v in cfg.items() if k not in ("resume", "logger", "network")}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def git_state(repo: Path) -> dict[str, Any] | None:
    """Commit and dirtiness of the checkout holding the code, read now (not at import)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain"))
    except (OSError, subprocess.SubprocessError):
        return None
    return {"repo": str(repo), "commit": commit, "dirty": dirty}


def _version(dist_name: str) -> str | None:
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return None


def run_info(cfg: dict[str, Any], repo: Path, backend: str, world_size: int,
             resumed_from: str | None) -> dict[str, Any]:
    return {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_state(repo),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "hydra": _version("hydra-core"), "omegaconf": _version("omegaconf"),
                     "numpy": np.__version__, "gradsync": _version("gradsync")},
        "backend": backend,
        "world_size": world_size,
        "host": socket.gethostname(),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "config_hash": config_hash(cfg),
        "seed": cfg["seed"],
        "resumed_from": resumed_from,
    }


def write_run_info(path: Path, info: dict[str, Any]) -> None:
    """run_info.json describes the latest start; a resume keeps the earlier starts in
    `previous_starts` rather than overwriting them."""
    if path.exists():
        try:
            before = json.loads(path.read_text())
            info["previous_starts"] = before.pop("previous_starts", []) + [before]
        except (OSError, ValueError):
            pass
    write_json_atomic(path, info)


def record_numerics(path: Path, fingerprint: dict[str, Any]) -> None:
    """Rank 0 adds what it computes with (core/numerics.py) to the run_info.json its job wrote
    (read in the rank: a portable worker's pins are not the job process's)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):  # a rank run without the job (tests, one's own loop)
        return
    info["numerics"] = fingerprint
    write_json_atomic(path, info)
