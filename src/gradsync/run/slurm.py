"""SLURM without submitit: plain `srun` tasks as ranks, the run dir a requeued job finds again,
and preemption (SIGUSR1/SIGUSR2) ending in `scontrol requeue`.

- ``srun --ntasks-per-node=4 gradsync-train ...``: every task is one rank. adopt_srun_ranks()
  checks every SLURM variable it reads, each against the others (SlurmEnvError: one line
  naming the variable and its value, a config error), then exports the env:// variables
  torchrun would set (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR = the first
  host of SLURM_JOB_NODELIST, MASTER_PORT drawn from the job and step ids unless set) and
  GRADSYNC_SRUN_TASK=1 (placement.launched_by), so the task runs exactly like a torchrun rank.
  A job of one task spawns trainer.devices workers itself, as anywhere else.
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


class SlurmEnvError(ValueError):
    """A SLURM variable gradsync reads is malformed or contradicts another: one line naming the
    variable and its value (a config error: exit code 2, before anything starts)."""


def _refused(var: str, value: str, why: str) -> SlurmEnvError:
    return SlurmEnvError(f"{var}={value!r} is not allowed: {why}")


HOST_TEXT = re.compile(r"[A-Za-z0-9._-]+")  # what a host name (or a part of one) may hold
DIGITS = re.compile(r"[0-9]+")
MAX_HOSTS = 100_000  # more than any cluster has: a hostlist expanding further is refused


def expand_hostlist(hostlist: str) -> list[str]:
    """`gpu[001-003,010],cpu07` -> gpu001 gpu002 gpu003 gpu010 cpu07: comma-separated names,
    each of host-name characters and any number of bracket groups of numbers and ranges (zero
    padding kept). What it cannot expand in full (a bracket never closed, a range that runs
    backwards, an empty name, a character no host name has) is a ValueError saying why."""
    names: list[str] = []
    for item in _items(hostlist):
        expanded = [""]
        for m in re.finditer(r"([^\[]*)(\[([^\]]*)\])?", item):
            text, group = m.group(1), m.group(3)
            if text and not HOST_TEXT.fullmatch(text):
                raise ValueError(f"{text!r} holds a character no host name has")
            options = [text] if group is None else [text + n for n in _expand_ranges(group)]
            expanded = [head + tail for head in expanded for tail in options]
            if len(names) + len(expanded) > MAX_HOSTS:
                raise ValueError(f"it expands to more than {MAX_HOSTS} hosts")
        names.extend(expanded)
    return names


def _items(hostlist: str) -> list[str]:
    """The comma-separated names of a hostlist (a comma inside brackets separates ranges)."""
    items, start, inside = [], 0, False
    for i, ch in enumerate(hostlist):
        if ch == "[":
            if inside:
                raise ValueError("a '[' opens inside another")
            inside = True
        elif ch == "]":
            if not inside:
                raise ValueError("a ']' closes no '['")
            inside = False
        elif ch == "," and not inside:
            items.append(hostlist[start:i])
            start = i + 1
    if inside:
        raise ValueError("a '[' is never closed")
    items.append(hostlist[start:])
    if not all(items):
        raise ValueError("it holds an empty host name")
    return items


def _expand_ranges(group: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        lo, dash, hi = part.partition("-")
        if not DIGITS.fullmatch(lo) or (dash and not DIGITS.fullmatch(hi)):
            raise ValueError(f"[{group}] holds {part!r}, neither a number nor a range of numbers")
        if not dash:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"the range {part!r} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"the range {part!r} holds more than {MAX_HOSTS} hosts")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE (`2(x3),1`: 2 tasks on each of 3 nodes, then 1): the task count of
    every node; a ValueError when it is not such a list."""
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"([0-9]+)(?:\(x([0-9]+)\))?", part)
        if m is None or int(m.group(1)) < 1 or int(m.group(2) or 1) < 1:
            raise ValueError(f"{part!r} is not a task count N >= 1 or N(xM)")
        if len(counts) + int(m.group(2) or 1) > MAX_HOSTS:
            raise ValueError(f"it lists more than {MAX_HOSTS} nodes")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


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


def _number(var: str, default: str, what: str, lo: int = 0) -> int:
    """An integer SLURM variable (absent: default), >= lo."""
    value = os.environ.get(var, default)
    if not DIGITS.fullmatch(value) or int(value) < lo:
        raise _refused(var, value, f"{what}: an integer >= {lo}")
    return int(value)


def is_srun_task() -> bool:
    """One task of a plain `srun` job step of several tasks, not already a torchrun rank."""
    env = os.environ
    if "SLURM_PROCID" not in env or "SUBMITIT_EXECUTOR" in env:
        return False
    if "RANK" in env and "WORLD_SIZE" in env:
        return False
    return _number("SLURM_NTASKS", "1", "the tasks of the job step", 1) > 1


