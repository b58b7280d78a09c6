"""gradsync installs beside a current ML stack (issue 45): its wheel with the search extra, pip's
own resolver choosing every other version from the registry (torch pinned to the lock's CPU
build: the local file, never a CUDA build), optuna >= 4, SQLAlchemy >= 2, MLflow, transformers
and Lightning, into a fresh venv; `pip check` finds nothing broken and the search imports.
Slow (about a minute on 2 busy cores: downloads and unpacks ~1.6 GB; --no-compile skips only
the byte-code), and it needs the package registry."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

STACK = ("torch==2.13.0", "optuna>=4", "sqlalchemy>=2", "mlflow", "transformers", "lightning")


def build_wheel(tmp_path: Path) -> Path:
    """gradsync's wheel, built from a copy of the repo (which stays untouched) into
    tmp_path/wheels; returns the wheel."""
    source, wheels = tmp_path / "source", tmp_path / "wheels"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("src", "conf"):
        shutil.copytree(REPO / part, source / part, ignore=skip)
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / part, source / part)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(wheels), str(source)],
                   check=True, capture_output=True, timeout=300)
    return next(wheels.glob("gradsync-*.whl"))


@pytest.mark.slow
def test_the_wheel_installs_beside_optuna_4_sqlalchemy_2_mlflow_transformers_lightning(
        tmp_path):
    wheel = build_wheel(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    done = subprocess.run([*pip, "install", "--quiet", "--no-compile",
                           f"gradsync[search] @ {wheel.as_uri()}", *STACK],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]  # ResolutionImpossible before issue 45
    check = subprocess.run([*pip, "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and check.stdout.strip() == "No broken requirements found.", \
        check.stdout
    versions = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import importlib.metadata as m, gradsync.run.search as s; "
         "print(*(m.version(p) for p in ('optuna', 'sqlalchemy', 'torch', 'mlflow', "
         "'transformers', 'lightning', 'gradsync')))"],
        capture_output=True, text=True, timeout=300)
    assert versions.returncode == 0, versions.stderr
    optuna, sqlalchemy, torch, *_, gradsync = versions.stdout.split()
    assert int(optuna.split(".")[0]) >= 4 and int(sqlalchemy.split(".")[0]) >= 2
    assert torch == "2.13.0+cpu" and gradsync == "0.1.0"
