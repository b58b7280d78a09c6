"""`make gpu-check`: what gradsync does on the GPUs of this machine, in one Markdown report
(outputs/gpu-check/report.md). Exits 0 after saying why where CUDA is absent.

1. the tests marked `gpu` (tests/test_gpu.py: no host sync in the hot path under
   torch.cuda.set_sync_debug_mode("error"), PowerSGD and the CUDA generator, CPU-only
   checkpoints, device errors);
2. the default experiment on nccl with every visible GPU, while nvidia-smi (or pynvml) shows
   which process holds a context on which GPU: each rank on its own GPU only, the launcher
   on none;
3. bf16 and fp16 runs (bf16 refused where the GPU only emulates it);
4. kill -9 and resume=auto, bitwise against an uninterrupted run (trainer.deterministic=true);
5. the LM experiment's tokens/s on one GPU next to a hand-written loop of the same model and
   data (the ratio is the figure).

This process never touches CUDA beyond counting the GPUs and reading their properties (no
context): every GPU computation runs in a child process. Runs with the Python it is started
with (`make gpu-check PY=python3`), with gradsync from this checkout's src/ on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "outputs" / "gpu-check"
RUN_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "SUBMITIT_EXECUTOR", "HYDRA_FULL_ERROR")


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
                out += [f"- {line}" for line in c.lines] or ["- (nothing recorded)"]
        return "\n".join(out).rstrip("\n") + "\n"

    def write(self, out_dir: Path) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "report.md"
        path.write_text(self.markdown())
        return path

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status == "FAIL"]


def child_env() -> dict[str, str]:
    """The environment of gradsync-train children: gradsync from this checkout, not a rank."""
    env = {k: v for k, v in os.environ.items()
           if k not in RUN_ENV_KEYS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def train_cmd(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "gradsync.run.main", f"hydra.run.dir={run_dir}",
            "trainer.progress_bar=false", "trainer.backend=nccl", *overrides]


def train(run_dir: Path, *overrides: str, timeout: float = 240) -> tuple[int, str, dict]:
    done = subprocess.run(train_cmd(run_dir, *overrides), capture_output=True, text=True,
                          env=child_env(), cwd=REPO, timeout=timeout)
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return done.returncode, done.stderr, summary


def last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return f"torch is not importable by {sys.executable}"
    if not torch.cuda.is_available():
        return (f"CUDA absent: torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                "sees no GPU")
    return None


# --- 1. the tests marked gpu ------------------------------------------------------------------
def gpu_tests(check: Check) -> None:
    try:
        import pytest  # noqa: F401
    except ImportError:
        check.status = "skipped"
        check.lines.append(f"pytest is not installed for {sys.executable}: "
                           "`pip install pytest pytest-timeout` to run tests/test_gpu.py")
        return
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p",
                           "no:cacheprovider", "tests/test_gpu.py"], capture_output=True,
                          text=True, env=child_env(), cwd=REPO, timeout=600)
    check.done(done.returncode == 0, f"`pytest -m gpu tests/test_gpu.py`: "
               f"{last_line(done.stdout)} (exit code {done.returncode})")
    if done.returncode != 0:
        check.lines += ["```", *done.stdout.strip().splitlines()[-30:], "```"]


# --- 2. the default experiment and who holds a context where -----------------------------------
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


def default_experiment(check: Check, n: int, out: Path) -> None:
    run_dir = out / "default"
    proc = subprocess.Popen(train_cmd(run_dir, f"trainer.devices={n}"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO,
                            start_new_session=True)
    seen: set[tuple[int, str]] = set()
    tool = None
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        apps = compute_apps()
        if apps:
            tool = apps[0]
            seen |= set(apps[1])
        time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    summary_path = run_dir / "summary.json"
    s = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    ok = proc.returncode == 0 and s.get("status") == "completed"
    check.done(ok, f"`gradsync-train trainer.backend=nccl trainer.devices={n}` (digits, MLP, "
               f"accumulate N=4): exit code {proc.returncode}"
               + ("" if ok else f": {last_line(err)}"))
    if ok:
        evals = ", ".join(f"{k}={v:.4f}" for k, v in s["eval"].items())
        check.lines += [f"steps={s['optimizer_steps']} eval: {evals}",
                        f"samples/s={s['samples_per_s']:.0f}, train_s={s['train_s']:.1f}, "
                        f"wall_s={s.get('wall_s', 0):.1f}, device={s['device']}",
                        f"peak GPU memory per rank (MB): {s['peak_gpu_mem_mb']}",
                        f"threads per rank: {s['threads']}"]
    # contexts: rank r's process on torch device r's GPU only; the launcher on none
    pids = rank_pids(run_dir)
    uuids = gpu_uuids()
    ours = set(pids.values()) | {proc.pid, os.getpid()}
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
    for who, pid in (("launcher", proc.pid), ("this checker", os.getpid())):
        where = sorted({u for p, u in seen if p == pid})
        if where:
            bad.append(f"the {who} (pid {pid}) holds a context on {where}")
    check.lines.append(f"contexts ({tool}): " + ("each rank on its own GPU only, the launcher "
                                                  "on none" if not bad else "; ".join(bad)))
    if bad:
        check.status = "FAIL"


# --- 3. bf16 and fp16 -------------------------------------------------------------------------
def precisions(check: Check, n: int, out: Path) -> None:
    import torch

    native_bf16 = all(torch.cuda.get_device_capability(i) >= (8, 0) for i in range(n))
    ok = True
    for name, extra in (("bf16", ["precision=bf16", "sync=amp_aware"]),
                        ("fp16", ["precision=fp16", "sync=amp_aware",
                                  "sync.comm_dtype=fp16"])):
        code, err, s = train(out / name, f"trainer.devices={n}", "trainer.max_epochs=5", *extra)
        if name == "bf16" and not native_bf16:
            good = code == 2 and "is not native" in err
            check.lines.append(f"bf16: refused as the GPU only emulates it: {last_line(err)}")
        else:
            good = code == 0 and s.get("status") == "completed"
            check.lines.append(
                f"{name} ({' '.join(extra)}): " + (
                    f"final_train_loss={s['final_train_loss']:.4f}, "
                    f"eval_accuracy={s['eval'].get('accuracy', float('nan')):.4f}, "
                    f"skipped steps={s['amp_skipped_steps']}, "
                    f"samples/s={s['samples_per_s']:.0f}" if good else
                    f"exit code {code}: {last_line(err)}"))
        ok = ok and good
    check.done(ok)


# --- 4. kill -9 and resume, bitwise ------------------------------------------------------------
RESUME_ARGS = ["data=synthetic", "data.num_samples=512", "model.dropout=0.1", "optimizer=adamw",
               "schedule.accum_steps=2", "trainer.max_steps=60", "trainer.checkpoint_every=10",
               "trainer.log_every=1", "trainer.deterministic=true", "seed=3"]


def rows(run_dir: Path) -> list[tuple]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], float(r["loss"]).hex()) for r in map(json.loads, lines)]


def kill_and_resume(check: Check, n: int, out: Path) -> None:
    import torch

    args = [f"trainer.devices={n}", *RESUME_ARGS]
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


# --- 5. LM tokens/s next to a hand-written loop ------------------------------------------------
LM = ["experiment=lm_accum_sweep", "trainer.eval_every=0", "trainer.max_epochs=4"]


def lm_parts(device: Any) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The LM experiment's data, model and optimizer, built from its config as gradsync builds
    them (same seed: the same model init)."""
    import torch

    from gradsync.components import build
    from gradsync.run.main import compose_plain
    from gradsync.train.repro import seed_everything

    cfg = compose_plain(LM)
    seed_everything(cfg["seed"])
    data = build(cfg["data"], {"seed": cfg["seed"]}, extra=("micro_batch_size",))
    model = build(cfg["model"], data.sizes).to(torch.device(device))
    return data, model, build(cfg["optimizer"])(model.parameters()), cfg