# The master ports srun tasks derive: 20000-32767 and 61000-65535, outside Linux's ephemeral
# range (net.ipv4.ip_local_port_range, 32768-60999 by default), where the kernel picks the
# ports of outgoing connections (a TCPStore's clients' among them) and could hold ours.
PORT_RANGES = ((20000, 32768), (61000, 65536))
PORTS = sum(hi - lo for lo, hi in PORT_RANGES)  # 17304
STEP_STRIDE = 4099  # a prime: steps of one job land far apart, on other jobs' gaps


def _digits_in(value: str) -> int:
    """The number the digits of `value` spell (0 without any)."""
    digits = "".join(ch for ch in value if ch.isdigit())
    return int(digits) if digits else 0


def port_for(job: str, step: str = "0") -> int:
    """The master port every task of one job step derives alike: slot (job + 4099 * step)
    mod 17304 of PORT_RANGES. Concurrent steps of one job get different ports, and so do steps
    0-3 of jobs whose ids are less than 4099 apart (a modulus alone made jobs 40000 apart, and
    every step of a job, collide)."""
    slot = (_digits_in(job) + STEP_STRIDE * _digits_in(step)) % PORTS
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


def check_job_id() -> None:
    """SLURM_JOB_ID names the run dir (outputs/runs/slurm-<id>) and the job to requeue: a
    number, as SLURM's are."""
    job = job_id()
    if job is not None and not DIGITS.fullmatch(job):
        raise _refused("SLURM_JOB_ID", job, "a SLURM job id is a number (it names the run dir "
                       "outputs/runs/slurm-<id>)")


def srun_ranks() -> dict[str, str]:
    """torchrun's env:// variables for a plain srun task (see is_srun_task), from its SLURM
    variables, each checked against the others first (SlurmEnvError)."""
    env = os.environ
    world = _number("SLURM_NTASKS", "1", "the tasks of the job step", 1)
    rank = _number("SLURM_PROCID", "0", "this task's rank")
    if rank >= world:
        raise _refused("SLURM_PROCID", env["SLURM_PROCID"],
                       f"not a task of this job step of SLURM_NTASKS={world} (0-{world - 1})")
    node = _number("SLURM_NODEID", "0", "this task's node")
    scope = "STEP_" if env.get("SLURM_STEP_TASKS_PER_NODE") else ""
    per_node_var = f"SLURM_{scope}TASKS_PER_NODE"
    per_node = env.get(per_node_var)
    if per_node:
        try:
            counts = tasks_per_node(per_node)
        except ValueError as e:
            raise _refused(per_node_var, per_node, str(e)) from None
        if node >= len(counts):
            raise _refused("SLURM_NODEID", env["SLURM_NODEID"], f"not a node of this job: "
                           f"{per_node_var}={per_node!r} lists {len(counts)} "
                           f"node{'s' if len(counts) > 1 else ''}")
        if sum(counts) < world or (scope and sum(counts) != world):
            raise _refused(per_node_var, per_node, f"its {sum(counts)} tasks are not the "
                           f"SLURM_NTASKS={world} of this job step")
        local_world = counts[node]
    else:
        local_world = _number("SLURM_NTASKS_PER_NODE", str(world), "the tasks on each node", 1)
    local = _number("SLURM_LOCALID", "0", "this task's rank on its node")
    if local >= local_world:
        raise _refused("SLURM_LOCALID", env["SLURM_LOCALID"], f"not one of the {local_world} "
                       "tasks on this node")
    _number("SLURM_STEP_ID", "0", "this task's job step")  # it draws MASTER_PORT (port_for)
    nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
                         if env.get(v)), None)
    hosts = ["127.0.0.1"]
    if nodelist_var is not None:
        try:
            hosts = expand_hostlist(env[nodelist_var])
        except ValueError as e:
            raise _refused(nodelist_var, env[nodelist_var], f"not a hostlist: {e}") from None
        if node >= len(hosts):
            raise _refused("SLURM_NODEID", env["SLURM_NODEID"], f"not a node of this job: "
                           f"{nodelist_var}={env[nodelist_var]!r} lists {len(hosts)} "
                           f"host{'s' if len(hosts) > 1 else ''}")
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": hosts[0]}


def adopt_srun_ranks() -> None:
    """Check the SLURM variables gradsync reads (SlurmEnvError: one line naming the variable
    and its value) and export torchrun's env:// variables for a plain srun task (see
    is_srun_task); MASTER_ADDR and MASTER_PORT only where not set."""
    check_job_id()
    if not is_srun_task():
        return
    env = os.environ
    ranks = srun_ranks()
    env.setdefault("MASTER_ADDR", ranks.pop("MASTER_ADDR"))
    env.update(ranks)
    env.setdefault("MASTER_PORT", str(port_for(env.get("SLURM_JOB_ID", "0"),
                                               env.get("SLURM_STEP_ID", "0"))))
    env["GRADSYNC_SRUN_TASK"] = "1"  # placement.launched_by: this rank is an srun task


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
