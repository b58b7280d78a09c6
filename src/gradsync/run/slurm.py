"""SLURM without submitit: plain `srun` tasks as ranks, the run dir a requeued job finds again,
and preemption (SIGUSR1/SIGUSR2) ending in `scontrol requeue`.

- ``srun --ntasks-per-node=4 gradsync-train ...``: every task is one rank. adopt_srun_ranks()
  exports the env:// variables torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE,
  LOCAL_WORLD_SIZE, MASTER_ADDR = the first host of SLURM_JOB_NODELIST, MASTER_PORT drawn from
  the job and step ids unless set), so the task runs exactly like a torchrun rank. A job of one task
  spawns trainer.devices workers itself, as anywhere else.
- Under SLURM (SLURM_JOB_ID set, submitit not in charge) the default run dir is
  outputs/runs/slurm-<job id> and `resume` defaults to auto, so a requeued job (same id, same
  command) continues from its newest checkpoint.
- SIGUSR1/SIGUSR2 (`sbatch --signal=USR1@90`) stop training like SIGTERM (finish the step,
  checkpoint); once the checkpoint is durable the rank-0 task calls `scontrol requeue <job id>`
  once (trainer.requeue=false turns that off).

SLURM's hostlist syntax is parsed here: `scontrol show hostnames` is not always callable from
inside a task.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

from gradsync.run.faults import STOP_SIGNALS

PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def expand_hostlist(hostlist: str) -> list[str]:
    """`gpu[001-003,010],cpu07` -> gpu001 gpu002 gpu003 gpu010 cpu07: comma-separated names,
    each with any number of bracket groups of numbers and ranges (zero padding kept)."""
    names: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", hostlist):
        expanded = [""]
        for plain, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            options = [plain]
            if group:
                options = [plain + n for n in _expand_ranges(group)]
            expanded = [head + tail for head in expanded for tail in options]
        names.extend(n for n in expanded if n)
    return names


def _expand_ranges(group: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        lo, _, hi = part.strip().partition("-")
        if not hi:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"bad hostlist range {part!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _tasks_on_node(tasks_per_node: str, node: int) -> int:
    """SLURM_TASKS_PER_NODE (`2(x3),1`: 2 tasks on each of 3 nodes, then 1) for node `node`."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ValueError(f"bad tasks-per-node list {tasks_per_node!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node]


def job_id() -> str | None:
    """The SLURM job this process belongs to, unless submitit runs it (submitit has its own
    run dirs and preemption handling)."""
    if "SUBMITIT_EXECUTOR" in os.environ:
        return None
    return os.environ.get("SLURM_JOB_ID") or None


def watched_signals() -> tuple[signal.Signals, ...]:
    """The signals that stop training after a checkpoint: SIGTERM and SIGINT, and under SLURM
    its preemption warnings too."""
    return STOP_SIGNALS + PREEMPT_SIGNALS if job_id() else STOP_SIGNALS


def is_srun_task() -> bool:
    """One task of a plain `srun` job step of several tasks, not already a torchrun rank."""
    env = os.environ
    if "SLURM_PROCID" not in env or "SUBMITIT_EXECUTOR" in env:
        return False
    if "RANK" in env and "WORLD_SIZE" in env:
        return False
    return int(env.get("SLURM_NTASKS", "1")) > 1


# The master ports srun tasks derive: 20000-32767 and 61000-65535, outside Linux's ephemeral
# range (net.ipv4.ip_local_port_range, 32768-60999 by default), where the kernel picks the
# ports of outgoing connections (a TCPStore's clients' among them) and could hold ours.
PORT_RANGES = ((20000, 32768), (61000, 65536))
PORTS = sum(hi - lo for lo, hi in PORT_RANGES)  # 17304
STEP_STRIDE = 4099  # a prime: steps of one job land far apart, on other jobs' gaps


def _number(value: str) -> int:
    digits = "".join(ch for ch in value if ch.isdigit())
    return int(digits) if digits else 0


def port_for(job: str, step: str = "0") -> int:
    """The master port every task of one job step derives alike: slot (job + 4099 * step)
    mod 17304 of PORT_RANGES. Concurrent steps of one job get different ports, and so do steps
    0-3 of jobs whose ids are less than 4099 apart (a modulus alone made jobs 40000 apart, and
    every step of a job, collide)."""
    slot = (_number(job) + STEP_STRIDE * _number(step)) % PORTS
    for lo, hi in PORT_RANGES:
        if slot < hi - lo:
            return lo + slot
        slot -= hi - lo
    raise AssertionError("unreachable: slot < PORTS")


def task_has_own_cpus(usable: int) -> bool:
    """Whether this process's CPU mask (of `usable` CPUs) is its own, not shared with the other
    ranks of its node: it is an srun task itself (not a torchrun rank inside one: those share
    their agent's mask), and SLURM bound it (SLURM_CPU_BIND_TYPE other than none, as the
    task/affinity plugin exports it, e.g. `mask_cpu:`), or its mask holds no more CPUs than one
    task gets (SLURM_CPUS_PER_TASK)."""
    env = os.environ
    if "SLURM_PROCID" not in env or "TORCHELASTIC_RUN_ID" in env:
        return False
    bind = env.get("SLURM_CPU_BIND_TYPE", "").strip().lower()
    if bind and not bind.startswith("none"):
        return True
    per_task = env.get("SLURM_CPUS_PER_TASK", "").strip()
    return per_task.isdigit() and 0 < usable <= int(per_task)


def adopt_srun_ranks() -> None:
    """Export torchrun's env:// variables for a plain srun task (see is_srun_task)."""
    if not is_srun_task():
        return
    env = os.environ
    node = int(env.get("SLURM_NODEID", "0"))
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = (_tasks_on_node(per_node, node) if per_node
                   else int(env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"])))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = str(local_world)
    env.setdefault("MASTER_ADDR", expand_hostlist(nodelist)[0])
    env.setdefault("MASTER_PORT", str(port_for(env.get("SLURM_JOB_ID", "0"),
                                               env.get("SLURM_STEP_ID", "0"))))


def run_name() -> str | None:
    """The default run dir's name under SLURM: slurm-<job id>, which a requeued job finds
    again; None elsewhere (the start time names it)."""
    job = job_id()
    return f"slurm-{job}" if job else None


def default_resume() -> str:
    """`resume`'s default: auto under SLURM (a requeued job continues), else none."""
    return "auto" if job_id() else "none"


def requeue(job: str) -> str:
    """`scontrol requeue <job>`; returns what to tell the user."""
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"scontrol requeue {job} failed: {e}"
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        return (f"scontrol requeue {job} failed (exit code {done.returncode}"
                f"{': ' + why[-1] if why else ''})")
    return f"requeued SLURM job {job}: it continues from this checkpoint"