def handwritten_lm(epochs: int) -> dict[str, Any]:
    """The LM experiment's model, data, optimizer and window (global batch 64 = 8 micro-batches
    of 8) on one GPU, written by hand: no DDP, no policies, no logging."""
    import torch

    device = torch.device("cuda", 0)
    data, model, opt, cfg = lm_parts(device)
    micro = cfg["data"]["micro_batch_size"]
    accum = cfg["schedule"]["global_batch_size"] // micro
    loader = torch.utils.data.DataLoader(data.train, batch_size=micro, shuffle=True,
                                         collate_fn=data.collate, pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sums, counts = data.loss(model(x), y)
            (sums.sum() / (counts.sum() * accum)).backward()  # tensors: no wait for the GPU
            if (i + 1) % accum == 0 or i + 1 == len(loader):
                opt.step()
                opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    targets = epochs * data.tokens_per_sample * len(data.train)
    return {"tokens_per_s": targets / elapsed, "seconds": elapsed}


def lm_throughput(check: Check, out: Path) -> None:
    code, err, s = train(out / "lm", "trainer.devices=1", *LM)
    if code != 0:
        check.done(False, f"gradsync LM run: exit code {code}: {last_line(err)}")
        return
    data, _, _, _ = lm_parts("cpu")
    ours = s["samples_per_s"] * data.tokens_per_sample
    done = subprocess.run([sys.executable, __file__, "--handwritten-lm", str(LM_EPOCHS)],
                          capture_output=True, text=True, env=child_env(), cwd=REPO,
                          timeout=300)
    if done.returncode != 0:
        check.done(False, f"hand-written loop failed: {last_line(done.stderr)}")
        return
    hand = json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]
    check.done(True, f"gradsync (experiment=lm_accum_sweep, 1 GPU, {LM_EPOCHS} epochs): "
               f"{ours:,.0f} target tokens/s",
               f"hand-written single-GPU loop, same model/data/optimizer/window: "
               f"{hand:,.0f} target tokens/s",
               f"ratio gradsync / hand-written: {ours / hand:.2f}")


