"""The numerics a rank computes with: its fingerprint, and the pins of `trainer.bits=portable`.

A float result on a CPU depends on which kernels compute it, and torch 2.13's CPU build picks
them by the CPU it finds: ATen's vectorised kernels by capability (DEFAULT / AVX2 / AVX512),
MKL's GEMM by its own dispatch (and by vendor: its AVX2 and AVX-512 branches run on Intel CPUs
only, any other CPU gets its AUTO branch), oneDNN's convolutions by ISA and cache sizes, NumPy's
loops by its own dispatch; and every parallel reduction by the thread count. `native` (the
default) lets each pick the fastest path of the CPU at hand: the same config gives the same
bits on the same kind of machine. `portable` pins every one of them before torch loads, so the
same config gives the same bits on any x86-64 CPU with AVX2 and FMA, Intel or AMD, with or
without AVX-512 (docs/reproducibility.md: what was measured, and what is promised where):

- ATen at AVX2 (ATEN_CPU_CAPABILITY; also what torch.compile's C++ vectorises to),
- MKL's COMPATIBLE branch in strict mode (MKL_CBWR): the one branch MKL runs alike on Intel and
  other CPUs (SSE2 kernels: slower GEMMs),
- oneDNN off (torch.backends.mkldnn: convolutions take ATen's im2col + MKL GEMM; its kernels
  block by the CPU's cache sizes) and capped at AVX2 (ONEDNN_MAX_CPU_ISA) where still used,
- NumPy's dispatch capped at AVX2 (NPY_DISABLE_CPU_FEATURES), torch.compile's C++ built for
  x86-64-v3 (TORCHINDUCTOR_CPP_MARCH) instead of -march=native,
- a fixed thread count (trainer.threads_per_worker; 0 means 1 here).

These are read when the libraries load: a worker gets them in its environment before it imports
torch (the launcher spawns it so), and a rank started by torchrun or srun must be started with
them (`python -m gradsync.core.numerics` prints them).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import platform
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from gradsync.core.files import flatten

BITS = ("native", "portable")
PORTABLE_CAPABILITY = "AVX2"  # what torch.backends.cpu.get_cpu_capability() reports pinned
CPU_BASELINE = ("avx2", "fma")  # /proc/cpuinfo flags the pinned kernels need

# MKL's CBWR branches (mkl_cbwr.h), as mkl_cbwr_get(MKL_CBWR_BRANCH) returns them
_MKL_BRANCHES = {0: "OFF", 1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3",
                 7: "SSE4_1", 8: "SSE4_2", 9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512",
                 13: "AVX512_MIC_E1", 14: "AVX512_E1", 15: "AVX512_E2", 16: "AVX512_E3",
                 17: "AVX512_E4", 18: "AVX2_E1", 19: "AVX512_E5"}
# the environment variables that steer a CPU numerics path (recorded as they were; the thread
# count is recorded as torch runs it)
PIN_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS",
                 "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "NPY_DISABLE_CPU_FEATURES",
                 "NPY_ENABLE_CPU_FEATURES", "TORCHINDUCTOR_CPP_MARCH")
# what portable bits take out of a worker's environment: settings its pins make moot, which
# would only make two machines' records differ
PORTABLE_UNSETS = ("MKL_ENABLE_INSTRUCTIONS", "NPY_ENABLE_CPU_FEATURES")


class NumericsError(ValueError):
    """portable bits cannot be had here (a config error: one line, before any worker starts)."""


def portable_env() -> dict[str, str]:
    """What a worker's environment holds under trainer.bits=portable, set before torch loads."""
    env = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE,STRICT",
           "ONEDNN_MAX_CPU_ISA": "AVX2", "DNNL_MAX_CPU_ISA": "AVX2",
           "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}
    above = _numpy_targets_above_avx2()
    if above:
        env["NPY_DISABLE_CPU_FEATURES"] = ",".join(above)
    return env


