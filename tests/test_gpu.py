"""On a CUDA machine only (skipped, saying so, elsewhere; `make gpu-check` runs them and more):
every policy on 2 ranks sharing one GPU through a default group made as "cuda:gloo" (which, like
nccl, serves CUDA tensors only) and on a 1-rank nccl group, each resumed bitwise, with the
checks and log steps that crashed on nccl (faults 1-4 of issue 22); no host sync in the hot
path; PowerSGD leaves the CUDA generator alone; a GPU run's checkpoint holds only CPU tensors
and each rank's own RNG state; more ranks than GPUs is a config error. The nccl cases run in a
process of their own (a fresh CUDA state, their own group)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpu_cases
from dist_pool import DistPool

# every test here starts a job process or a pool of its own (gpu_pool2): slow (conftest.py)
pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="CUDA absent: GPU tests run only where torch sees a GPU (make gpu-check)")]

CASES = Path(__file__).with_name("gpu_cases.py")
TINY = ["data=synthetic", "data.num_samples=256", "trainer.max_steps=6",
        "trainer.progress_bar=false", "trainer.backend=nccl", "trainer.checkpoint_every_steps=3"]


def case(cli_env: dict, *args: str) -> dict:
    done = subprocess.run([sys.executable, str(CASES), *args], capture_output=True, text=True,
                          env=cli_env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def native_bf16() -> bool:
    return torch.cuda.get_device_capability(0) >= (8, 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_no_host_sync_in_the_hot_path_outside_logging_steps(cli_env, precision):
    if precision == "bf16" and not native_bf16():
        pytest.skip("this GPU only emulates bf16 (compute capability < 8.0)")
    out = case(cli_env, "hot_path", precision)
    assert out["windows"] >= 10 and out["finite"]


@pytest.fixture(scope="module")
def gpu_pool2():
    pool = DistPool(2, backend="cuda:gloo", setup="gpu_cases:gpu_rank")
    yield pool
    pool.close()


@pytest.mark.parametrize("policy", list(gpu_cases.POLICIES))
def test_every_policy_on_two_ranks_sharing_a_gpu_resumes_bitwise(gpu_pool2, tmp_path, policy):
    """A CPU tensor handed to the default group fails here as on nccl ("No backend type
    associated with device type cpu"): the drift's MAX all-reduce (local SGD, DiLoCo) and
    check_replicas' gather run at every step; the resumed local SGD / DiLoCo average on the
    anchor the checkpoint held; mixed wires read what the all-reduce produced."""
    r0, _ = gpu_pool2.run(gpu_cases.resumed_bitwise, policy, str(tmp_path), timeout=600)
    assert r0["device"] == torch.cuda.get_device_name(0)
    assert r0["windows"] == 10 and r0["resumed_from"]  # 2 epochs of 5 windows
    if policy not in gpu_cases.NOT_BITWISE:
        assert r0["params_differ"] == [] and r0["rows_equal"]
    if policy in ("local_sgd", "diloco"):
        assert r0["drift_rows"] >= 3


def test_one_rank_nccl_every_policy_resumes_bitwise(cli_env, tmp_path):
    out = case(cli_env, "one_rank_nccl_resumed", str(tmp_path))
    assert sorted(out) == sorted(gpu_cases.POLICIES)
    for policy, r in out.items():
        assert r["resumed_from"] and r["windows"] == 18, policy  # 2 epochs of 9 windows
        if policy not in gpu_cases.NOT_BITWISE:
            assert r["params_differ"] == [] and r["rows_equal"], policy


def test_mixed_wires_read_the_reduced_buffer_on_a_gpu(gpu_pool2):
    """Fault 4 with a bucket large enough that gloo's copy back to the GPU takes a while."""
    out = gpu_pool2.run(gpu_cases.grouped_mean, 1 << 22)
    assert out == [{"all_mean": True, "numel": (1 << 22) * 4 + 4}] * 2


def test_powersgd_leaves_the_cuda_generator_alone(cli_env):
    assert case(cli_env, "powersgd_rng") == {"unchanged": [True] * 4}


def tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


def test_a_gpu_run_checkpoints_cpu_tensors_and_each_rank_its_own_rng(tmp_path, cli_env):
    n = min(2, torch.cuda.device_count())
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "gradsync.run.main", *TINY,
                           f"trainer.devices={n}", "model.dropout=0.1",
                           "trainer.deterministic=true", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=cli_env, timeout=300)
    assert done.returncode == 0, done.stderr
    # no map_location: it opens as it is
    ckpt = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert {t.device.type for t in tensors(ckpt)} == {"cpu"}
    assert [len(r["rng"]["cuda"]) for r in ckpt["ranks"]] == [1] * n
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["device"] == torch.cuda.get_device_name(0)
    assert len(summary["peak_gpu_mem_mb"]) == n and min(summary["peak_gpu_mem_mb"]) > 0
    for rank in range(n):
        log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert f"device=cuda:{rank}" in log


