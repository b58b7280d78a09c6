"""SLURM without SLURM: its hostlists, a plain srun task's variables, GPU placement and capability
rules, CPU threads from the affinity mask, and what a preempted job does (requeue once, with a
stand-in `scontrol` on PATH). (A preempted job end to end, SIGUSR1, requeue and the same command
continuing bitwise: tests/test_resume.py; two srun-like tasks forming one job:
tests/test_cluster.py.)"""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

import dist_cases
from cli_jobs import fake_scontrol
from gradsync.core.devices import DeviceError, check_capability, cpu_threads, cuda_index
from gradsync.run import slurm
from gradsync.run.placement import launched_by
from gradsync.run.summary import stopped
from gradsync.train.state import to_cpu


@pytest.mark.parametrize("hostlist, hosts", [
    ("gpu017", ["gpu017"]),
    ("gpu[017-018]", ["gpu017", "gpu018"]),
    ("gpu[001-003,010],cpu07", ["gpu001", "gpu002", "gpu003", "gpu010", "cpu07"]),
    ("a[8-11]", ["a8", "a9", "a10", "a11"]),  # no padding: none added
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept past a new digit
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01",
                               "rack2-node02"]),
    ("login1,node-[3,5]x,node9", ["login1", "node-3x", "node-5x", "node9"]),
])
def test_slurm_hostlists_expand_like_scontrol_show_hostnames(hostlist, hosts):
    assert slurm.expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist, why", [
    ("gpu[9-3]", "the range '9-3' runs backwards"),
    ("gpu[01-", "a '[' is never closed"),
    ("gpu[01-]", "[01-] holds '01-', neither a number nor a range of numbers"),
    ("gpu[]", "[] holds '', neither a number nor a range of numbers"),
    ("gpu01],gpu02", "a ']' closes no '['"),
    ("gpu[0[1-2]]", "a '[' opens inside another"),
    ("gpu01,,gpu02", "it holds an empty host name"),
    ("", "it holds an empty host name"),
    ("gpu 01", "'gpu 01' holds a character no host name has"),
    ("gpu[0-9999999]", "the range '0-9999999' holds more than 100000 hosts"),
    ("a[0-999],b[0-999]x[0-99]", "it expands to more than 100000 hosts"),
])
def test_a_hostlist_that_cannot_be_expanded_in_full_is_refused(hostlist, why):
    with pytest.raises(ValueError) as e:
        slurm.expand_hostlist(hostlist)
    assert str(e.value) == why


SRUN_TASK = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
             "SLURM_NTASKS": "6", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "4,2",
             "SLURM_JOB_NODELIST": "gpu[009-010]"}
ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "SUBMITIT_EXECUTOR", "SLURM_STEP_TASKS_PER_NODE",
            "SLURM_STEP_NODELIST", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_ID",
            "SLURM_CPU_BIND_TYPE", "SLURM_CPUS_PER_TASK", "TORCHELASTIC_RUN_ID",
            "GRADSYNC_SRUN_TASK", *SRUN_TASK)


@pytest.fixture
def bare_env(monkeypatch):
    """None of the keys set; whatever the code under test exports into os.environ is undone
    afterwards (set first, so that monkeypatch records each key's absence to restore)."""
    for key in ENV_KEYS:
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    return monkeypatch


def test_a_plain_srun_task_becomes_an_env_rank(bare_env):
    for key, value in SRUN_TASK.items():
        bare_env.setenv(key, value)
    slurm.adopt_srun_ranks()
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                      "MASTER_ADDR", "MASTER_PORT")}
    # task 5 is the second of the 2 tasks on node 1 of "4,2"; every task derives one port
    assert env == {"RANK": "5", "WORLD_SIZE": "6", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "gpu009", "MASTER_PORT": str(slurm.port_for("4242", "0"))}
    assert launched_by() == "srun"  # GRADSYNC_SRUN_TASK=1: run_info.json's launched_by
    for key in env:  # the same task in step 3 of the job
        bare_env.delenv(key)
    bare_env.setenv("SLURM_STEP_ID", "3")
    slurm.adopt_srun_ranks()
    assert os.environ["MASTER_PORT"] == str(slurm.port_for("4242", "3"))


def in_port_ranges(port: int) -> bool:
    return 20000 <= port < 32768 or 61000 <= port < 65536


