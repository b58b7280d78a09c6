"""`make gpu-check`: what gradsync does on the GPUs of this machine, in one Markdown report
(outputs/gpu-check/report.md).

0. the environment: on a machine that shows a GPU (nvidia-smi on PATH, or /dev/nvidia*), a
   CPU-only torch or a driver torch cannot use is a FAILURE with the reason; without a GPU the
   check says so and exits 0;
1. the tests marked `gpu` (tests/test_gpu.py: every policy on 2 ranks sharing one GPU through a
   `cuda:gloo` group and on a 1-rank nccl group, each resumed bitwise; the nccl faults; no host
   sync in the hot path);
2. the default experiment's model on nccl with every visible GPU (synthetic data: no
   scikit-learn needed), while nvidia-smi (or pynvml) shows which process holds a context on
   which GPU: each rank on its own GPU only, the launcher on none; the same job under torchrun;
3. bf16 and fp16 runs (bf16 refused where the GPU only emulates it);
4. kill -9 and resume=auto, bitwise against an uninterrupted run (trainer.deterministic=true);
5. per policy and feature (fp16, PowerSGD, local SGD, the noise scale, AdaScale, the adaptive
   schedule, find_unused_parameters, gradient_as_bucket_view=false, the gradsync engine): host
   syncs per window on one rank (torch.cuda.set_sync_debug_mode("warn") and torch's stderr; on
   the CPU, HostSyncs), each site and the count against that policy's documented ones
   (docs/gpus-and-slurm.md: any other is a FAILURE), and peak GPU memory;
6. every engine (torch_ddp, gradsync, fsdp, hsdp) with every policy and feature of 5 (those
   the config check allows), trace_sync and check_replicas, on 2 ranks: nccl, each rank on its
   own GPU, where the machine has 2 or more GPUs; both ranks on the one GPU through a
   "cuda:gloo" group where it has one; each run completes, with the loss of torch_ddp's run of
   the same policy;
7. the LM experiment's tokens/s on one GPU next to a hand-written loop of the same model and
   data, both timed between two torch.cuda.synchronize() (the ratio is the figure).

`--wheels DIR` (make gpu-check PY=python3): gradsync, Hydra, pytest and their pure-Python
dependencies are installed from that wheelhouse (make gpu-wheels) into a private directory
(pip --target, no registry) that only this check's processes see: the Python's own packages are
not touched; it needs torch and tensorboard. `--dry-run` (make gpu-check-dry): every step on the
CPU with gloo, so CI proves the script itself works before it meets a GPU.

This process never touches CUDA beyond counting the GPUs and reading their properties (no
context): every GPU computation runs in a child process.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zipfile
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "gpu-check"
RUN_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "SUBMITIT_EXECUTOR", "HYDRA_FULL_ERROR")
# What the wheelhouse (make gpu-wheels) holds and --wheels installs: never torch, numpy or
# tensorboard (the GPU machine's own).
WHEEL_REQUIREMENTS = ("gradsync", "hydra-core", "omegaconf", "antlr4-python3-runtime", "PyYAML",
                      "packaging", "pytest", "pytest-timeout", "pluggy", "iniconfig", "Pygments",
                      "exceptiongroup; python_version < '3.11'",
                      "tomli; python_version < '3.11'")


@dataclass
class Check:
    name: str
    status: str = "not run"  # pass | FAIL | skipped | not verified
    lines: list[str] = field(default_factory=list)

    def done(self, ok: bool, *lines: str) -> None:
        self.status = "pass" if ok else "FAIL"
        self.lines += lines


@dataclass
class Report:
    header: list[str]
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str) -> Check:
        self.checks.append(Check(name))
        return self.checks[-1]

    def markdown(self) -> str:
        out = ["# gradsync GPU check", "", *self.header, ""]
        if self.checks:
            out += ["| check | result |", "|---|---|"]
            out += [f"| {c.name} | {c.status} |" for c in self.checks]
            for c in self.checks:
                out += ["", f"## {c.name}: {c.status}", ""]
                # a table's rows (and the blank lines around it) go as they are
                out += [line if line.startswith("|") or not line else f"- {line}"
                        for line in c.lines] or ["- (nothing recorded)"]
        return "\n".join(out).rstrip("\n") + "\n"

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "report.md"
        path.write_text(self.markdown())
        return path

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "FAIL"]


@dataclass
class Target:
    """Where the runs go: nccl on every GPU, or (--dry-run) gloo on 2 CPU ranks."""

    dry: bool
    gpus: int  # visible GPUs (0 in a dry run)
    site: Path | None = None  # the private directory --wheels installed into

    @property
    def backend(self) -> str:
        return "gloo" if self.dry else "nccl"

    @property
    def ranks(self) -> int:
        return 2 if self.dry else self.gpus

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"


TARGET = Target(dry=False, gpus=0)


def child_env() -> dict[str, str]:
    """The environment of this check's children: not a rank of anything; gradsync, Hydra and
    pytest from the private directory (--wheels), else from this checkout's src/."""
    env = {k: v for k, v in os.environ.items()
           if k not in RUN_ENV_KEYS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    first = [str(TARGET.site)] if TARGET.site else [str(REPO / "src")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def train_cmd(run_dir: Path, *overrides: str) -> list[str]:
    extra = ["trainer.threads_per_worker=1"] if TARGET.dry else []
    return [sys.executable, "-m", "gradsync.run.main", f"hydra.run.dir={run_dir}",
            "trainer.progress_bar=false", f"trainer.backend={TARGET.backend}", *extra,
            *overrides]


def read_summary(run_dir: Path) -> dict:
    """The job's summary.json, {} if it wrote none."""
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.exists() else {}


def train(run_dir: Path, *overrides: str, timeout: float = 240) -> tuple[int, str, dict]:
    done = subprocess.run(train_cmd(run_dir, *overrides), capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=timeout)
    return done.returncode, done.stderr, read_summary(run_dir)


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


# --- 0. the environment -----------------------------------------------------------------------
def gpu_hardware() -> str | None:
    """What shows that this machine has an NVIDIA GPU, asked without CUDA."""
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    return f"{', '.join(nodes)} exist" if nodes else None


def cuda_problem() -> tuple[str, str] | None:
    """None where CUDA is usable, else ("skip" | "fail", why): a machine without a GPU skips; a
    machine that shows one fails when torch cannot use it."""
    try:
        import torch
    except ImportError as e:
        return "fail", f"torch is not importable by {sys.executable}: {e}"
    with warnings.catch_warnings(record=True) as caught:  # torch says why CUDA is unusable
        warnings.simplefilter("always")
        available = torch.cuda.is_available()  # NVML / cudaGetDeviceCount: no context
    if available:
        return None
    build = f"torch {torch.__version__} (CUDA build: {torch.version.cuda})"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    hardware = gpu_hardware()
    if hardware is None:
        return "skip", (f"CUDA absent: {build} sees no GPU, and this machine shows none "
                        "(no nvidia-smi, no /dev/nvidia*)")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return "skip", f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU from {build}"
    if torch.version.cuda is None:
        return "fail", (f"this machine has a GPU ({hardware}) but {build} at {sys.executable} "
                        "is a CPU-only build: run with a Python whose torch is a CUDA build "
                        "(make gpu-check PY=/path/to/python)")
    said = "; ".join(sorted({str(w.message).strip().splitlines()[0] for w in caught}))
    return "fail", (f"this machine has a GPU ({hardware}) but {build} cannot use it: "
                    + (said or "torch.cuda.is_available() is False (a driver older than this "
                       "CUDA build needs, or no device node)"))


# --- the private install ----------------------------------------------------------------------
def install_wheels(wheels: Path, site: Path) -> str:
    """WHEEL_REQUIREMENTS from the wheelhouse into `site` (no registry, no dependencies looked
    up elsewhere), with pip --target; a Python without pip gets the matching wheels unpacked.
    Returns how."""
    if not wheels.is_dir():
        raise RuntimeError(f"no wheelhouse at {wheels}: run `make gpu-wheels` where the registry "
                           "is reachable and bring its directory along (WHEELS=<dir>)")
    shutil.rmtree(site, ignore_errors=True)
    has_pip = subprocess.run([sys.executable, "-m", "pip", "--version"],
                             capture_output=True).returncode == 0
    if has_pip:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
             "--no-index", "--no-deps", "--find-links", str(wheels), "--target", str(site),
             "--no-warn-script-location", *WHEEL_REQUIREMENTS],
            capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"pip install --target {site} failed: {last_line(done.stderr)}")
        return f"pip install --no-index --target {site} from {wheels}"
    unpacked = unpack_wheels(wheels, site)
    return f"no pip for {sys.executable}: unpacked {len(unpacked)} wheels from {wheels} into {site}"