def test_more_ranks_than_gpus_is_a_one_line_config_error(tmp_path, cli_env):
    n = torch.cuda.device_count()
    done = subprocess.run([sys.executable, "-m", "gradsync.run.main", *TINY,
                           f"trainer.devices={n + 1}", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=cli_env, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"gradsync: config error: {n + 1} ranks on this node need one GPU each on nccl, but "
        f"{n} GPU{'s' if n != 1 else ''} visible" + (
            f" (CUDA_VISIBLE_DEVICES={cli_env['CUDA_VISIBLE_DEVICES']})"
            if "CUDA_VISIBLE_DEVICES" in cli_env else "")
        + ": start at most that many ranks per node (trainer.devices, --nproc-per-node, "
        "--ntasks-per-node), or use trainer.backend=gloo")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("srun", [False, True])
def test_two_ranks_on_one_gpu_stop_in_one_line_not_in_nccl(tmp_path, cli_env, srun):
    """Issue 32 fault 2 on a GPU: two env:// ranks that see only the first GPU. torchrun's
    ranks share that view: a config error on each (exit 2) before anything starts. srun tasks
    may have views of their own, so each takes its cuda:0: the ranks find they share one GPU
    before nccl's first collective and stop (exit 1) in one line, not in "Duplicate GPU
    detected" at DDP's first broadcast."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    first = cli_env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    procs = []
    for rank in (0, 1):
        env = cli_env | {"CUDA_VISIBLE_DEVICES": first, "RANK": str(rank), "WORLD_SIZE": "2",
                         "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        if srun:
            env["GRADSYNC_SRUN_TASK"] = "1"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gradsync.run.main", *TINY, "trainer.timeout_s=60",
             f"hydra.run.dir={tmp_path / 'run'}"], env=env, stderr=subprocess.PIPE, text=True))
    errs = [p.communicate(timeout=240)[1] for p in procs]
    codes = [p.returncode for p in procs]
    assert "Duplicate GPU" not in "".join(errs)
    if not srun:
        assert codes == [2, 2], errs
        said = "gradsync: config error: 2 ranks on this node need one GPU each on nccl, but 1 GPU"
    else:
        assert codes == [1, 1], errs
        said = "gradsync: training failed: "
    for e in errs:
        lines = [ln for ln in e.splitlines()
                 if ln.startswith("gradsync: ") and not ln.startswith("gradsync: run dir: ")]
        assert len(lines) == 1 and lines[0].startswith(said), e
        assert srun == ("were both placed on one GPU" in lines[0]), e


def test_bf16_is_refused_exactly_where_the_gpu_emulates_it(tmp_path, cli_env):
    done = subprocess.run([sys.executable, "-m", "gradsync.run.main", *TINY, "trainer.devices=1",
                           "precision=bf16", f"hydra.run.dir={tmp_path / 'run'}"],
                          capture_output=True, text=True, env=cli_env, timeout=300)
    if native_bf16():
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode == 2
        assert "precision.name='bf16' is not native on cuda:0" in done.stderr


@pytest.mark.parametrize("engine", ["torch_ddp", "gradsync"])
def test_sync_batchnorm_keeps_the_statistics_of_both_ranks_batches(gpu_pool2, engine):
    """engine.sync_batchnorm (issue 30): one window of 2 micro-batches (the first in no_sync),
    each rank its own 4 samples. With SyncBatchNorm both ranks hold the same buffers, and the
    running mean (momentum 0.1, from 0) is that of both ranks' 8 samples per forward:
    0.9 * 0.1 * m1 + 0.1 * m2; with BatchNorm each rank's follows its own 4 samples (DDP
    broadcasts rank 0's only before a forward that follows a synchronising one)."""
    import engine_cases

    def mean_of(xs: list[torch.Tensor], first) -> torch.Tensor:
        weight, bias = first
        return (torch.cat(xs).double() @ weight.double().T + bias.double()).mean(0)

    synced = gpu_pool2.run(engine_cases.batchnorm_statistics, engine, True, "cuda")
    plain = gpu_pool2.run(engine_cases.batchnorm_statistics, engine, False, "cuda")
    assert [o["norm"] for o in synced] == ["SyncBatchNorm"] * 2
    for name in synced[0]["buffers"]:
        assert torch.equal(synced[0]["buffers"][name], synced[1]["buffers"][name]), name
    first = synced[0]["first"]
    m = [mean_of([synced[r]["xs"][k] for r in (0, 1)], first) for k in (0, 1)]
    expected = 0.09 * m[0] + 0.1 * m[1]
    assert torch.allclose(synced[0]["buffers"]["norm.running_mean"].double(), expected,
                          atol=1e-5)
    for r in (0, 1):
        own = 0.09 * mean_of([plain[r]["xs"][0]], first) + 0.1 * mean_of([plain[r]["xs"][1]],
                                                                           first)
        assert torch.allclose(plain[r]["buffers"]["norm.running_mean"].double(), own, atol=1e-5)
    assert not torch.equal(plain[0]["buffers"]["norm.running_mean"],
                           plain[1]["buffers"]["norm.running_mean"])
