"""network=shaped (run/network.py): ranks in network namespaces of their own over tc-shaped veth
links, and gradsync-project (run/project.py). The jobs need root, ip and tc (the project's
machines and CI have them); elsewhere they are skipped with the reason."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli_jobs import Job, entry_point_error
from gradsync.config.validate import ConfigError
from gradsync.run import network, project
from gradsync.run.network import NetworkConfig, network_config, rate_bits, run_names, seconds

ROOT_IP_TC = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
needs_root = pytest.mark.skipif(not ROOT_IP_TC, reason="network=shaped needs root, ip and tc")
TINY = ["trainer.devices=2", "trainer.max_steps=4", "trainer.checkpoint_every_steps=0",
        "logger=csv"]


def traces(pid: int) -> list[str]:
    """What a shaped run of launcher `pid` left: its namespaces and links (ip netns, ip link)."""
    netns, links = run_names()
    return [n for n in netns + links if n.startswith(f"gs{pid}") and n[len(f"gs{pid}")] in "brhn"]


def test_rates_and_times_read_as_tc_writes_them():
    assert rate_bits("100mbit") == 100e6
    assert rate_bits("1gbit") == 1e9 and rate_bits("2.5kbit") == 2500
    assert rate_bits("10mbps") == 80e6  # tc's bps: bytes per second
    for bad in ("fast", "100", "-1mbit", "0mbit", "1 gb"):
        with pytest.raises(ValueError):
            rate_bits(bad)
    assert seconds("5us") == pytest.approx(5e-6) and seconds("2ms") == pytest.approx(2e-3)
    assert seconds("0") == 0 and seconds("1.5s") == 1.5


@pytest.mark.parametrize("node,expected", [
    ({"name": "shaped", "rate": "fast"}, "network.rate='fast': a tc rate"),
    ({"name": "shaped", "rate": "1kbit"}, "at least 8kbit"),
    ({"name": "shaped", "delay": "soon"}, "network.delay='soon': a time"),
    ({"name": "wifi"}, "network.name='wifi' is not allowed"),
    ({"name": "shaped", "mtu": 9000}, "network.mtu"),
])
def test_bad_settings_are_one_line(node, expected):
    with pytest.raises(ConfigError, match=None) as e:
        network_config(node)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_a_delay_without_netem_names_the_projection(monkeypatch):
    monkeypatch.setattr(network, "netem_available", lambda: False)
    with pytest.raises(ConfigError, match="no netem.*gradsync-project"):
        network_config({"name": "shaped", "delay": "5ms"})
    assert network_config({"name": "shaped", "delay": "0ms"}).shaped


@pytest.mark.parametrize("world,backend,spawns,expected", [
    (1, "gloo", True, "trainer.devices=1 is not allowed: 2 to 16 ranks"),
    (17, "gloo", True, "trainer.devices=17"),
    (2, "nccl", True, "CPU ranks on gloo only"),
    (2, "gloo", False, "started by gradsync-train itself"),
])
def test_a_job_the_links_cannot_carry_is_refused(world, backend, spawns, expected):
    with pytest.raises(ConfigError) as e:
        NetworkConfig("shaped").check_job(world, backend, spawns)
    assert expected in str(e.value)
    NetworkConfig("local").check_job(world, backend, spawns)  # local: anything goes


def test_shared_memory_is_refused_and_auto_goes_over_the_process_group():
    engine, said = network.process_group_engine({"name": "torch_ddp", "allreduce": "auto"})
    assert engine["allreduce"] == "process_group" and "process_group" in said
    assert network.process_group_engine({"name": "fsdp"}) == ({"name": "fsdp"}, None)
    with pytest.raises(ConfigError, match="bypass the links"):
        network.process_group_engine({"name": "gradsync", "allreduce": "shared_memory"})


def entry_point_refusal(argv: list[str], tmp_path: Path, monkeypatch, capsys) -> str:
    """gradsync-train in this process: exit 2, one line, no run dir, nothing of the network."""
    line = entry_point_error(argv, Path.cwd(), tmp_path, monkeypatch, capsys)
    if ROOT_IP_TC:
        assert traces(os.getpid()) == []
    return line


@pytest.mark.parametrize("argv,expected", [
    (["network=shaped", "network.rate=fast"], "network.rate='fast'"),
    (["network=shaped", "trainer.devices=1"], "trainer.devices=1 is not allowed"),
    (["network=shaped", "engine.allreduce=shared_memory"], "bypass the links"),
    (["network=shaped", "network.delay=nonsense"], "network.delay='nonsense'"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(argv, expected, tmp_path, monkeypatch,
                                                         capsys):
    assert expected in entry_point_refusal(argv, tmp_path, monkeypatch, capsys)


def test_without_root_one_line_says_what_is_needed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    line = entry_point_refusal(["network=shaped"], tmp_path, monkeypatch, capsys)
    assert "network=shaped needs root" in line


def test_without_ip_or_tc_one_line_names_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(network.shutil, "which", lambda tool: None if tool == "tc" else tool)
    line = entry_point_refusal(["network=shaped"], tmp_path, monkeypatch, capsys)
    assert "network=shaped needs tc (iproute2) on PATH" in line


@needs_root
def test_a_name_in_use_ends_the_start_in_one_line_and_removes_what_it_made(tmp_path,
                                                                           monkeypatch, capsys):
    """Another tool's namespace under the name the run would give its rank 1 (the start
    removes a dead launcher's names and its own pid's; here it is told not to): exit 2, one
    line naming it, the bridge, rank 0's namespace and link removed, the other's kept."""
    from gradsync.run import main as entry

    theirs = f"gs{os.getpid()}r1"
    monkeypatch.setattr(network, "remove_leftovers", lambda own_pid=None: [])
    monkeypatch.setattr(sys, "argv", ["gradsync-train", "network=shaped", *TINY,
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    subprocess.run(["ip", "netns", "add", theirs], check=True)
    try:
        with pytest.raises(SystemExit) as exit_:
            entry.main()
        assert exit_.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        # the run's first line (which all-reduce it takes), then the refusal: one line
        assert len(lines) == 2 and "engine.allreduce=process_group" in lines[0], lines
        assert f"network refused: network=shaped: netns {theirs} already exists" in lines[1]
        assert traces(os.getpid()) == [theirs]
    finally:
        subprocess.run(["ip", "netns", "delete", theirs], check=False)


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in
            (run_dir / "metrics.jsonl").read_text().splitlines()]


@needs_root
@pytest.mark.slow
def test_a_killed_launchers_links_go_at_the_next_start_which_trains_the_same_bits(tmp_path,
                                                                                  cli_env):
    """kill -9 of a shaped run's launcher leaves its namespaces and links (nothing runs to
    remove them); the next shaped start removes them, and trains exactly as network=local with
    the process group's all-reduce, its links carrying at least the engine's bytes."""
    host_cc = network.TCP_CC.read_text().strip()
    dead = Job(tmp_path / "dead", ["network=shaped", "network.rate=20mbit", "sync=always",
                                   "trainer.devices=2", "trainer.max_steps=1000",
                                   "trainer.checkpoint_every_steps=0", "logger=csv"], cli_env)
    dead.wait_for_step(1)
    assert len(traces(dead.proc.pid)) == 1 + 2 + 2  # the bridge; per rank a netns, a host end
    # TCP in the ranks' namespaces is reno (steady over tbf); the host's own stays as it was
    cc = subprocess.run(["ip", "netns", "exec", f"gs{dead.proc.pid}r1", "cat",
                         str(network.TCP_CC)], capture_output=True, text=True,
                        check=True).stdout.strip()
    assert cc == "reno" and network.TCP_CC.read_text().strip() == host_cc
    os.kill(dead.proc.pid, signal.SIGKILL)  # the launcher only: its ranks die with it
    assert dead.finish()[0] == -signal.SIGKILL
    assert dead.survivors() == []
    assert traces(dead.proc.pid)  # left behind

    shaped = Job(tmp_path / "shaped", ["network=shaped", "network.rate=1gbit", "sync=always",
                                       *TINY], cli_env)
    code, _, err = shaped.finish()
    assert code == 0, err
    assert "engine.allreduce=process_group" in err
    assert traces(dead.proc.pid) == [] and traces(shaped.proc.pid) == []
    local = Job(tmp_path / "local", ["engine.allreduce=process_group", "sync=always", *TINY],
                cli_env)
    assert local.finish()[0] == 0
    s, ref = (json.loads((d / "summary.json").read_text()) for d in (tmp_path / "shaped",
                                                                     tmp_path / "local"))
    assert _losses(tmp_path / "shaped") == _losses(tmp_path / "local")
    assert s["eval"] == ref["eval"] and s["final_train_loss"] == ref["final_train_loss"]
    assert s["allreduce"] == "process_group" and ref["network"] == {"name": "local"}
    net = s["network"]
    assert net["name"] == "shaped" and net["rate_bits_per_s"] == 1e9
    engine = s["allreduce_bytes"]
    assert net["engine_bytes"] == engine and min(engine) > 1e6
    assert net["ring_bytes"] == engine  # 2 ranks: a ring sends the buffer once
    # the links' latency per hop, measured as the ranks joined: a 1-float all-reduce's time
    # over its 2 hops (tens of microseconds to a few ms here: the kernel, gloo, a wake-up)
    assert 1e-6 < net["hop_latency_s"] < 0.05
    for r in range(2):  # at least what the engine sent, and not much more than it (headers)
        assert engine[r] <= net["link_sent_bytes"][r] <= 1.15 * engine[r]
        assert engine[r] <= net["link_received_bytes"][r] <= 1.15 * engine[r]


@needs_root
@pytest.mark.slow
def test_a_rate_limits_what_a_sync_costs(tmp_path, cli_env):
    """At 20mbit the 4 steps' 1.7 MB of all-reduces per rank (sync=accumulate, N=4) take about
    0.7 s over the link; at 1gbit they would take 14 ms: the shaped run's training seconds
    show it, as the projection of the same run does."""
    job = Job(tmp_path / "slow", ["network=shaped", "network.rate=20mbit", *TINY], cli_env)
    code, _, err = job.finish()
    assert code == 0, err
    s = json.loads((tmp_path / "slow" / "summary.json").read_text())
    wire_s = s["allreduce_bytes"][0] * 8 / 20e6  # 2 ranks: each sends the buffer once
    assert s["train_s"] >= 0.9 * wire_s
    assert not traces(job.proc.pid)


@needs_root
@pytest.mark.slow
def test_a_sweep_runs_each_engine_on_fresh_links(tmp_path, cli_env):
    """One shaped sweep over gradsync's own engine and FSDP (its reduce-scatters and
    all-gathers), one job after another: each job's links, made for it,
    carry what a ring sends of that job's collectives (and not much more), each job measured
    its own latency, and nothing of any job is left."""
    sweep = tmp_path / "sweep"
    job = Job(sweep, ["-m", f"hydra.sweep.dir={sweep}", "network=shaped", "network.rate=1gbit",
                      "engine=gradsync,fsdp", "sync=always", *TINY], cli_env,
              name_run_dir=False)
    code, _, err = job.finish()
    assert code == 0, err
    assert not traces(job.proc.pid)
    jobs = [json.loads((sweep / str(j) / "summary.json").read_text()) for j in (0, 1)]
    assert [s["engine"]["name"] for s in jobs] == ["gradsync", "fsdp"]
    for s in jobs:
        net = s["network"]
        assert net["name"] == "shaped" and 1e-6 < net["hop_latency_s"] < 0.05
        assert min(net["ring_bytes"]) > 1e4
        for r in range(2):  # counted from this job's links' start: not the job before's
            assert net["ring_bytes"][r] <= net["link_sent_bytes"][r] \
                <= 1.2 * net["ring_bytes"][r] + 2e5
    fsdp = jobs[1]  # 2 ranks: gloo's reduce-scatter all-reduces the buffer, sent once; a
    # ring all-gather sends half of what it gathers
    scatter, gather = fsdp["reduce_scatter_bytes"][0], fsdp["all_gather_bytes"][0]
    assert scatter > 0 and gather > 0 and fsdp["allreduce_bytes"][0] == 0
    assert fsdp["network"]["ring_bytes"][0] == round(scatter + gather / 2)


@needs_root
@pytest.mark.slow
def test_hsdp_on_4_ranks_sends_each_collective_within_its_group(tmp_path, cli_env):
    """HSDP, 2 replicas of 2 shards: reduce-scatters and all-gathers within a replica, the
    all-reduce across the replicas, each a ring of 2 on the links."""
    job = Job(tmp_path / "hsdp", ["network=shaped", "network.rate=1gbit", "engine=hsdp",
                                  "engine.replicas=2", *TINY, "trainer.devices=4"], cli_env)
    code, _, err = job.finish()
    assert code == 0, err
    assert not traces(job.proc.pid)
    s = json.loads((tmp_path / "hsdp" / "summary.json").read_text())
    assert s["engine"]["mesh"] == {"replicate": 2, "shard": 2}
    reduced, scatter, gather = (s[k][0] for k in ("allreduce_bytes", "reduce_scatter_bytes",
                                                 "all_gather_bytes"))
    assert min(reduced, scatter, gather) > 0
    net = s["network"]
    assert net["ring_bytes"] == [round(reduced + scatter + gather / 2)] * 4
    for r in range(4):
        assert net["ring_bytes"][r] <= net["link_sent_bytes"][r] <= 1.2 * net["ring_bytes"][r]


# --- the projection -----------------------------------------------------------------------

def _summary(tmp: Path, name: str, overrides: tuple[str, ...] = ("sync=always",),
             **over) -> Path:
    """A finished job's dir as gradsync-train leaves it: summary.json and Hydra's record (its
    number: the name's, if a number; its overrides). 10 steps of 4 micro-batches of 16 samples
    on 2 ranks."""
    s = {"status": "completed", "optimizer_steps": 10, "windows": 10, "window_size": 4,
         "world_size": 2, "sync_policy": "always", "engine": {"name": "torch_ddp"},
         "allreduce_bytes": [10 * 4 * 1_000_000] * 2, "allreduce_calls": [10 * 4 * 2] * 2,
         "train_s": 2.0, "micro_batch_size": 16, "samples_seen": 10 * 128,
         "network": {"name": "local"}} | over
    run = tmp / name
    (run / ".hydra").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(s))
    (run / ".hydra" / "hydra.yaml").write_text(json.dumps({"hydra": {
        "job": {"num": int(name) if name.isdigit() else 0},
        "overrides": {"task": list(overrides)}}}))
    return run


def _evals(run: Path, *at: tuple[int, float]) -> None:
    """evals.jsonl: (step, loss) at 128 samples a step."""
    (run / "evals.jsonl").write_text("".join(json.dumps({"step": step, "samples": step * 128,
                                                         "loss": loss}) + "\n"
                                             for step, loss in at))


def _read(run: Path) -> project.RunFacts:
    [facts] = project.read_runs(run)
    return facts


def test_the_projection_is_the_ring_formulas(tmp_path):
    """always, N=4, 1 MB in 2 buckets per micro-batch, 2.0 s for 10 steps on a local run."""
    run = _read(_summary(tmp_path, "0"))
    link = project.LinkSpec.parse("10gbit,5us")
    assert (link.bits_per_s, link.latency_s) == (1e10, pytest.approx(5e-6))
    assert run.compute_per_micro_s == pytest.approx(0.2 / 4)
    p, b, L = 64, 1.25e9, 5e-6
    f = 1 + 1.5 * 66 / 1448  # the headers of a full TCP segment, half as many ACKs
    comm = 2 * (p - 1) / p * 4e6 * f / b + 8 * 2 * (p - 1) * L
    assert run.comm_s(p, link) == pytest.approx(comm)
    assert run.step_s(p, link) == pytest.approx(0.2 + comm)
    assert run.step_s(1, link) == pytest.approx(0.2)


def test_a_shaped_runs_own_link_is_taken_out_of_its_compute(tmp_path):
    """Its rate's bytes and, per hop, the latency the run measured on its links as it began
    (8 all-reduces of 2 hops a step)."""
    shaped = _summary(tmp_path, "s", network={"name": "shaped", "rate": "100mbit",
                                               "rate_bits_per_s": 1e8, "delay": "0ms",
                                               "hop_latency_s": 2e-4},
                    train_s=5.0)
    run = _read(shaped)
    own = 2 * 1 / 2 * 4e6 * (1 + 99 / 1448) / 12.5e6 + 8 * 2 * 2e-4
    assert run.own_link is not None and run.own_link.latency_s == 2e-4
    assert run.compute_per_micro_s == pytest.approx((0.5 - own) / 4)


def test_sharded_collectives_are_half_rings(tmp_path):
    run = _read(_summary(tmp_path, "f", allreduce_bytes=[0, 0], allreduce_calls=[0, 0],
                                    reduce_scatter_bytes=[10 * 3e6] * 2,
                                    all_gather_bytes=[10 * 3e6] * 2,
                                    reduce_scatter_calls=[10] * 2, all_gather_calls=[10] * 2))
    link = project.LinkSpec.parse("1gbit,1ms")
    p = 8
    f = 1 + 99 / 1448
    assert run.comm_s(p, link) == pytest.approx(7 / 8 * 6e6 * f / 1.25e8 + 2 * 7 * 1e-3)
    # as gloo issues them (a shaped run's own link): the reduce-scatter is an all-reduce
    assert run.comm_s(p, link, gloo=True) == pytest.approx(
        (2 * 7 / 8 * 3e6 + 7 / 8 * 3e6) * f / 1.25e8 + (2 * 7 + 7) * 1e-3)


def test_a_sweep_gets_a_row_per_job_and_the_fastest_marked(tmp_path, capsys):
    _summary(tmp_path, "0")
    _summary(tmp_path, "1", ("sync=accumulate",), sync_policy="accumulate",
             allreduce_bytes=[10 * 1_000_000] * 2, allreduce_calls=[20] * 2)
    project.main([str(tmp_path), "--ranks", "2,64", "--link", "100mbit,50us"])
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "projection.json").read_text())["rows"]
    a, b = "0 sync=always", "1 sync=accumulate"
    assert [(r["run"], r["ranks"]) for r in rows] == [(a, 2), (b, 2), (a, 64), (b, 64)]
    # samples/s: p ranks x 4 micro-batches of 16 samples per projected step
    assert rows[2]["samples_per_s"] == pytest.approx(64 * 4 * 16 / rows[2]["step_s"])
    assert all(r.get("fastest") == (r["run"] == b) for r in rows)
    assert f"{b} * | accumulate | 100mbit,50us | 64" in out


@pytest.mark.parametrize("argv,expected", [
    (["--ranks", "8,x"], "--ranks '8,x'"),
    (["--link", "fast"], "--link 'fast'"),
])
def test_projection_bad_input_is_one_line_exit_2(argv, expected, tmp_path, capsys):
    run = _summary(tmp_path, "0")
    with pytest.raises(SystemExit) as e:
        project.main([str(run), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]
    with pytest.raises(SystemExit):
        project.main([str(tmp_path / "nothing")])
    assert "neither a run dir nor a sweep dir" in capsys.readouterr().err



def test_time_to_target_is_the_runs_steps_to_it_at_the_projected_step(tmp_path):
    """The steps to the target loss as the sweep summary reads them (the samples to it,
    interpolated between evaluations), at the projected step."""
    _evals(_summary(tmp_path, "0"), (5, 2.0), (10, 1.0))
    _evals(_summary(tmp_path, "1", ("sync=accumulate",), sync_policy="accumulate",
                    allreduce_bytes=[10 * 1e6] * 2, allreduce_calls=[20] * 2), (10, 1.5))
    runs = project.read_runs(tmp_path)
    link = project.LinkSpec.parse("100mbit")
    rows = project.project(runs, [64], [link], target=1.5)
    assert rows[0]["time_to_target_s"] == pytest.approx(7.5 * runs[0].step_s(64, link))
    assert rows[1]["time_to_target_s"] == pytest.approx(10 * runs[1].step_s(64, link))
    assert [r["fastest"] for r in rows] == [False, True]  # fewer steps, a dearer step each
    assert project.project(runs, [64], [link], target=0.5)[0]["time_to_target_s"] is None
    # a job killed as it wrote an evaluation: its torn last line is left out, the rest read
    with open(tmp_path / "1" / "evals.jsonl", "a") as f:
        f.write('{"step": 12, "samples": 1536, "lo')
    assert project.read_runs(tmp_path)[1].steps_to(1.5) == 10


def test_a_sweeps_jobs_are_named_by_what_sets_them_apart(tmp_path):
    for job, race in (("0", "always"), ("1", "local_sgd_h8")):
        _summary(tmp_path, job, ("experiment=policy_race", f"+experiment/race={race}",
                                 "network=shaped"))
    _summary(tmp_path, "2", ("experiment=policy_race", "+experiment/race=diloco_h16"),
             status="failed")  # no row: nothing to project
    runs = project.read_runs(tmp_path)
    assert [r.name for r in runs] == ["0 +experiment/race=always",
                                      "1 +experiment/race=local_sgd_h8"]
