"""One harness for "a stopped run, resumed, ends bit for bit where the uninterrupted run ends".

A case is a config (`Run`: its overrides and how its uninterrupted reference is recorded on the
pool's ranks) and a way to stop it part-way (a function returning the `Start` to resume from):
a checkpoint of the reference resumed in a fresh dir, a run dir left by a kill between a
checkpoint and its rows, rank 0's dir alone, a real command-line job killed by SIGKILL at a
checkpoint, a job's whole life of SIGTERM, Ctrl-C and kill -9 with a corrupt checkpoint, a SLURM
job preempted by SIGUSR1 and requeued. Every case then ends the same way (`check`): its rows of
metrics.jsonl (every window once, the same bits), its parameters (bitwise), its summary's
counters, against the reference.

References are trained once per session (`References`, the `references` fixture) and shared by
every test whose config coincides."""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import dist_cases
from cli_jobs import Job, fake_scontrol
from configs import SAME, losses, plain_cfg
from gradsync.train import checkpoint


@dataclass(frozen=True)
class Run:
    """A config and its uninterrupted reference: `record(cfg, run_dir, *record_args)` on every
    rank of the pool (dist_cases.train_run_rows or a recording variant of it)."""

    args: tuple[str, ...]
    windows_per_epoch: int
    keys: tuple[str, ...] = SAME  # the summary's entries a resumed run must reproduce
    record: Callable[..., dict] = dist_cases.train_run_rows
    record_args: tuple = ()
    check_reference: Callable[[Reference], None] | None = None  # what the reference must be

    def cfg(self, *more: str) -> dict:
        return plain_cfg([*self.args, *more])


@dataclass
class Reference:
    run_dir: Path
    ranks: list[dict]  # what `record` returned on each rank

    @property
    def summary(self) -> dict:
        return self.ranks[0]["summary"]

    @property
    def rows(self) -> list[dict]:
        return self.ranks[0]["rows"]

    @property
    def params(self) -> dict[str, torch.Tensor]:
        r0 = self.ranks[0]
        return r0["params"] if "params" in r0 else r0["ckpt"]["model"]

    def checkpoint(self, step: int) -> Path:
        return checkpoint.step_path(self.run_dir / "checkpoints", step)


class References:
    """Uninterrupted runs on the pool, each trained once per session."""

    def __init__(self, pool, tmp_path_factory):
        self.pool, self.tmp, self.runs = pool, tmp_path_factory, {}

    def get(self, run: Run) -> Reference:
        key = (run.record.__module__, run.record.__name__, run.args, run.record_args)
        if key not in self.runs:
            run_dir = self.tmp.mktemp("reference")
            ranks = self.pool.run(run.record, run.cfg(), str(run_dir), *run.record_args)
            ref = Reference(run_dir, ranks)
            if run.check_reference is not None:
                run.check_reference(ref)
            self.runs[key] = ref
        return self.runs[key]


@dataclass
class Start:
    """Where a stopped run stands: its run dir and the checkpoint it must resume from."""

    run_dir: Path
    checkpoint: Path
    resume: str = "auto"  # the resume override of the pool's run (a path: that checkpoint)
    rows_kept: bool = True  # the run dir's metrics.jsonl holds the rows before the checkpoint
    dir_per_rank: bool = False  # each rank its own run dir, as nodes without a shared disk
    # resume through the command line: start the job again (the command a user or SLURM
    # starts), return its (exit code, stdout, stderr); None: the pool's ranks resume
    again: Callable[[], tuple[int, str, str]] | None = None
    after: list[Callable[[], None]] = field(default_factory=list)  # checks once it ended


@dataclass
class Ctx:
    """What a way of stopping gets: the case's run and reference, a dir of its own, the pool,
    the environment of command-line jobs."""

    run: Run
    ref: Reference
    tmp: Path
    pool: Any
    env: dict


@dataclass(frozen=True)
class Case:
    id: str
    run: Run
    stop: Callable[[Ctx], Start]
    check_start: Callable[[dict, Reference], None] | None = None  # the policy's own state