@contextlib.contextmanager
def worker_environment(bits: str) -> Iterator[None]:
    """What the processes started inside get in their environment: under portable bits its pins
    (and the settings they make moot taken out); os.environ as it was afterwards."""
    pins = portable_env() if bits == "portable" else {}
    unset = PORTABLE_UNSETS if bits == "portable" else ()
    before = {k: os.environ.get(k) for k in (*pins, *unset)}
    os.environ.update(pins)
    for k in unset:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _numpy_targets_above_avx2() -> list[str]:
    """NumPy's dispatch targets past AVX2 (their names change between versions: AVX512_SKX
    ..., X86_V4 from 2.4); a target the CPU lacks is never dispatched to anyway."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__  # type: ignore[import-not-found]
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_dispatch__  # type: ignore
        except ImportError:
            return []
    return [t for t in __cpu_dispatch__ if t.startswith(("AVX512", "X86_V4"))]


def cpu_info() -> dict[str, Any]:
    """The CPU's vendor, model and the /proc/cpuinfo flags the pins are about."""
    vendor, model, flags = None, platform.processor() or None, set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id" and vendor is None:
            vendor = value
        elif key == "model name" and (model is None or model == platform.processor()):
            model = value
        elif key == "flags" and not flags:
            flags = set(value.split())
    wanted = ("avx2", "fma", "avx512f")
    return {"vendor": vendor, "model": model, "arch": platform.machine(),
            "flags": [f for f in wanted if f in flags]}


def check_portable_cpu(info: dict[str, Any] | None = None) -> None:
    """portable bits need an x86-64 CPU with AVX2 and FMA (the pinned kernels use them)."""
    info = cpu_info() if info is None else info
    if info["arch"] not in ("x86_64", "AMD64"):
        raise NumericsError(f"trainer.bits=portable pins x86-64 numerics; this machine is "
                            f"{info['arch']} (use trainer.bits=native)")
    missing = [f for f in CPU_BASELINE if f not in info["flags"]]
    if missing:
        raise NumericsError(f"trainer.bits=portable needs a CPU with AVX2 and FMA; this one "
                            f"({info['model']}) lacks {', '.join(missing)} (use "
                            "trainer.bits=native)")


def check_portable(started_by: str | None, info: dict[str, Any] | None = None) -> None:
    """Before any worker starts: this CPU can run portable bits, and a rank started by an
    outside launcher (`started_by`: torchrun, srun...; None: gradsync spawns the ranks and pins
    them itself) was started with the pins."""
    check_portable_cpu(info)
    if started_by is None:
        return
    missing = pins_missing()
    if missing:
        raise NumericsError(
            f"trainer.bits=portable: this rank ({started_by}) was started without the pins "
            f"({'; '.join(missing)}), which must be in its environment before torch loads: "
            f"start the ranks with `env $(python -m gradsync.core.numerics) {started_by} ...`")


def pins_missing() -> list[str]:
    """What of portable mode is not in force in this process: a variable not set as portable
    sets it, or a library that loaded without it (ATen's capability, MKL's branch)."""
    missing = [f"{k}={v}" for k, v in portable_env().items() if os.environ.get(k) != v]
    missing += [f"{k} unset" for k in PORTABLE_UNSETS if k in os.environ]
    if torch.backends.cpu.get_cpu_capability() != PORTABLE_CAPABILITY:
        missing.append(f"ATen capability {torch.backends.cpu.get_cpu_capability()} "
                       f"(not {PORTABLE_CAPABILITY})")
    branch = mkl_branch()
    if branch not in (None, "COMPATIBLE"):
        missing.append(f"MKL branch {branch} (not COMPATIBLE)")
    return missing


def bits_in_force() -> str:
    """portable where this process runs with portable bits' pins, else native."""
    return "native" if pins_missing() or torch.backends.mkldnn.enabled else "portable"


def apply(bits: str, device_type: str) -> list[str]:
    """In a rank, before its model is built: under portable, oneDNN off (the pins of the
    environment are checked by the caller). Returns lines to log."""
    if bits != "portable":
        return []
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]
    if device_type == "cuda":
        return ["trainer.bits=portable pins the CPU's numerics only: on CUDA the same bits "
                "need the same GPU model, CUDA, cuDNN and NCCL versions and "
                "trainer.deterministic=true; another GPU model computes other bits"]
    return []