def test_master_ports_differ_per_step_and_stay_out_of_the_ephemeral_range():
    """Linux picks outgoing connections' ports from 32768-60999: a derived master port never
    lies there. Steps of one job (two concurrent sruns) differ; so do nearby jobs, and jobs
    40000 apart (which the modulus 40000 made collide)."""
    jobs = [str(j) for j in range(4000, 4000 + 4099)]  # ids less than 4099 apart
    ports = {(j, s): slurm.port_for(j, str(s)) for j in jobs for s in range(4)}
    assert all(in_port_ranges(p) for p in ports.values())
    assert len(set(ports.values())) == len(ports)  # 16396 job steps, 16396 ports
    assert slurm.port_for("4242") != slurm.port_for("44242")
    assert {slurm.port_for(str(j), str(s)) for j in range(17304) for s in (0,)} == {
        *range(20000, 32768), *range(61000, 65536)}  # every allowed port is reached
    assert slurm.port_for("17304") == slurm.port_for("0") == 20000  # the period
    assert slurm.port_for("job_12.x", "batch") == slurm.port_for("12", "0")  # digits only


@pytest.mark.parametrize("extra, adopted", [
    ({"SLURM_NTASKS": "1"}, False),  # a one-task job spawns trainer.devices workers itself
    ({"RANK": "0", "WORLD_SIZE": "2"}, False),  # torchrun inside an allocation: its ranks
    ({"SUBMITIT_EXECUTOR": "slurm"}, False),  # submitit's tasks: adopt_submitit_ranks
    ({"MASTER_PORT": "29511", "SLURM_TASKS_PER_NODE": "2(x3)"}, True),
])
def test_which_slurm_tasks_are_adopted(bare_env, extra, adopted):
    for key, value in (SRUN_TASK | extra).items():
        bare_env.setenv(key, value)
    slurm.adopt_srun_ranks()
    assert ("LOCAL_WORLD_SIZE" in os.environ) == adopted
    if adopted:
        assert os.environ["MASTER_PORT"] == "29511" and os.environ["LOCAL_WORLD_SIZE"] == "2"


# Each malformed or inconsistent variable of a plain srun task: one line naming it and its value.
BAD_SRUN = [
    ({"SLURM_JOB_NODELIST": "gpu[009-003]"}, "SLURM_JOB_NODELIST='gpu[009-003]' is not allowed: "
     "not a hostlist: the range '009-003' runs backwards"),
    ({"SLURM_JOB_NODELIST": "gpu[01-"}, "SLURM_JOB_NODELIST='gpu[01-' is not allowed: not a "
     "hostlist: a '[' is never closed"),
    ({"SLURM_STEP_NODELIST": "gpu[01-02]x,"}, "SLURM_STEP_NODELIST='gpu[01-02]x,' is not "
     "allowed: not a hostlist: it holds an empty host name"),
    ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two' is not allowed: the tasks of the job step: an "
     "integer >= 1"),
    ({"SLURM_NTASKS": "0"}, "SLURM_NTASKS='0' is not allowed"),
    ({"SLURM_TASKS_PER_NODE": "2(x"}, "SLURM_TASKS_PER_NODE='2(x' is not allowed: '2(x' is not a "
     "task count N >= 1 or N(xM)"),
    ({"SLURM_TASKS_PER_NODE": "4,0"}, "SLURM_TASKS_PER_NODE='4,0' is not allowed: '0' is not a "
     "task count"),
    ({"SLURM_STEP_TASKS_PER_NODE": "4,4"}, "SLURM_STEP_TASKS_PER_NODE='4,4' is not allowed: its "
     "8 tasks are not the SLURM_NTASKS=6 of this job step"),
    ({"SLURM_PROCID": "6"}, "SLURM_PROCID='6' is not allowed: not a task of this job step of "
     "SLURM_NTASKS=6 (0-5)"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1' is not allowed: this task's rank: an integer >= "
     "0"),
    ({"SLURM_NTASKS": "2", "SLURM_PROCID": "5", "SLURM_TASKS_PER_NODE": "1(x2)"},
     "SLURM_PROCID='5' is not allowed: not a task of this job step of SLURM_NTASKS=2 (0-1)"),
    ({"SLURM_NODEID": "3", "SLURM_TASKS_PER_NODE": "3(x2)"}, "SLURM_NODEID='3' is not allowed: "
     "not a node of this job: SLURM_TASKS_PER_NODE='3(x2)' lists 2 nodes"),
    ({"SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu009"}, "SLURM_NODEID='1' is not allowed: "
     "not a node of this job: SLURM_JOB_NODELIST='gpu009' lists 1 host"),
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x' is not allowed: this task's node: an integer"),
    ({"SLURM_LOCALID": "2"}, "SLURM_LOCALID='2' is not allowed: not one of the 2 tasks on this "
     "node"),
    ({"SLURM_TASKS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "four"}, "SLURM_NTASKS_PER_NODE="
     "'four' is not allowed: the tasks on each node: an integer >= 1"),
    ({"SLURM_STEP_ID": "3x"}, "SLURM_STEP_ID='3x' is not allowed: this task's job step: an "
     "integer >= 0"),
    ({"SLURM_JOB_ID": "42/../../etc"}, "SLURM_JOB_ID='42/../../etc' is not allowed: a SLURM job "
     "id is a number (it names the run dir outputs/runs/slurm-<id>)"),
]