def check(case: Case, references: References, pool, tmp: Path, env: dict) -> None:
    """Stop the case's run its way, resume it, and compare the end with the reference."""
    ref = references.get(case.run)
    start = case.stop(Ctx(case.run, ref, tmp, pool, env))
    state = checkpoint.load(start.checkpoint)
    progress = checkpoint.progress_of(state)  # an old one's under today's names
    assert len(state["ranks"]) == 2 and state["step"] == progress["step"]
    assert (progress["epoch"], progress["epoch_windows"]) == divmod(progress["windows"],
                                                                 case.run.windows_per_epoch)
    # the two ranks' RNG streams differ (seeded from seed and rank)
    assert not torch.equal(state["ranks"][0]["rng"]["torch"], state["ranks"][1]["rng"]["torch"])
    if case.check_start is not None:
        case.check_start(state, ref)

    if start.again is None:
        out, r1 = pool.run(dist_cases.train_run_rows, case.run.cfg(f"resume={start.resume}"),
                           str(start.run_dir), start.dir_per_rank)
        assert out["summary"]["resumed_from"] == r1["summary"]["resumed_from"]
        assert out["summary"]["resumed_from"] == str(start.checkpoint)
        rows, params, summary = out["rows"], out["params"], out["summary"]
    else:
        code, _, err = start.again()
        assert code == 0, err
        assert f"resuming from {start.checkpoint}" in err
        run_dir = start.run_dir
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        params = checkpoint.load(run_dir / "checkpoints" / "last.pt")["model"]
        summary = json.loads((run_dir / "summary.json").read_text())
        info = json.loads((run_dir / "run_info.json").read_text())
        assert info["resumed_from"] == summary["resumed_from"] == str(start.checkpoint)
    assert summary["status"] == "completed"
    assert summary["resumed_numerics_differ"] == []  # this machine: the checkpoint's numerics
    first = 0 if start.rows_kept else progress["windows"]
    assert losses(rows) == losses(ref.rows)[first:]  # every window once, the same bits
    assert {k: summary[k] for k in case.run.keys} == {k: ref.summary[k] for k in case.run.keys}
    for name, value in ref.params.items():
        assert torch.equal(params[name], value), name
    for after in start.after:
        after()


# --- ways of stopping a run on the pool ---------------------------------------------------------
def from_checkpoint(step: int) -> Callable[[Ctx], Start]:
    """The reference's checkpoint of `step`, resumed in a fresh dir (rows from there on)."""
    def stop(ctx: Ctx) -> Start:
        ckpt = ctx.ref.checkpoint(step)
        assert checkpoint.load(ckpt)["progress"]["step"] == step
        return Start(ctx.tmp, ckpt, resume=str(ckpt), rows_kept=False)
    return stop


def rows_past_the_checkpoint(step: int, rows: int) -> Callable[[Ctx], Start]:
    """A run dir whose newest checkpoint (`step`) is older than its last logged rows and whose
    last line is torn (killed between the two): resume=auto drops the rows after the checkpoint
    and logs them again, once."""
    def stop(ctx: Ctx) -> Start:
        ckpts = ctx.tmp / "checkpoints"
        ckpts.mkdir()
        for name in (f"step_{step:08d}.pt", f"step_{step:08d}.json"):
            (ckpts / name).write_bytes((ctx.ref.run_dir / "checkpoints" / name).read_bytes())
        lines = (ctx.ref.run_dir / "metrics.jsonl").read_text().splitlines()
        (ctx.tmp / "metrics.jsonl").write_text("\n".join(lines[:rows]) + "\n"
                                               + lines[rows][:20])

        def kept() -> None:
            steps = ctx.ref.summary["optimizer_steps"]
            names = sorted(p.name for p in ckpts.glob("step_*.pt"))
            assert names[0] == f"step_{step:08d}.pt" and names[-1] == f"step_{steps:08d}.pt"
            assert checkpoint.load(ckpts / "last.pt")["step"] == steps
        return Start(ctx.tmp, ckpts / f"step_{step:08d}.pt", after=[kept])
    return stop


def rank0_dir_only(ctx: Ctx) -> Start:
    """Under torchrun each node's job picks a checkpoint in its own run dir: here rank 0's dir
    holds the checkpoints (but the newest) and rank 1's none. Rank 1 must resume from rank 0's
    choice (it reads it on the shared disk), not start afresh, or nothing would match."""
    ckpts = ctx.tmp / "rank0" / "checkpoints"
    for path in checkpoint.complete(ctx.ref.run_dir / "checkpoints")[1:]:
        ckpts.mkdir(parents=True, exist_ok=True)
        for f in (path, path.with_suffix(".json")):
            (ckpts / f.name).write_bytes(f.read_bytes())
    chosen = checkpoint.complete(ckpts)[0]
    assert chosen.name == checkpoint.complete(ctx.ref.run_dir / "checkpoints")[1].name
    return Start(ctx.tmp, chosen, rows_kept=False, dir_per_rank=True)


# --- ways of stopping a real command-line job ---------------------------------------------------
def kill_9_at(step: int) -> Callable[[Ctx], Start]:
    """A real job (and its workers) dies by SIGKILL as soon as the checkpoint of `step` is
    complete; whatever it wrote after that checkpoint is removed but its rows, so the resume
    starts there whenever the kill landed. resume=auto in its run dir resumes on the pool's
    ranks (the worker's own resolution: one command-line start less)."""
    def stop(ctx: Ctx) -> Start:
        run_dir = ctx.tmp / "run"
        Job(run_dir, list(ctx.run.args), ctx.env).kill_9_when(
            checkpoint.step_path(run_dir / "checkpoints", step).with_suffix(".json"))
        assert not (run_dir / "summary.json").exists()
        for other in checkpoint.complete(run_dir / "checkpoints"):
            if other != checkpoint.step_path(run_dir / "checkpoints", step):
                other.with_suffix(".json").unlink()
                other.unlink()
        (newest,) = checkpoint.complete(run_dir / "checkpoints")
        return Start(run_dir, newest)
    return stop