def _torch_lib() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None


def mkl_branch() -> str | None:
    """MKL's CBWR branch in force (None: no MKL in this torch, or not readable)."""
    if not torch.backends.mkl.is_available():
        return None
    lib = _torch_lib()
    get = getattr(lib, "mkl_serv_cbwr_get", None) if lib is not None else None
    if get is None:
        return None
    get.restype, get.argtypes = ctypes.c_int, [ctypes.c_int]
    value = int(get(1))  # MKL_CBWR_BRANCH
    return _MKL_BRANCHES.get(value, str(value))


def _config_version(pattern: str) -> str | None:
    match = re.search(pattern, torch.__config__.show())
    return match.group(1) if match else None


def fingerprint(bits: str) -> dict[str, Any]:
    """What this process computes with, read from torch's own APIs (and the CPU's): compare two
    with `differences`."""
    import numpy as np

    cpu = cpu_info()
    out: dict[str, Any] = {
        "bits": bits,
        "torch": str(torch.__version__), "torch_git": str(torch.version.git_version),
        "numpy": np.__version__,
        "cpu": {"vendor": cpu["vendor"], "model": cpu["model"], "arch": cpu["arch"],
                "flags": cpu["flags"], "capability": torch.backends.cpu.get_cpu_capability()},
        "mkl": {"version": _config_version(r"Math Kernel Library Version ([\d.]+)"),
                "branch": mkl_branch()},
        "onednn": {"version": _config_version(r"MKL-DNN v([\d.]+)"),
                   "enabled": bool(torch.backends.mkldnn.enabled)
                   and torch.backends.mkldnn.is_available()},
        "pins": {k: os.environ[k] for k in PIN_VARIABLES if k in os.environ},
        "threads": torch.get_num_threads(),
        "deterministic": {"algorithms": torch.are_deterministic_algorithms_enabled(),
                          "cudnn": bool(torch.backends.cudnn.deterministic),
                          "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)},
        "cuda": None,
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
        out["cuda"] = {"gpu": torch.cuda.get_device_name(index),
                       "capability": f"{major}.{minor}", "cuda": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version(),
                       "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
                       "tf32_matmul": torch.backends.cuda.matmul.allow_tf32}
    return out


# what portable bits leave out of the comparison: the CPU itself (that is the point)
_PORTABLE_IGNORES = ("cpu.vendor", "cpu.model", "cpu.flags")


def differences(old: dict[str, Any] | None, new: dict[str, Any]) -> list[str]:
    """What differs between two fingerprints where it can change bits: `key: old -> new`, in
    key order (under portable bits on both sides, the CPU's vendor, model and flags do not).
    A record without a fingerprint (written before they existed) differs as 'unrecorded'."""
    if not old:
        return ["numerics: unrecorded -> recorded"]
    a, b = flatten(old), flatten(new)
    ignore = _PORTABLE_IGNORES if a.get("bits") == b.get("bits") == "portable" else ()
    return [f"{k}: {a.get(k)} -> {b.get(k)}" for k in sorted(a.keys() | b.keys())
            if not k.startswith(ignore) and a.get(k) != b.get(k)]


def key(fp: dict[str, Any]) -> str:
    """A short digest of what can change bits (equal keys: the same numerics)."""
    flat = flatten(fp)
    if flat.get("bits") == "portable":
        flat = {k: v for k, v in flat.items() if not k.startswith(_PORTABLE_IGNORES)}
    return hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()[:12]


def main() -> None:
    """`python -m gradsync.core.numerics`: the environment of portable bits as `env` takes it
    (`-u VAR` for what it unsets, then VAR=value), for the ranks an outside launcher starts:
    `env $(python -m gradsync.core.numerics) torchrun ... trainer.bits=portable`."""
    print(" ".join([*(f"-u {k}" for k in PORTABLE_UNSETS),
                    *(f"{k}={v}" for k, v in portable_env().items())]))


if __name__ == "__main__":
    main()