def unpack_wheels(wheels: Path, site: Path) -> list[str]:
    """A wheel is a zip of what goes into site-packages: the pure ones, and of each binary
    one the build for this interpreter and machine."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    machine = platform.machine()
    chosen = []
    for whl in sorted(wheels.glob("*.whl")):
        name, _, rest = whl.stem.partition("-")
        if name.lower().replace("_", "-") in ("exceptiongroup", "tomli") and \
                sys.version_info >= (3, 11):
            continue
        pure = rest.endswith("py3-none-any") or rest.endswith("py2.py3-none-any")
        if pure or (f"-{tag}-{tag}-" in f"-{rest}" and machine in rest):
            with zipfile.ZipFile(whl) as z:
                z.extractall(site)
            chosen.append(whl.name)
    return chosen


# --- 1. the tests marked gpu ------------------------------------------------------------------
def gpu_tests(check: Check) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                           "no:cacheprovider", "tests/test_gpu.py"], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=900)
    ok = done.returncode == 0 if not TARGET.dry else done.returncode in (0, 5)
    check.done(ok, f"`pytest -m gpu tests/test_gpu.py`: {last_line(done.stdout)} "
               f"(exit code {done.returncode})"
               + (" (dry run: they skip without CUDA, saying so)" if TARGET.dry else ""))
    if not ok:
        check.lines += ["```", *(done.stdout + done.stderr).strip().splitlines()[-30:], "```"]


# --- 2. the default model on every GPU, who holds a context where; torchrun -------------------
def gpu_uuids() -> list[str]:
    """torch's device index -> GPU UUID (as nvidia-smi writes it), read without a context."""
    import torch

    out = []
    for i in range(torch.cuda.device_count()):
        uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", ""))
        out.append(uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}")
    return out