LM_EPOCHS = 4


def header() -> list[str]:
    import torch

    lines = [f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, host {platform.node()}",
             f"- python {platform.python_version()} ({sys.executable}), torch {torch.__version__}"
             f", CUDA {torch.version.cuda}"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"- cuda:{i}: {p.name}, compute capability {p.major}.{p.minor}, "
                         f"{p.total_memory / 2**30:.0f} GiB")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT, help="where report.md and the runs go")
    ap.add_argument("--handwritten-lm", type=int, metavar="EPOCHS", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.handwritten_lm:
        print(json.dumps(handwritten_lm(args.handwritten_lm)))
        return 0
    why = skip_reason()
    if why is not None:
        report = Report([f"- skipped: {why}; nothing was run."])
        path = report.write(args.out)
        print(f"gpu-check: skipped: {why} (report: {path})")
        return 0
    import torch

    n = torch.cuda.device_count()
    report = Report(header())
    steps = [("tests marked gpu", lambda c: gpu_tests(c)),
             (f"default experiment on nccl, {n} GPU(s), contexts",
              lambda c: default_experiment(c, n, args.out)),
             ("bf16 and fp16", lambda c: precisions(c, n, args.out)),
             ("kill -9 and resume, bitwise", lambda c: kill_and_resume(c, n, args.out)),
             ("LM tokens/s vs a hand-written loop", lambda c: lm_throughput(c, args.out))]
    for name, step in steps:
        check = report.add(name)
        started = time.monotonic()
        try:
            step(check)
        except Exception as e:  # one broken check does not hide the others
            check.done(False, f"{type(e).__name__}: {e}")
        check.lines.append(f"({time.monotonic() - started:.0f} s)")
        report.write(args.out)  # as it goes: a check that hangs leaves the others on record
        print(f"gpu-check: {name}: {check.status}", flush=True)
    path = report.write(args.out)
    print(f"gpu-check: report in {path}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