@pytest.mark.parametrize("bad, message", BAD_SRUN, ids=[str(b) for b, _ in BAD_SRUN])
def test_a_malformed_or_inconsistent_slurm_variable_is_one_line_naming_it(bare_env, bad,
                                                                          message):
    for key, value in (SRUN_TASK | bad).items():
        bare_env.setenv(key, value)
    with pytest.raises(slurm.SlurmEnvError) as e:
        slurm.adopt_srun_ranks()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert "RANK" not in os.environ and "MASTER_ADDR" not in os.environ  # nothing exported


def test_a_malformed_slurm_job_id_is_refused_in_a_one_task_job_too(bare_env):
    bare_env.setenv("SLURM_JOB_ID", "77 ")
    with pytest.raises(slurm.SlurmEnvError, match="SLURM_JOB_ID='77 ' is not allowed"):
        slurm.adopt_srun_ranks()


def test_the_command_line_refuses_a_malformed_slurm_environment_before_anything_starts(
        bare_env, tmp_path, capsys, monkeypatch):
    """gradsync-train's entry point: exit code 2 and one line, before Hydra composes or
    creates anything."""
    from gradsync.run import main

    for key, value in (SRUN_TASK | {"SLURM_JOB_NODELIST": "gpu[01-"}).items():
        bare_env.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["gradsync-train", "trainer.max_steps=1"])
    with pytest.raises(SystemExit) as e:
        main.main()
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "gradsync: config error: SLURM_JOB_NODELIST='gpu[01-' is not allowed: not a hostlist: a "
        "'[' is never closed"]
    assert list(tmp_path.iterdir()) == []


def test_the_run_dir_and_resume_defaults_under_slurm(bare_env):
    assert (slurm.run_name(), slurm.default_resume()) == (None, "none")
    bare_env.setenv("SLURM_JOB_ID", "77")
    assert (slurm.run_name(), slurm.default_resume()) == ("slurm-77", "auto")
    assert slurm.watched_signals()[-2:] == (signal.SIGUSR1, signal.SIGUSR2)
    bare_env.setenv("SUBMITIT_EXECUTOR", "slurm")  # submitit names dirs and requeues itself
    assert (slurm.run_name(), slurm.default_resume()) == (None, "none")
    assert signal.SIGUSR1 not in slurm.watched_signals()


@pytest.mark.parametrize("visible, local_rank, local_world, same_view, index", [
    (1, 0, 1, True, 0),
    (1, 1, 2, False, 0),  # srun --gpus-per-task=1: every task sees its own GPU as cuda:0
    (4, 3, 4, True, 3),
    (4, 3, 4, False, 3),
    (8, 1, 2, False, 1),
    (2, 3, 4, False, 1),  # srun --gpus-per-task=2: a task's two GPUs are its own (issue 32)
    (2, 2, 4, False, 0),
])
def test_each_rank_picks_its_gpu(visible, local_rank, local_world, same_view, index):
    assert cuda_index(visible, local_rank, local_world, same_view) == index


@pytest.mark.parametrize("visible, local_world, same_view", [(0, 2, False), (1, 2, True),
                                                            (3, 4, True)])
