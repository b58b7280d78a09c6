"""Every option of every config group composes against the schema and builds its object; bad
input fails with one line, exit code 2, no worker and no run dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

from gradsync.config import ConfigError, register_configs, validate
from gradsync.data import build_data
from gradsync.lr_schedulers import build_lr_scheduler
from gradsync.models import build_model
from gradsync.policies import build_policy
from gradsync.precision import Precision
from gradsync.schedules import build_schedule
from gradsync.train import CONF_DIR, compose_plain

register_configs()
GROUPS = ["model", "optimizer", "schedule", "sync", "precision", "data", "trainer",
          "lr_scheduler", "loss"]
# token data and the transformer only go together
COMPANIONS = {("data", "synthetic_lm"): "model=transformer",
              ("model", "transformer"): "data=synthetic_lm"}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


ALL = [(g, o) for g in GROUPS for o in options(g)]


@pytest.mark.parametrize("group,option", ALL, ids=[f"{g}={o}" for g, o in ALL])
def test_every_option_composes_validates_and_builds(group, option):
    overrides = [f"{group}={option}"]
    if (group, option) in COMPANIONS:
        overrides.append(COMPANIONS[group, option])
    if group == "schedule" and option == "global_batch":
        overrides.append("schedule.global_batch_size=64")  # 2 ranks x micro 16 x 2
    cfg = compose_plain(overrides)
    validate(cfg, cuda_available=False)
    data = build_data({**cfg["data"], **({"num_samples": 64} if "num_samples" in cfg["data"]
                                         else {})}, cfg["seed"])
    model = build_model(cfg["model"], data.in_dim, data.out_dim, data.max_len)
    x, _ = (data.collate or default_collate)([data.train[i] for i in range(4)])
    out = model(x)
    assert (out.shape[0], out.shape[-1]) == (4, data.out_dim)
    from gradsync.config import build_optimizer

    opt = build_optimizer(cfg["optimizer"], model.parameters())
    assert type(opt).__name__.lower() == cfg["optimizer"]["_target_"].split(".")[-1].lower()
    assert opt.param_groups[0]["lr"] == cfg["optimizer"]["lr"]
    sched = build_lr_scheduler(cfg["lr_scheduler"], opt, total_steps=10)
    assert sched.get_last_lr()[0] > 0
    schedule = build_schedule(cfg["schedule"], world_size=2,
                              micro_batch_size=cfg["data"]["micro_batch_size"])
    assert schedule.accum_steps(0) >= 1
    assert build_policy(cfg["sync"]).name == cfg["sync"]["name"]
    assert Precision(cfg["precision"]["name"], "cpu").name == cfg["precision"]["name"]


def test_default_experiment_is_digits_mlp_two_workers_accumulate_4_fp32():
    cfg = compose_plain([])
    assert (cfg["data"]["name"], cfg["model"]["name"], cfg["trainer"]["devices"]) == \
        ("digits", "mlp", 2)
    assert (cfg["sync"]["name"], cfg["schedule"]["accum_steps"], cfg["precision"]["name"]) == \
        ("accumulate", 4, "fp32")


def test_global_batch_schedule_derives_n_from_world_and_micro_batch():
    cfg = compose_plain(["schedule=global_batch", "schedule.global_batch_size=96",
                         "data.micro_batch_size=8", "trainer.devices=3"])
    validate(cfg, cuda_available=False)
    assert build_schedule(cfg["schedule"], 3, 8).accum_steps(0) == 4
    cfg["schedule"]["global_batch_size"] = 100
    with pytest.raises(ConfigError, match="schedule.global_batch_size.*3 x 8 = 24"):
        validate(cfg, cuda_available=False)


def test_nccl_without_cuda_is_refused():
    cfg = compose_plain(["trainer.backend=nccl"])
    with pytest.raises(ConfigError, match="trainer.backend"):
        validate(cfg, cuda_available=False)


BAD = [
    (["schedule.accum_steps=0"], "schedule.accum_steps=0 is not allowed: an integer >= 1"),
    (["schedule.accum_steps=-3"], "schedule.accum_steps=-3 is not allowed"),
    (["schedule=global_batch", "schedule.global_batch_size=100"],
     "schedule.global_batch_size=100 is not allowed: a positive multiple of world_size x "
     "data.micro_batch_size = 2 x 16 = 32"),
    (["trainer.devices=0"], "trainer.devices=0 is not allowed: an integer >= 1"),
    (["data.micro_batch_size=0"], "data.micro_batch_size=0 is not allowed"),
    (["sync=foo"], "sync=foo: no such option; choose one of: accumulate, always"),
    (["trainer.foo=1"], "trainer.foo: unknown key; allowed keys: devices, max_steps"),
    (["+bogus=1"], "bogus: unknown key; allowed keys: data, loss, lr_scheduler"),
    (["schedule.accum_steps=abc"], "schedule.accum_steps: Value 'abc'"),
    (["trainer.backend=mpi"], "trainer.backend='mpi' is not allowed: one of auto, gloo, nccl"),
    (["sync=amp_aware", "sync.comm_dtype=int8"],
     "sync.comm_dtype='int8' is not allowed: one of bf16, fp16, fp32"),
    (["sync=amp_aware", "sync.comm_dtype=fp16"],
     "sync.comm_dtype='fp16' needs precision=fp16, not 'fp32'"),
    (["data=synthetic_lm"],
     "model='mlp' is not allowed: data=synthetic_lm (token data) needs model=transformer"),
    (["loss.normalize=tokens"], "loss.normalize='tokens' needs token data (data=synthetic_lm); "
     "data=digits has samples: use auto or samples"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(args, expected, tmp_path, cli_env):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.train", *args, f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("gradsync: config error: ")
    assert expected in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not run_dir.exists()  # no run dir left, so no worker ever started


def test_torch_is_pinned_in_the_lock_and_a_range_in_pyproject():
    repo = Path(CONF_DIR).parent
    assert "torch==2.13.0" in (repo / "requirements.lock").read_text().splitlines()
    assert '"torch>=' in (repo / "pyproject.toml").read_text()
    assert torch.__version__.startswith("2.")


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_optimizer_fused_builds_torchs_fused_kernel_with_sgds_same_bits(opt):
    from gradsync.config import build_optimizer
    from gradsync.models import MLP

    params = {}
    for fused in (None, True):
        cfg = compose_plain([f"optimizer={opt}"] + (["optimizer.fused=true"] if fused else []))
        validate(cfg, cuda_available=False)
        torch.manual_seed(0)
        model = MLP(8, [16], 4, "tanh")
        optim = build_optimizer(cfg["optimizer"], model.parameters())
        assert optim.defaults["fused"] == fused
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for q in model.parameters():
                q.grad = torch.randn(q.shape, generator=g)
            optim.step()
        params[fused] = torch.cat([q.detach().flatten() for q in model.parameters()])
    moved = (params[True] - params[None]).abs().max()
    if opt == "sgd":
        assert moved == 0  # the same bits: fused is a free speed-up for SGD
    else:
        assert moved < 1e-6