def sigterm_ctrl_c_then_kill_9_and_a_corrupt_checkpoint(ctx: Ctx) -> Start:
    """One preemptible job's life: SIGTERM to the job process (a scheduler), Ctrl-C (SIGINT to
    the whole process group), kill -9 of everything at a random step, a corrupt newest
    checkpoint; each start continues with resume=auto, the last one too."""
    run_dir, args, steps = ctx.tmp / "run", list(ctx.run.args), ctx.ref.summary["optimizer_steps"]
    rng = random.Random()
    stopped = 0
    for signum, send in [(signal.SIGTERM, lambda job: job.proc.send_signal(signal.SIGTERM)),
                         (signal.SIGINT, lambda job: os.killpg(job.proc.pid, signal.SIGINT))]:
        job = Job(run_dir, [*args, *(["resume=auto"] if stopped else [])], ctx.env)
        seen = job.wait_for_step(stopped + rng.randint(5, 20))
        send(job)
        code, _, err = job.finish()
        name = signal.Signals(signum).name
        assert code == 128 + signum, err
        summary = json.loads((run_dir / "summary.json").read_text())
        assert (summary["status"], summary["stopped_by"]) == ("interrupted", name)
        stopped = summary["optimizer_steps"]
        assert seen <= stopped < steps
        print(f"{name} sent at step {seen}: all ranks stopped after step {stopped}")
        assert f"stopped by {name} after optimizer step {stopped}" in err and "resume=auto" in err
        assert summary["checkpoint"] == str(checkpoint.step_path(run_dir / "checkpoints", stopped))
        assert job.survivors() == []

    job = Job(run_dir, [*args, "resume=auto"], ctx.env)
    target = stopped + rng.randint(25, 40)  # at least two checkpoints after the last stop
    job.wait_for_step(target)
    os.killpg(job.proc.pid, signal.SIGKILL)  # the job and its workers, no chance to clean up
    code, _, _ = job.finish()
    assert code == -signal.SIGKILL and job.step() < steps, f"target {target}"
    assert job.survivors() == []
    newest, previous = checkpoint.complete(run_dir / "checkpoints")[:2]
    assert int(previous.stem.split("_")[1]) > stopped, f"target {target}"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside the tensors: torch.load would not see
    newest.write_bytes(bytes(data))

    def again() -> tuple[int, str, str]:
        code, out, err = Job(run_dir, [*args, "resume=auto"], ctx.env).finish()
        assert f"skipping {newest}: corrupt checkpoint" in err, err
        return code, out, err

    def three_starts_before() -> None:
        info = json.loads((run_dir / "run_info.json").read_text())
        assert len(info["previous_starts"]) == 3

    return Start(run_dir, previous, again=again, after=[three_starts_before])


def slurm_sigusr1_and_requeue(ctx: Ctx) -> Start:
    """A one-task SLURM job (its 2 workers spawned; a stand-in `scontrol` on PATH) gets SLURM's
    warning, SIGUSR1: it checkpoints, stops and requeues itself once; the same command started
    again (what a requeued job runs) resumes from outputs/runs/slurm-<id> by itself."""
    bin_dir, record = fake_scontrol(ctx.tmp)
    env = ctx.env | {"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{ctx.env['PATH']}"}
    runs = ctx.tmp / "outputs" / "runs"
    run_dir = runs / "slurm-4242"

    def start() -> Job:
        return Job(run_dir, list(ctx.run.args), env, cwd=ctx.tmp, name_run_dir=False)

    job = start()
    job.wait_for_step(5)
    job.proc.send_signal(signal.SIGUSR1)
    code, _, err = job.finish()
    assert code == 128 + signal.SIGUSR1, err
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["optimizer_steps"]
    assert (summary["status"], summary["stopped_by"]) == ("interrupted", "SIGUSR1")
    assert 5 <= stopped < ctx.ref.summary["optimizer_steps"]
    assert summary["checkpoint"] == str(checkpoint.step_path(run_dir / "checkpoints", stopped))
    assert summary["peak_gpu_mem_mb"] is None  # the CPU's
    assert record.read_text() == "requeue 4242\n"  # once, by the rank-0 task, after the ckpt
    assert "requeued SLURM job 4242" in err

    def requeued_once_one_run_dir() -> None:
        assert record.read_text() == "requeue 4242\n"
        assert list(runs.iterdir()) == [run_dir]

    return Start(run_dir, Path(summary["checkpoint"]), again=lambda: start().finish(),
                 after=[requeued_once_one_run_dir])