def test_more_ranks_than_gpus_is_one_line_naming_both(visible, local_world, same_view,
                                                       monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4,5"[:2 * visible - 1])
    with pytest.raises(DeviceError) as e:
        cuda_index(visible, 0, local_world, same_view)
    text = str(e.value)
    assert "\n" not in text
    assert text.startswith(f"{local_world} ranks on this node need one GPU each on nccl, but "
                           f"{visible} GPU")
    assert f"visible (CUDA_VISIBLE_DEVICES={'3,4,5'[:2 * visible - 1]})" in text


@pytest.fixture
def one_gpu_node(bare_env):
    """What check_cuda reads of the CUDA driver, pinned (no GPU here): `gpus` visible, each
    an A100; the env a launcher set is the test's."""
    from gradsync.run import placement

    def set_gpus(count: int) -> None:
        bare_env.setattr(placement, "visible_gpus", lambda: count)
        bare_env.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
        bare_env.setattr(torch.cuda, "get_device_name", lambda index=None: "A100")

    return set_gpus


@pytest.mark.parametrize("launcher", [{"TORCHELASTIC_RUN_ID": "x"}, {}])
def test_two_torchrun_ranks_on_one_visible_gpu_are_one_line_before_training(
        one_gpu_node, bare_env, launcher):
    """Issue 32 fault 2: torchrun --nproc-per-node=2 with one GPU visible: both ranks took
    cuda:0 (torchrun narrows no rank's view) and nccl failed at DDP's first broadcast with
    "Duplicate GPU detected". Now the config check refuses each rank in one line."""
    from gradsync.components import ConfigError
    from gradsync.run.placement import check_cuda, place_job

    one_gpu_node(1)
    for key, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "2", **launcher}.items():
        bare_env.setenv(key, value)
    placement = place_job("nccl", 1, cuda_available=True)
    assert placement.launched_by == "torchrun"
    with pytest.raises(ConfigError) as e:
        check_cuda(placement, "bf16")
    assert str(e.value) == (
        "2 ranks on this node need one GPU each on nccl, but 1 GPU visible: start at most that "
        "many ranks per node (trainer.devices, --nproc-per-node, --ntasks-per-node), or use "
        "trainer.backend=gloo")


def test_an_srun_task_with_two_gpus_of_its_own_trains_on_one_of_them(one_gpu_node, bare_env):
    """srun --ntasks-per-node=4 --gpus-per-task=2: each task sees its own two GPUs, fewer than
    the node's 4 ranks; it was refused. Task 3 takes cuda:1 of its own (3 % 2), task 2 cuda:0."""
    from gradsync.run.placement import check_cuda, place_job

    one_gpu_node(2)
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3",
                       "LOCAL_WORLD_SIZE": "4", "GRADSYNC_SRUN_TASK": "1"}.items():
        bare_env.setenv(key, value)
    placement = place_job("nccl", 1, cuda_available=True)
    assert placement.launched_by == "srun"
    assert check_cuda(placement, "bf16") == [1]
    bare_env.setenv("LOCAL_RANK", "2")
    assert check_cuda(place_job("nccl", 1, cuda_available=True), "bf16") == [0]


@pytest.mark.parametrize("gpus, refusal", [
    (["GPU-a", "GPU-b"], [None, None]),
    (["GPU-a", "GPU-a"], ["ranks 0 and 1 on {host} were both placed on one GPU (GPU-a: cuda:0 of "
                          "rank 0, cuda:0 of rank 1): give each task a GPU of its own (srun "
                          "--gpus-per-task=1), start at most as many ranks per node as it has "
                          "GPUs (--ntasks-per-node, --nproc-per-node), or use "
                          "trainer.backend=gloo"] * 2)])
@pytest.mark.dist
def test_two_ranks_placed_on_one_gpu_are_refused_on_every_rank(pool2, gpus, refusal):
    """Two srun tasks sharing one GPU's view (no per-task binding) each take cuda:0; the
    ranks compare their GPUs' UUIDs over a CPU group before nccl runs anything (the UUIDs
    given here: torch.cuda.get_device_properties(device).uuid on a GPU)."""
    import socket

    got = pool2.run(dist_cases.own_gpu_refusal, gpus)
    assert got == [r if r is None else r.format(host=socket.gethostname()) for r in refusal]


def test_bf16_is_refused_where_the_gpu_only_emulates_it():
    check_capability("bf16", 0, (8, 0), "A100")
    check_capability("fp16", 1, (7, 0), "V100")
    with pytest.raises(DeviceError) as e:
        check_capability("bf16", 1, (7, 0), "Tesla V100")
    assert str(e.value) == ("precision.name='bf16' is not native on cuda:1 (Tesla V100, compute "
                            "capability 7.0; bf16 needs 8.0): choose fp16 or fp32")