def compute_apps() -> tuple[str, list[tuple[int, str]]] | None:
    """(tool, [(pid, gpu uuid)]) of every process holding a CUDA context now."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                               "--format=csv,noheader"], capture_output=True, text=True,
                              timeout=30)
        if done.returncode == 0:
            rows = [line.split(",") for line in done.stdout.strip().splitlines() if line]
            return "nvidia-smi", [(int(pid), uuid.strip()) for pid, uuid in rows]
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    try:
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        apps = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
            apps += [(p.pid, uuid) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
        return "pynvml", apps
    except Exception:
        return None


def rank_pids(run_dir: Path) -> dict[int, int]:
    pids = {}
    for log in (run_dir / "logs").glob("rank*.log"):
        for line in log.read_text().splitlines():
            if " up: " in line and "pid=" in line:
                pids[int(log.stem.removeprefix("rank"))] = int(line.rsplit("pid=", 1)[1])
    return pids


DEFAULT = ["data=synthetic", "trainer.max_epochs=2"]  # the default MLP; no scikit-learn


def default_experiment(check: Check, out: Path) -> None:
    n = TARGET.ranks
    run_dir = out / "default"
    proc = subprocess.Popen(train_cmd(run_dir, f"trainer.devices={n}", *DEFAULT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(), cwd=REPO, start_new_session=True)
    seen: set[tuple[int, str]] = set()
    tool = None
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        apps = None if TARGET.dry else compute_apps()
        if apps:
            tool = apps[0]
            seen |= set(apps[1])
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    s = read_summary(run_dir)
    ok = proc.returncode == 0 and s.get("status") == "completed"
    check.done(ok, f"`gradsync-train trainer.backend={TARGET.backend} trainer.devices={n} "
               f"{' '.join(DEFAULT)}` (MLP, accumulate N=4): exit code {proc.returncode}"
               + ("" if ok else f": {last_line(err)}"))
    if ok:
        evals = ", ".join(f"{k}={v:.4f}" for k, v in s["eval"].items())
        check.lines += [f"steps={s['optimizer_steps']} eval: {evals}",
                        f"device={s['device']}, peak GPU memory per rank (MB): "
                        f"{s['peak_gpu_mem_mb']}, threads per rank: {s['threads']}"]
    torchrun(check, out)
    if TARGET.dry:
        check.lines.append("contexts: dry run: no GPU, no context to list")
        return
    contexts(check, run_dir, proc.pid, tool, seen)


def contexts(check: Check, run_dir: Path, launcher: int, tool: str | None,
             seen: set[tuple[int, str]]) -> None:
    """Rank r's process on torch device r's GPU only; the launcher and this checker on none."""
    pids = rank_pids(run_dir)
    uuids = gpu_uuids()
    ours = set(pids.values()) | {launcher, os.getpid()}
    if tool is None:
        check.lines.append("contexts: NOT VERIFIED: neither nvidia-smi nor pynvml could list "
                           "compute processes")
        check.status = "not verified" if check.status == "pass" else check.status
        return
    if not any(pid in ours for pid, _ in seen):
        listed = sorted({p for p, _ in seen})
        check.lines.append(f"contexts: NOT VERIFIED: {tool} listed pids {listed}, none of "
                           "this job's (a container's own PID namespace?)")
        check.status = "not verified" if check.status == "pass" else check.status
        return
    bad = []
    for rank, pid in sorted(pids.items()):
        where = sorted({u for p, u in seen if p == pid})
        want = [uuids[rank]] if rank < len(uuids) and uuids[rank] else where[:1]
        if where != want:
            bad.append(f"rank {rank} (pid {pid}) on {where}, expected {want}")
    for who, pid in (("launcher", launcher), ("this checker", os.getpid())):
        where = sorted({u for p, u in seen if p == pid})
        if where:
            bad.append(f"the {who} (pid {pid}) holds a context on {where}")
    check.lines.append(f"contexts ({tool}): " + ("each rank on its own GPU only, the launcher "
                                                  "on none" if not bad else "; ".join(bad)))
    if bad:
        check.status = "FAIL"


def torchrun(check: Check, out: Path) -> None:
    """The same job as torchrun ranks (env://), the path a cluster takes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = out / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={TARGET.ranks}",
           f"--master-port={port}", *train_cmd(run_dir, *DEFAULT)[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=REPO,
                          timeout=300)
    s = read_summary(run_dir)
    ok = done.returncode == 0 and s.get("status") == "completed"
    check.lines.append(f"torchrun --nproc-per-node={TARGET.ranks}: exit code {done.returncode}"
                       + (f", world_size={s['world_size']}, steps={s['optimizer_steps']}"
                          if ok else f": {last_line(done.stderr)}"))
    if not ok:
        check.status = "FAIL"


# --- 3. bf16 and fp16 -------------------------------------------------------------------------
def precisions(check: Check, out: Path) -> None:
    n = TARGET.ranks
    native_bf16 = TARGET.dry or all(capability(i) >= (8, 0) for i in range(n))
    ok = True
    for name, extra in (("bf16", ["precision=bf16", "sync=amp_aware"]),
                        ("fp16", ["precision=fp16", "sync=amp_aware",
                                  "sync.comm_dtype=fp16"])):
        if TARGET.dry and name == "fp16":
            check.lines.append("fp16: dry run: the GradScaler runs on CUDA only")
            continue
        code, err, s = train(out / name, f"trainer.devices={n}", *DEFAULT, *extra)
        if name == "bf16" and not native_bf16:
            good = code == 2 and "is not native" in err
            check.lines.append(f"bf16: refused as the GPU only emulates it: {last_line(err)}")
        else:
            good = code == 0 and s.get("status") == "completed"
            check.lines.append(
                f"{name} ({' '.join(extra)}): " + (
                    f"final_train_loss={s['final_train_loss']:.4f}, "
                    f"skipped steps={s['amp_skipped_steps']}, "
                    f"samples/s={s['samples_per_s']:.0f}" if good else
                    f"exit code {code}: {last_line(err)}"))
        ok = ok and good
    check.done(ok)


def capability(index: int) -> tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


# --- 4. kill -9 and resume, bitwise ------------------------------------------------------------
RESUME_ARGS = ["data=synthetic", "data.num_samples=512", "model.dropout=0.1", "optimizer=adamw",
               "schedule.window_size=2", "trainer.max_steps=60",
               "trainer.checkpoint_every_steps=10", "trainer.log_every_windows=1",
               "trainer.deterministic=true", "seed=3"]


def rows(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], float(r["loss"]).hex()) for r in map(json.loads, lines)]