def test_threads_come_from_the_cpus_this_process_may_use():
    """The affinity mask of the calling thread, as taskset or SLURM's --cpus-per-task set it
    (os.cpu_count() counts the whole machine)."""
    result: dict[str, int] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # this thread only
        result["one rank"] = cpu_threads(1)
        result["two ranks"] = cpu_threads(2)

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    assert result == {"one rank": 1, "two ranks": 1}
    assert cpu_threads(1) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("env, own", [
    ({}, False),  # no SLURM: torchrun's or spawned ranks share the mask
    ({"SLURM_PROCID": "0"}, False),  # an srun task whose mask is the node's (not bound)
    ({"SLURM_PROCID": "0", "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, True),  # task/affinity bound it
    ({"SLURM_PROCID": "0", "SLURM_CPU_BIND_TYPE": "cores"}, True),
    ({"SLURM_PROCID": "0", "SLURM_CPU_BIND_TYPE": "none"}, False),  # srun --cpu-bind=none
    ({"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "8"}, True),  # 8 CPUs: one task's share
    ({"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "4"}, False),  # 8 CPUs: two tasks' share
    ({"SLURM_PROCID": "0", "SLURM_CPUS_PER_TASK": "x"}, False),
    # torchrun inside an srun task: its ranks share the task's mask
    ({"SLURM_PROCID": "0", "SLURM_CPU_BIND_TYPE": "mask_cpu:", "TORCHELASTIC_RUN_ID": "r"}, False),
])
def test_a_slurm_bound_task_keeps_its_own_cpus(bare_env, env, own):
    """srun --ntasks-per-node=4 --cpus-per-task=8: each task's mask holds its own 8 CPUs; dividing
    it by the 4 ranks of the node gave 2 threads."""
    for key, value in env.items():
        bare_env.setenv(key, value)
    assert slurm.task_has_own_cpus(8) == own


def test_threads_of_a_bound_srun_task_are_its_whole_mask():
    result: dict[str, int] = {}

    def pinned() -> None:
        os.sched_setaffinity(0, set(sorted(os.sched_getaffinity(0))[:2]))  # at most 2 CPUs
        result["own"] = cpu_threads(4, own_mask=True)
        result["shared"] = cpu_threads(4)

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    usable = min(2, len(os.sched_getaffinity(0)))
    assert result == {"own": usable, "shared": 1}


def test_a_checkpoint_state_is_copied_to_the_cpu_keeping_its_structure():
    t = torch.arange(3.0)
    tree = {"a": [t, (t, 2)], "b": {"c": "x"}}
    out = to_cpu(tree)
    assert out["a"][1][1] == 2 and out["b"] == {"c": "x"} and isinstance(out["a"][1], tuple)
    assert torch.equal(out["a"][0], t) and out["a"][0].device.type == "cpu"


@pytest.mark.parametrize("requeue, code", [(True, 0), (False, 0), (True, 1)])
def test_a_preempted_slurm_run_requeues_once_unless_told_not_to(bare_env, tmp_path, capsys,
                                                                  requeue, code):
    bin_dir, record = fake_scontrol(tmp_path, code)
    bare_env.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    bare_env.setenv("SLURM_JOB_ID", "4242")
    summary = {"stopped_by": "SIGUSR1", "optimizer_steps": 7, "checkpoint": "c.pt"}
    with pytest.raises(SystemExit) as e:
        stopped(tmp_path, summary, requeue)
    assert e.value.code == 128 + signal.SIGUSR1
    err = capsys.readouterr().err
    assert "stopped by SIGUSR1 after optimizer step 7; checkpoint c.pt" in err
    if not requeue:
        assert not record.exists() and "continue with: gradsync-train resume=auto" in err
    else:
        assert record.read_text() == "requeue 4242\n"
        assert ("requeued SLURM job 4242" if code == 0 else
                "scontrol requeue 4242 failed (exit code 1)") in err
    # SIGTERM keeps today's checkpoint-and-stop: no requeue
    record.unlink(missing_ok=True)
    with pytest.raises(SystemExit):
        stopped(tmp_path, summary | {"stopped_by": "SIGTERM"}, True)
    assert not record.exists()