def kill_and_resume(check: Check, out: Path) -> None:
    import torch

    args = [f"trainer.devices={TARGET.ranks}", *RESUME_ARGS]
    code, err, _ = train(out / "uninterrupted", *args)
    if code != 0:
        check.done(False, f"uninterrupted run: exit code {code}: {last_line(err)}")
        return
    run_dir = out / "killed"
    proc = subprocess.Popen(train_cmd(run_dir, *args), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=child_env(), cwd=REPO,
                            start_new_session=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while proc.poll() is None and time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 25:
            break
        time.sleep(0.05)
    killed_at = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    code, err, s = train(run_dir, *args, "resume=auto")
    if code != 0:
        check.done(False, f"resume=auto: exit code {code}: {last_line(err)}")
        return
    a = torch.load(out / "uninterrupted" / "checkpoints" / "last.pt", weights_only=True)
    b = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    same_rows = rows(out / "uninterrupted") == rows(run_dir)
    check.done(not differ and same_rows,
               f"killed (SIGKILL to the job's process group) after {killed_at} logged steps, "
               f"resumed with resume=auto to step {s.get('optimizer_steps')}",
               f"parameters bitwise equal to the uninterrupted run: {not differ}"
               + (f" (differ: {differ})" if differ else ""),
               f"every step's loss bitwise equal: {same_rows}")


# --- 5. host syncs and peak memory per policy --------------------------------------------------
@dataclass(frozen=True)
class Costs:
    """A policy's (or feature's) documented host syncs per window of ACCUM micro-batches outside
    logging, checkpoint and check_replicas steps (docs/gpus-and-slurm.md): the count on CUDA
    (None: counted and listed, no figure documented), the part of it the CPU's counter sees
    (HostSyncs; None: not run on the CPU), and the source lines that may make them. Any other
    line, or another count, is a FAILURE."""

    label: str
    overrides: list[str]
    cuda: float | None
    cpu: float | None
    sites: tuple[str, ...] = ()
    documented: str = "0"

    def expected(self, dry: bool) -> float | None:
        return self.cpu if dry else self.cuda


PRECISION, SCALER = "gradsync/train/precision.py", "torch/amp/grad_scaler.py"
NOISE = "gradsync/train/noise_scale.py"
STDERR = "stderr (a sync in C++, no Python frame)"
ACCUM, WINDOWS, SETUP = 2, 8, 3  # PowerSGD (start step 2) starts compressing in the set-up
FP16 = ["precision=fp16"]
POLICIES: list[Costs] = [
    Costs("always", ["sync=always"], 0, 0),
    Costs("accumulate", [], 0, 0),
    Costs("amp_aware bf16 wire", ["sync=amp_aware", "sync.comm_dtype=bf16"], 0, 0),
    Costs("fp16", FP16, 2, 2, (PRECISION, SCALER),
          "2 (the GradScaler's inf/nan flags: precision.py's read and scaler.step's)"),
    Costs("amp_aware fp16 wire", [*FP16, "sync=amp_aware", "sync.comm_dtype=fp16"], ACCUM + 1,
          ACCUM + 1, (PRECISION, SCALER),
          f"{ACCUM + 1} (fp16's 2, and one per no_sync backward)"),
    Costs("PowerSGD", ["sync.compression=powersgd", "sync.powersgd_start_backwards=2"], 1, 0,
          ("ddp_comm_hooks/powerSGD_hook.py",),
          "1 (torch's hook synchronizes the device: CUDA only)"),
    Costs("local SGD (every 2)", ["sync=local_sgd", "sync.every=2"], 0.5, 0.5,
          ("gradsync/sync/averaging.py",), "1/2 (the drift: one per averaging)"),
    Costs("DiLoCo (every 2)", ["sync=diloco", "sync.every=2"], 0.5, 0.5,
          ("gradsync/sync/averaging.py",), "1/2 (the drift: one per averaging)"),
    Costs("mixed-wire groups", ["sync.groups=[{params: '*.bias', comm_dtype: bf16}]"], 0, 0),
    Costs("every-2 groups", ["sync.groups=[{params: '0.*', every: 2}]"], 0, 0),
    Costs("noise scale", ["noise_scale.enabled=true"], 0, 0, (),
          "0 (its numbers ride on a log step's read)"),
    Costs("AdaScale", ["lr_scaling=adascale"], 1, 1, (NOISE,),
          "1 (the noise scale's flush, every window)"),
    Costs("adaptive schedule (every 2)",
          ["schedule=adaptive", f"schedule.initial_window_size={ACCUM}",
           f"schedule.min_window_size={ACCUM}", f"schedule.max_window_size={ACCUM}",
           "schedule.every_steps=2"], 0.5, 0.5, (NOISE,),
          "1/2 (the noise scale's flush every `every` steps)"),
    Costs("gradient_as_bucket_view=false", ["engine.gradient_as_bucket_view=false"], 0, 0),
    Costs("find_unused_parameters", ["engine.find_unused_parameters=true"], None, 0,
          (STDERR,), "not documented (torch's C++ reducer: counted, listed)"),
    Costs("gradsync engine", ["engine=gradsync"], 0, 0),
    Costs("gradsync engine, find_unused_parameters",
          ["engine=gradsync", "engine.find_unused_parameters=true"], 1, 1,
          ("gradsync/engines/gradsync_ddp.py",),
          "1 (which parameters some rank used: one read per synchronising backward)"),
]
def with_accum(overrides: list[str]) -> list[str]:
    """`overrides`, windows of ACCUM micro-batches first unless they choose the schedule."""
    own = any(o.startswith("schedule=") for o in overrides)
    return [*([] if own else [f"schedule.window_size={ACCUM}"]), *overrides]


# what measure_policies writes on stderr before each policy: the syncs torch reports there
# (outside Python calls) are the policy's that follows
MARK = "gpu-check: host syncs of "


def stderr_syncs(stderr: str) -> Counter[str]:
    """Per policy label: the syncs torch reported on stderr while it ran (MARK lines)."""
    out: Counter[str] = Counter()
    label = None
    for line in stderr.splitlines():
        if line.startswith(MARK):
            label = line[len(MARK):]
        elif label is not None and "synchronizing CUDA operation" in line:
            out[label] += 1
    return out


def judge_costs(c: Costs, measured: dict[str, Any], dry: bool) -> list[str]:
    """What is wrong with a policy's measured host syncs: sites it is not documented to have,
    a count other than the documented one (per window, over WINDOWS windows)."""
    wrong = [f"undocumented site {s}" for s in measured["sites"]
             if not any(a in s for a in c.sites)]
    want = c.expected(dry)
    if want is not None and measured["syncs"] != round(want * WINDOWS):
        wrong.append(f"{measured['syncs']} in {WINDOWS} windows, documented "
                     f"{round(want * WINDOWS)}")
    return wrong


def policy_costs(check: Check, out: Path) -> None:
    done = subprocess.run([sys.executable, __file__, "--policy-costs", str(out / "costs.json"),
                           *(["--dry-run"] if TARGET.dry else [])], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=600)
    if done.returncode != 0:
        check.done(False, f"the policy runs failed: {last_line(done.stderr)}")
        check.lines += ["```", *done.stderr.strip().splitlines()[-20:], "```"]
        return
    costs = json.loads((out / "costs.json").read_text())
    hidden = stderr_syncs(done.stderr)
    ok = True
    how = ("counted by HostSyncs (tensor reads and pageable copies, the CPU's view of a host "
           "sync)" if TARGET.dry else "counted with torch.cuda.set_sync_debug_mode('warn') and "
           "torch's stderr")
    check.lines.append(f"{WINDOWS} windows of {ACCUM} micro-batches per policy on one rank "
                       f"({TARGET.backend}), after {SETUP} set-up windows; host syncs {how}; "
                       "each compared with the documented count and sites")
    check.lines += ["", "| policy | host syncs / window | documented | peak GPU MB | sites |",
                    "|---|---|---|---|---|"]
    for c in POLICIES:
        m = costs[c.label]
        if m is None:
            check.lines.append(f"| {c.label} | not run | {c.documented} | n/a | "
                               "(CUDA only) |")
            continue
        if hidden[c.label]:
            m["sites"][STDERR] = hidden[c.label]
            m["syncs"] += hidden[c.label]
        wrong = judge_costs(c, m, TARGET.dry)
        ok = ok and not wrong
        sites = ", ".join(f"{s} x{n}" for s, n in sorted(m["sites"].items())) or "none"
        peak = "n/a" if m["peak_mb"] is None else f"{m['peak_mb']:.1f}"
        flag = f" (WRONG: {'; '.join(wrong)})" if wrong else ""
        check.lines.append(f"| {c.label} | {m['syncs'] / WINDOWS:.2f} | {c.documented} | "
                           f"{peak} | {sites}{flag} |")
    check.status = "pass" if ok else "FAIL"


# What the CPU counts as a host sync (HostSyncs): a tensor read on the host, a blocking copy to
# the host from another device, a tensor built from host data for a device (a pageable copy: on
# CUDA each waits for the stream, as torch.cuda.set_sync_debug_mode reports)
HOST_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "cpu")
HOST_BUILDS = ("tensor", "as_tensor")
# the counter's own frames and torch's: a site is the first frame outside them (but the torch
# files that make syncs of their own, as the CUDA count names them)
NOT_A_SITE = ("bench/gpu_check.py", "torch/overrides.py", "torch/_tensor.py", "torch/utils/")


class HostSyncs:
    """Counts, by source line, what would be a host sync on CUDA where set_sync_debug_mode
    cannot (the CPU: a dry run, the tests): the tensor methods that read a tensor on the host
    or copy it there (HOST_READS; ``to`` the CPU from another device, blocking) and the torch
    functions that build a tensor from host data for an explicit device (HOST_BUILDS with
    ``device=``). They are wrapped on torch.Tensor and torch while it counts (not a torch
    function mode: a mode is off inside the autograd engine, where the backward hooks run, and
    those make host reads too). A sync that torch's C++ makes by itself, or one made only on
    CUDA (``torch.cuda.synchronize``), is not counted: CUDA's count can only be higher."""

    def __init__(self) -> None:
        self.sites: Counter[str] = Counter()
        self.saved: list[tuple[Any, str, Any]] = []

    @staticmethod
    def syncs(name: str, args: tuple, kwargs: dict) -> bool:
        import torch

        if name in HOST_BUILDS:
            return kwargs.get("device") is not None and not isinstance(args[0], torch.Tensor)
        if name == "to":
            target = kwargs.get("device", next((a for a in args[1:] if isinstance(
                a, (str, torch.device))), None))
            return (target is not None and not kwargs.get("non_blocking", False)
                    and torch.device(target).type == "cpu" and args[0].device.type != "cpu")
        return True

    @staticmethod
    def site() -> str:
        frame = sys._getframe(2)
        while frame.f_back is not None and any(
                n in frame.f_code.co_filename.replace(os.sep, "/") for n in NOT_A_SITE):
            frame = frame.f_back
        where = "/".join(frame.f_code.co_filename.replace(os.sep, "/").split("/")[-3:])
        return f"{where}:{frame.f_lineno}"

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        self.saved.append((owner, name, owner.__dict__.get(name)))

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.syncs(name, args, kwargs):
                self.sites[self.site()] += 1
            return original(*args, **kwargs)

        setattr(owner, name, counted)

    def __enter__(self) -> HostSyncs:
        import torch

        for name in (*HOST_READS, "to"):
            self._wrap(torch.Tensor, name)
        for name in HOST_BUILDS:
            self._wrap(torch, name)
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, before in reversed(self.saved):
            if before is None:
                delattr(owner, name)
            else:
                setattr(owner, name, before)
        self.saved = []


def measure_policies(path: Path) -> None:
    """Child process: each policy on a 1-rank group (nccl on cuda:0; gloo on the CPU in a dry
    run), counting host syncs (measure_policy); None for one the target cannot run."""
    import torch
    import torch.distributed as dist

    cuda = not TARGET.dry
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    results = {}
    for c in POLICIES:
        sys.stderr.flush()
        os.write(2, f"{MARK}{c.label}\n".encode())
        results[c.label] = (None if TARGET.dry and c.cpu is None
                            else measure_policy(c.overrides, device))
    sys.stderr.flush()
    dist.destroy_process_group()
    path.write_text(json.dumps(results))


def measure_policy(overrides: list[str], device: Any) -> dict[str, Any]:
    """SETUP set-up windows, then WINDOWS windows as train() runs them between two log steps
    (run_window, optimizer_step, the averager's after_window), under set_sync_debug_mode("warn"):
    the host syncs, by source line, and the peak of allocated GPU memory."""
    import torch

    from gradsync.config.schema import RunConfig
    from gradsync.run.main import compose_plain
    from gradsync.run.placement import Placement
    from gradsync.run.preflight import preflight
    from gradsync.run.worker import build_parts
    from gradsync.sync.averaging import Averager
    from gradsync.train.loop import Progress, average, before_step, optimizer_step, run_window
    from gradsync.train.windows import windows

    cuda = device.type == "cuda"
    cfg = compose_plain([f"trainer.backend={TARGET.backend}", "trainer.devices=1",
                         "data=synthetic", "data.num_samples=2048", *with_accum(overrides)])
    preflight(cfg, Placement(TARGET.backend, 1))
    p = build_parts(RunConfig.from_plain(cfg), 0, 1, device)
    epoch = windows(p.loader, 0, ACCUM, device=p.device)
    averager = p.policy.averager or Averager()
    averager.start(p.engine.module, 0)

    def window(k: int) -> None:  # train()'s window (train/loop.py), but its logging
        cut = next(epoch)  # the epoch's k-th
        run_window(p.engine, cut, p.policy, p.loss, p.normalizer, p.precision, p.noise, p.call)
        before_step(p, Progress(windows=k), cut)
        stepped, _ = optimizer_step(p.engine, p.optimizer, p.policy, p.normalizer,
                                    precision=p.precision, lr_scheduler=p.lr_scheduler,
                                    clip_grad_norm=p.trainer.clip_grad_norm)
        if stepped:
            p.schedule.after_step(k + 1, p.noise)
        average(averager, p.engine.module, k + 1, False)

    for k in range(SETUP):
        window(k)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    sites: Counter[str] = Counter()
    with warnings.catch_warnings(record=True) as caught, \
            nullcontext() if cuda else HostSyncs() as counter:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for k in range(SETUP, SETUP + WINDOWS):
                window(k)
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    if counter is not None:
        sites = counter.sites
    for w in caught:
        if "synchroniz" in str(w.message):
            where = "/".join(str(w.filename).replace(os.sep, "/").split("/")[-3:])
            sites[f"{where}:{w.lineno}"] += 1
    return {"syncs": sum(sites.values()), "sites": dict(sites),
            "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None}


# --- 6. every engine and policy on 2 ranks ----------------------------------------------------
# 2 ranks: nccl, each on its own GPU, where the machine has 2 or more; where it has one, both
# ranks on cuda:0 through a default group made as "cuda:gloo" (like nccl it serves CUDA tensors
# only; nccl refuses 2 ranks on one GPU); gloo on the CPU in a dry run. Every policy and feature
# of the host-sync table (the engine rows: on every engine) on every engine, through the
# worker's real run_training: 128 samples, micro-batches of 8, N = 2: 4 windows per rank;
# PowerSGD compresses from step 2, local SGD / DiLoCo average every 2 steps, a checkpoint and a
# log at every second step, the trace on.
ENGINES = ("torch_ddp", "gradsync", "fsdp", "hsdp")
ENGINE_ARGS = {"hsdp": ["engine.replicas=2"]}  # a replicate dimension of 2: mesh (2, 1)
MATRIX_BASE = ["data=synthetic", "data.num_samples=128", "data.eval_samples=16",
               "schedule.micro_batch_size=8", "model.hidden_sizes=[32]", "trainer.max_epochs=1",
               "trainer.log_every_windows=2",
               "trainer.checkpoint_every_steps=2", "trainer.progress_bar=false"]
MATRIX_EXTRA = [("trace_sync", ["engine.trace_sync=true"]),
                ("check_replicas", ["trainer.check_replicas=1"]),
                ("local SGD (every 2), check_replicas",
                 ["sync=local_sgd", "sync.every=2", "trainer.check_replicas=1"])]
# the same policy on another engine: the same training, up to float rounding (relative)
ENGINE_LOSS_RTOL = 1e-3


def matrix_cases() -> list[tuple[str, str, list[str]]]:
    """(engine, policy label, overrides): each policy or feature of POLICIES not tied to an
    engine, and MATRIX_EXTRA, on each engine."""
    rows = [(c.label, c.overrides) for c in POLICIES
            if not any(o.startswith("engine=") for o in c.overrides)] + MATRIX_EXTRA
    return [(e, label, ["engine=" + e, *ENGINE_ARGS.get(e, []), *overrides])
            for e in ENGINES for label, overrides in rows if has_settings(e, overrides)]


def has_settings(engine: str, overrides: list[str]) -> bool:
    """Whether `engine` has every ``engine.<key>`` the overrides set: each engine owns its
    settings (gradient_as_bucket_view is DDP's), another engine's is an unknown key."""
    from dataclasses import fields

    from gradsync.engines import ENGINES as REGISTERED

    keys = {f.name for f in fields(REGISTERED[engine].settings)}
    return all(o.partition("=")[0].removeprefix("engine.") in keys
               for o in overrides if o.startswith("engine."))


def matrix_placement(rank: int, gpus: int, dry: bool) -> tuple[str, Any]:
    """(the default group's backend, the rank's Placement as the worker reads it): one of 2
    torchrun ranks on its own GPU (cuda:LOCAL_RANK of 2) where there are 2 or more, else alone
    on its node's one GPU (local rank 0 of 1: cuda:0, the two share it, on cuda:gloo); the CPU
    on gloo in a dry run."""
    from gradsync.run.placement import Placement

    if dry:
        return "gloo", Placement("gloo", 2, "torchrun", rank, rank, 2)
    if gpus >= 2:
        return "nccl", Placement("nccl", 2, "torchrun", rank, rank, 2)
    return "cuda:gloo", Placement("nccl", 2, "torchrun", rank, 0, 1)


def matrix_rank(rank: int, port: int, path: str, dry: bool, gpus: int, out: str) -> None:
    """One of the 2 ranks (torch.multiprocessing.spawn): every case of matrix_cases on the
    default group; rank 0 writes {case: result} and each rank's device to `path`."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gradsync.components import ConfigError
    from gradsync.run.main import compose_plain
    from gradsync.run.placement import Placement
    from gradsync.run.preflight import preflight
    from gradsync.run.worker import run_training

    TARGET.dry = dry
    group, placement = matrix_placement(rank, gpus, dry)
    backend = placement.backend
    device = placement.device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group(group, store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    results: dict[str, Any] = {}
    for engine, label, overrides in matrix_cases():
        name = f"{engine} / {label}"
        plain = compose_plain([f"trainer.backend={backend}", "trainer.devices=2",
                               *(["trainer.threads_per_worker=1"] if dry else []),
                               *MATRIX_BASE, *with_accum(overrides)])
        try:
            cfg = preflight(plain, Placement(backend, 2))
        except ConfigError as e:
            results[name] = {"refused": str(e).splitlines()[0]}
            continue
        started = time.monotonic()
        try:
            s = run_training(cfg, Path(out) / engine / label.replace(" ", "_"), placement)
        except Exception as e:  # the group may be stuck: the rest is not run
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
            break
        results[name] = {"status": s["status"], "loss": s["final_train_loss"],
                         "steps": s["optimizer_steps"], "s": time.monotonic() - started}
    devices = [None, None]
    dist.all_gather_object(devices, str(device))
    if rank == 0:
        Path(path).write_text(json.dumps({"results": results, "devices": devices,
                                          "group": group}))
    dist.destroy_process_group()


def measure_matrix(path: Path, out: Path) -> None:
    """Child process: the 2 ranks of matrix_rank."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    gpus = 0 if TARGET.dry else torch.cuda.device_count()
    mp.spawn(matrix_rank, args=(port, str(path), TARGET.dry, gpus, str(out)), nprocs=2)


def engine_matrix(check: Check, out: Path) -> None:
    shutil.rmtree(out / "matrix", ignore_errors=True)
    done = subprocess.run([sys.executable, __file__, "--matrix", str(out / "matrix.json"),
                           *(["--dry-run"] if TARGET.dry else [])], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=600)
    if done.returncode != 0 or not (out / "matrix.json").exists():
        check.done(False, f"the 2-rank runs failed: {last_line(done.stderr)}")
        check.lines += ["```", *done.stderr.strip().splitlines()[-20:], "```"]
        return
    got = json.loads((out / "matrix.json").read_text())
    results, devices = got["results"], got["devices"]
    shared = got["group"] == "cuda:gloo"
    placed = devices == (["cuda:0", "cuda:0"] if shared else
                         ["cpu", "cpu"] if TARGET.dry else ["cuda:0", "cuda:1"])
    check.lines.append(f"2 ranks, default group {got['group']}, ranks on {devices}"
                       + (" (one GPU: the two share it)" if shared else "")
                       + ("" if placed else ": NOT the placement stated"))
    check.lines += ["", "| engine / policy | result |", "|---|---|"]
    ok = placed
    for engine, label, _ in matrix_cases():
        name = f"{engine} / {label}"
        r = results.get(name)
        if r is None:
            ok, text = False, "not run (an earlier case failed)"
        elif "refused" in r:
            text = f"refused by the config check: {r['refused']}"
        elif "error" in r:
            ok, text = False, f"FAILED: {r['error']}"
        else:
            ref = results.get(f"{ENGINES[0]} / {label}", {}).get("loss", r["loss"])
            same = abs(r["loss"] - ref) <= ENGINE_LOSS_RTOL * abs(ref)
            good = r["status"] == "completed" and r["loss"] == r["loss"] and same
            ok = ok and good
            text = f"{r['status']}, {r['steps']} steps, loss {r['loss']:.6f} ({r['s']:.1f} s)"
            if not good:
                text += " FAILED" + ("" if same else f": {ENGINES[0]}'s loss is {ref:.6f}")
        check.lines.append(f"| {name} | {text} |")
    ran = sum("status" in r for r in results.values())
    check.lines.insert(1, f"{ran} runs, {sum('refused' in r for r in results.values())} "
                          "combinations refused by the config check")
    check.status = "pass" if ok else "FAIL"


# --- 7. LM tokens/s next to a hand-written loop ------------------------------------------------
LM = ["experiment=lm_accum_sweep", "trainer.eval_every_steps=0"]
LM_DRY = ["data.num_samples=128"]  # the CPU: a taste, not a measurement


def lm_overrides() -> list[str]:
    return [*LM, *(LM_DRY if TARGET.dry else [])]


def lm_parts(device: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The LM experiment's data, model and optimizer, built from its config as gradsync builds
    them (same seed: the same model init)."""
    import torch

    from gradsync.components import build
    from gradsync.core.seeds import seed_everything
    from gradsync.run.main import compose_plain
    from gradsync.train.weight_decay import build_optimizer

    cfg = compose_plain(lm_overrides())
    seed_everything(cfg["seed"])
    data = build(cfg["data"], {"seed": cfg["seed"]})
    model = build(cfg["model"], data.sizes).to(torch.device(device))
    return data, model, build_optimizer(cfg["optimizer"], model, model.parameters()), cfg


def synchronize() -> None:
    import torch

    if not TARGET.dry:
        torch.cuda.synchronize()


def handwritten_lm(epochs: int) -> dict[str, Any]:
    """The LM experiment's model, data, optimizer and window (global batch 64 = 8 micro-batches
    of 8) on one GPU, written by hand: no DDP, no policies, no logging."""
    import torch

    device = torch.device(TARGET.device, 0) if not TARGET.dry else torch.device("cpu")
    data, model, opt, cfg = lm_parts(device)
    micro = cfg["schedule"]["micro_batch_size"]
    accum = cfg["schedule"]["global_batch_size"] // micro
    loader = torch.utils.data.DataLoader(data.train, batch_size=micro, shuffle=True,
                                         collate_fn=data.collate, pin_memory=not TARGET.dry)
    synchronize()
    start = time.perf_counter()
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sums, counts = data.loss(model(x), y)
            (sums.sum() / (counts.sum() * accum)).backward()  # tensors: no wait for the GPU
            if (i + 1) % accum == 0 or i + 1 == len(loader):
                opt.step()
                opt.zero_grad(set_to_none=True)
    synchronize()
    elapsed = time.perf_counter() - start
    targets = epochs * data.tokens_per_sample * len(data.train)
    return {"tokens_per_s": targets / elapsed, "seconds": elapsed}


def gradsync_lm(epochs: int) -> dict[str, Any]:
    """gradsync's loop (train(): windows, policy, logging steps) on the same model, data and
    window on a 1-rank group, timed like the hand-written one: between two synchronizes
    (train_s in summary.json is host time: a GPU still busy at its end falls outside)."""
    import tempfile

    import torch
    import torch.distributed as dist

    from gradsync.config.schema import RunConfig
    from gradsync.run.main import compose_plain
    from gradsync.run.worker import build_parts
    from gradsync.train.loop import Progress
    from gradsync.train.loop import train as train_loop
    from gradsync.train.metrics import RunLog

    device = torch.device("cpu") if TARGET.dry else torch.device("cuda", 0)
    if not TARGET.dry:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group(TARGET.backend, store=store, rank=0, world_size=1)
    cfg = compose_plain([*lm_overrides(), f"trainer.max_epochs={epochs}", "trainer.devices=1",
                         f"trainer.backend={TARGET.backend}"])
    p = build_parts(RunConfig.from_plain(cfg), 0, 1, device)
    p.evaluate = dict  # the final evaluation is not training
    with tempfile.TemporaryDirectory() as tmp:
        log = RunLog(Path(tmp), active=False)
        synchronize()
        start = time.perf_counter()
        state = train_loop(p, Progress(), log)
        synchronize()
        elapsed = time.perf_counter() - start
    data = p.sampler.dataset
    tokens = epochs * cfg_tokens(p) * len(data)  # type: ignore[arg-type]
    dist.destroy_process_group()
    return {"tokens_per_s": tokens / elapsed, "seconds": elapsed, "steps": state.step}


def cfg_tokens(p: Any) -> float:
    """Target tokens per sample of the LM data (the normaliser knows them)."""
    return float(p.normalizer.tokens_per_sample)


def lm_throughput(check: Check, epochs: int) -> None:
    out = {}
    for side in ("gradsync", "handwritten"):
        done = subprocess.run([sys.executable, __file__, f"--{side}-lm", str(epochs),
                               *(["--dry-run"] if TARGET.dry else [])], capture_output=True,
                              text=True, env=child_env(), cwd=REPO, timeout=600)
        if done.returncode != 0:
            check.done(False, f"{side} loop failed: {last_line(done.stderr)}")
            return
        out[side] = json.loads(done.stdout.strip().splitlines()[-1])
    ours, hand = out["gradsync"]["tokens_per_s"], out["handwritten"]["tokens_per_s"]
    check.done(True, f"gradsync's loop (experiment=lm_accum_sweep, 1 "
               f"{'CPU rank' if TARGET.dry else 'GPU'}, {epochs} epochs, "
               f"{out['gradsync']['steps']} steps): {ours:,.0f} target tokens/s "
               f"({out['gradsync']['seconds']:.1f} s)",
               f"hand-written loop, same model/data/optimizer/window: {hand:,.0f} target "
               f"tokens/s ({out['handwritten']['seconds']:.1f} s)",
               f"ratio gradsync / hand-written: {ours / hand:.2f}; both timed between two "
               "torch.cuda.synchronize()" + (" (dry run: CPU, a taste)" if TARGET.dry else ""))


LM_EPOCHS = 2


def header(how: str) -> list[str]:
    import torch

    import gradsync

    lines = [f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, host {platform.node()}",
             f"- python {platform.python_version()} ({sys.executable}), torch {torch.__version__}"
             f", CUDA {torch.version.cuda}",
             f"- gradsync from {Path(gradsync.__file__).parent}; {how}"]
    if TARGET.dry:
        lines.append("- DRY RUN: every step on the CPU with gloo (2 ranks); no GPU was used")
    else:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"- cuda:{i}: {p.name}, compute capability {p.major}.{p.minor}, "
                         f"{p.total_memory / 2**30:.0f} GiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="where report.md and the runs go "
                    "(default outputs/gpu-check, or outputs/gpu-check-dry)")
    ap.add_argument("--wheels", type=Path, help="install gradsync, Hydra and pytest from this "
                    "wheelhouse into a private directory first (make gpu-wheels)")
    ap.add_argument("--dry-run", action="store_true",
                    help="every step on the CPU with gloo (CI: the script itself works)")
    ap.add_argument("--handwritten-lm", type=int, metavar="EPOCHS", help=argparse.SUPPRESS)
    ap.add_argument("--gradsync-lm", type=int, metavar="EPOCHS", help=argparse.SUPPRESS)
    ap.add_argument("--policy-costs", type=Path, metavar="JSON", help=argparse.SUPPRESS)
    ap.add_argument("--matrix", type=Path, metavar="JSON", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    TARGET.dry = args.dry_run
    for flag, fn in ((args.handwritten_lm, handwritten_lm), (args.gradsync_lm, gradsync_lm)):
        if flag:
            print(json.dumps(fn(flag)))
            return 0
    if args.policy_costs:
        measure_policies(args.policy_costs)
        return 0
    if args.matrix:
        measure_matrix(args.matrix, args.matrix.with_suffix(""))
        return 0
    out: Path = args.out or OUT.with_name("gpu-check-dry" if TARGET.dry else "gpu-check")
    problem = None if TARGET.dry else cuda_problem()
    if problem is not None:
        kind, why = problem
        word = "skipped" if kind == "skip" else "FAILED"
        Report([f"- {word}: {why}; nothing was run."]).write(out)
        print(f"gpu-check: {word}: {why} (report: {out / 'report.md'})")
        return 0 if kind == "skip" else 1
    how = "gradsync from this checkout's src/"
    if args.wheels:
        site = out / "site"
        try:
            how = install_wheels(args.wheels.resolve(), site)
        except RuntimeError as e:
            Report([f"- FAILED: {e}; nothing was run."]).write(out)
            print(f"gpu-check: FAILED: {e}")
            return 1
        TARGET.site = site
        sys.path.insert(0, str(site))
    for stale in ("default", "torchrun", "bf16", "fp16", "uninterrupted", "killed"):
        shutil.rmtree(out / stale, ignore_errors=True)  # a run dir is never resumed by accident
    if not TARGET.dry:
        import torch

        TARGET.gpus = torch.cuda.device_count()
    report = Report(header(how))
    steps = [("tests marked gpu", gpu_tests),
             (f"default model on {TARGET.backend}, {TARGET.ranks} rank(s), torchrun, contexts",
              lambda c: default_experiment(c, out)),
             ("bf16 and fp16", lambda c: precisions(c, out)),
             ("kill -9 and resume, bitwise", lambda c: kill_and_resume(c, out)),
             ("host syncs and peak GPU memory per policy", lambda c: policy_costs(c, out)),
             ("every engine and policy on 2 ranks", lambda c: engine_matrix(c, out)),
             ("LM tokens/s vs a hand-written loop",
              lambda c: lm_throughput(c, 1 if TARGET.dry else LM_EPOCHS))]
    started_all = time.monotonic()
    for name, step in steps:
        check = report.add(name)
        started = time.monotonic()
        try:
            step(check)
        except Exception as e:  # one broken check does not hide the others
            check.done(False, f"{type(e).__name__}: {e}")
        check.lines.append(f"({time.monotonic() - started:.0f} s)")
        report.write(out)  # as it goes: a check that hangs leaves the others on record
        print(f"gpu-check: {name}: {check.status}", flush=True)
    report.header.append(f"- the whole check: {time.monotonic() - started_all:.0f} s")
    path = report.write(out)
    print(f"gpu-check: report in {path}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
