"""Per-layer sync control (sync.groups) on the pool's 2 real gloo ranks, through the worker's real
run_training: rules that change nothing train bitwise what no rules train; a bf16 group moves
exactly half its bytes and the rest the same; a group with `every: K` is bitwise equal across
ranks right after each averaging while the rest is equal at every step; `every: 1` with SGD +
momentum trains what no rules train up to rounding; bad rules are one-line config errors;
+inspect=params. (A job killed by SIGKILL between two averagings resumes bitwise:
tests/test_resume.py.)"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import layer_sync_cases
from configs import SAME, losses, plain_cfg
from gradsync.config.validate import ConfigError
from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight
from resume_harness import Run

pytestmark = [pytest.mark.dist]

# 104 samples, 2 ranks, micro 8: 7 micro-batches per rank and epoch, accum 2 -> windows 2,2,2,1;
# 3 epochs: 12 windows. MLP 8-16-2: 0.weight/0.bias (144 numbers), 2.weight/2.bias (34).
RUN = ["data=synthetic", "data.num_samples=104", "data.eval_samples=32", "data.in_dim=8",
       "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[16]",
       "model.activation=tanh", "lr_scheduler=none", "schedule.window_size=2",
       "trainer.max_epochs=3", "trainer.threads_per_worker=1", "trainer.progress_bar=false",
       "trainer.log_every_windows=5", "trainer.checkpoint_every_steps=0", "optimizer=sgd",
       "optimizer.lr=0.05", "optimizer.momentum=0.9"]
WINDOWS, FIRST, SECOND, BIASES, MATRICES = 12, 144, 34, 18, 160


def groups(*rules: str) -> str:
    return "sync.groups=[" + ", ".join("{" + r + "}" for r in rules) + "]"


BIASES_FP32 = groups('params: "*.bias", comm_dtype: fp32, name: biases')
BIASES_BF16 = groups('params: "*.bias", comm_dtype: bf16, name: biases')
# the first layer averaged every 4 windows (after windows 4, 8 and 12, the last);
# checkpoints after windows 3, 6, 9 fall between two averagings
EVERY_4 = [*RUN, groups('params: "0.*", every: 4, name: first'), "trainer.checkpoint_every_steps=3"]
AVERAGED = {4, 8, 12, "finish"}  # finish: nothing left to average
# its reference, shared with tests/test_resume.py (which kills a job of it between averagings)
EVERY_4_RUN = Run(tuple(EVERY_4), windows_per_epoch=4, keys=(*SAME, "allreduce_groups"),
                  record=layer_sync_cases.recorded_run)


def run(pool2, tmp_path_factory, overrides: list[str]) -> list[dict]:
    return pool2.run(layer_sync_cases.recorded_run, plain_cfg(overrides),
                     str(tmp_path_factory.mktemp("run")))


@pytest.fixture(scope="module")
def plain(pool2, tmp_path_factory):
    return run(pool2, tmp_path_factory, RUN)


@pytest.fixture(scope="module")
def biases_fp32(pool2, tmp_path_factory):
    return run(pool2, tmp_path_factory, [*RUN, BIASES_FP32])


@pytest.fixture(scope="module")
def every_4(references):
    return references.get(EVERY_4_RUN).ranks


def groups_of(r: dict) -> dict:
    return {g: (c["calls"], c["bytes"]) for g, c in r["summary"]["allreduce_groups"].items()}


def test_rules_that_change_nothing_train_bitwise_what_no_rules_train(plain, biases_fp32):
    ref, out = plain[0], biases_fp32[0]
    for name, value in ref["params"].items():
        assert torch.equal(out["params"][name], value), name
    assert losses(out["rows"]) == losses(ref["rows"])
    for key in ("allreduce_calls", "sync_backwards"):
        assert out["summary"][key] == ref["summary"][key] == [WINDOWS] * 2
    assert out["summary"]["allreduce_bytes"] == ref["summary"]["allreduce_bytes"] \
        == [WINDOWS * (FIRST + SECOND) * 4] * 2
    assert "allreduce_groups" not in ref["summary"]
    # one all-reduce per bucket carries both groups: each counts the call, and its own bytes
    assert groups_of(out) == {"biases": ([WINDOWS] * 2, [WINDOWS * BIASES * 4] * 2),
                              "rest": ([WINDOWS] * 2, [WINDOWS * MATRICES * 4] * 2)}
    # TensorBoard: comm/bytes/<group> at every log point (windows 5, 10 and the last)
    assert out["tb"]["comm/bytes/biases"] == [(w, w * BIASES * 4) for w in (5, 10, WINDOWS)]
    assert out["tb"]["comm/bytes/rest"] == [(w, w * MATRICES * 4) for w in (5, 10, WINDOWS)]
    assert not any(tag.startswith("comm/bytes/") for tag in ref["tb"])


def test_a_bf16_group_moves_exactly_half_its_bytes_and_the_rest_the_same(
        biases_fp32, pool2, tmp_path_factory):
    bf16 = run(pool2, tmp_path_factory, [*RUN, BIASES_BF16])
    fp32 = groups_of(biases_fp32[0])
    got = groups_of(bf16[0])
    assert got["biases"][1] == [b // 2 for b in fp32["biases"][1]] == [WINDOWS * BIASES * 2] * 2
    assert got["rest"] == fp32["rest"]
    # two wire dtypes in the one bucket: two all-reduces per synchronising backward
    assert bf16[0]["summary"]["allreduce_calls"] == [2 * WINDOWS] * 2
    assert bf16[0]["summary"]["allreduce_bytes"] == [WINDOWS * (BIASES * 2 + MATRICES * 4)] * 2
    # the replicas stay bitwise equal at every step, and bf16 rounding changed the training
    for (w0, a), (w1, b) in zip(bf16[0]["snaps"], bf16[1]["snaps"], strict=True):
        assert w0 == w1 and all(torch.equal(a[n], b[n]) for n in a), w0
    assert not torch.equal(bf16[0]["params"]["0.bias"], biases_fp32[0]["params"]["0.bias"])


def test_an_every_group_is_bitwise_equal_across_ranks_after_each_averaging_the_rest_always(
        every_4):
    r0, r1 = every_4
    assert [w for w, _ in r0["snaps"]] == [*range(1, WINDOWS + 1), "finish"]
    for (w, a), (_, b) in zip(r0["snaps"], r1["snaps"], strict=True):
        for name in ("2.weight", "2.bias"):  # all-reduced: equal at every step
            assert torch.equal(a[name], b[name]), (w, name)
        for name in ("0.weight", "0.bias"):  # each rank's own between averagings
            if w in AVERAGED:
                assert torch.equal(a[name], b[name]), (w, name)
            else:
                assert (a[name] - b[name]).abs().max() > 1e-6, (w, name)
    final = r0["snaps"][-1][1]
    for name, value in r0["params"].items():  # the checkpoint holds the consensus
        assert torch.equal(value, final[name]), name
    averagings = 3
    assert groups_of(r0) == {"first": ([averagings] * 2, [averagings * FIRST * 4] * 2),
                             "rest": ([WINDOWS] * 2, [WINDOWS * SECOND * 4] * 2)}
    assert r0["summary"]["allreduce_calls"] == [WINDOWS + averagings] * 2
    assert r0["summary"]["allreduce_bytes"] == [(WINDOWS * SECOND + averagings * FIRST) * 4] * 2
    # TensorBoard at each log point (every 5 windows, each checkpoint, the end): the averagings
    # done by then
    tb = r0["tb"]["comm/bytes/first"]
    assert [w for w, _ in tb] == [5, 6, 9, 10, WINDOWS]
    assert tb == [(w, w // 4 * FIRST * 4) for w, _ in tb]


def test_every_1_with_sgd_momentum_trains_what_no_rules_train_up_to_rounding(
        plain, pool2, tmp_path_factory):
    """Averaging is linear: the mean of the ranks' momentum buffers is DDP's buffer."""
    every_1 = run(pool2, tmp_path_factory, [*RUN, groups('params: "0.*", every: 1')])
    for name, value in plain[0]["params"].items():
        got = every_1[0]["params"][name]
        assert torch.allclose(got, value, rtol=1e-5, atol=1e-6), name
    assert not all(torch.equal(every_1[0]["params"][n], v)
                   for n, v in plain[0]["params"].items())  # really another path
    assert groups_of(every_1[0])["0.*"] == ([WINDOWS] * 2, [WINDOWS * FIRST * 4] * 2)


def test_fp16_an_overflow_in_an_every_group_on_one_rank_skips_the_step_on_both(
        pool2, tmp_path):
    """The averaged group's gradients are each rank's own: rank 1 alone finds an inf in them.
    Its GradScaler flags are MAX all-reduced, so rank 0 skips window 2 too and the all-reduced
    layer stays bitwise equal on both ranks (a step on one rank only would tear it apart)."""
    cfg = plain_cfg([*RUN, groups('params: "0.*", every: 4'), "precision=fp16"])
    r0, r1 = pool2.run(layer_sync_cases.recorded_run, cfg, str(tmp_path), 1, 2, "0.weight")
    s = r0["summary"]
    assert s["amp_skipped_steps"] == 1 and s["optimizer_steps"] == WINDOWS - 1
    assert s["overflow_flag_allreduces"] == [WINDOWS, WINDOWS]  # one per window
    for (w, a), (_, b) in zip(r0["snaps"], r1["snaps"], strict=True):
        assert torch.equal(a["2.weight"], b["2.weight"]), w
    for r in (r0, r1):  # window 2 moved nothing on either rank
        assert torch.equal(r["snaps"][0][1]["0.weight"], r["snaps"][1][1]["0.weight"])


# --- bad rules: one line each, before any worker starts ----------------------------------------
@pytest.mark.parametrize("overrides, message", [
    ([groups('params: "1.*", every: 2')],
     "sync.groups[0].params='1.*' matches no parameter of the model; the model's parameters, "
     "closest first: 0.bias, 2.bias, 0.weight, 2.weight"),
    ([groups('params: "*.bias"', 'params: "0.bias", comm_dtype: bf16')],
     "sync.groups[1].params='0.bias' matches only parameters an earlier rule takes"),
    ([groups('params: "*.bias", comm_dtype: fp16')],
     "sync.groups[0].comm_dtype='fp16' needs precision=fp16, not 'fp32'"),
    ([groups('params: "*", every: 2')], "every parameter is in a group with `every`"),
    ([groups('params: "0.*", every: 2, comm_dtype: bf16')],
     "sync.groups[0]: every=2 averages the parameters themselves, in fp32"),
    ([groups('params: "0.*", every: 0')], "sync.groups[0].every=0 is not allowed"),
    ([groups('params: "0.*", evry: 2')],
     "sync.groups[0].evry: unknown key; accepted keys: params, comm_dtype, every, name"),
    ([groups('params: "0.*", every: 2'), "trainer.clip_grad_norm=1.0"],
     "sync.groups[0].every with trainer.clip_grad_norm > 0"),
    ([groups('params: "*.bias", comm_dtype: bf16'), "engine.allreduce=shared_memory"],
     "engine.allreduce=shared_memory all-reduces whole buckets in one dtype"),
    ([groups('params: "*.bias", comm_dtype: bf16'), "sync.compression=powersgd"],
     "sync.groups with sync.compression=powersgd"),
])
def test_bad_rules_are_one_line_config_errors(overrides, message):
    cfg = compose_plain([*RUN, *overrides])
    with pytest.raises(ConfigError) as e:
        preflight(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_inspect_params_prints_every_parameter_and_its_rule_without_a_run(
        tmp_path, monkeypatch, capsys):
    from gradsync.run import main as train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["gradsync-train", *RUN, "sync=amp_aware",
                                      groups('params: "0.*", every: 4, name: first',
                                             'params: "*.bias", comm_dtype: fp32'),
                                      "+inspect=params"])
    train.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [
        "parameter  shape    bytes  rule",
        "0.weight   [16, 8]    512  first: averaged every 4 windows (fp32)",
        "0.bias     [16]        64  first: averaged every 4 windows (fp32)",
        "2.weight   [2, 16]    128  rest: policy (bf16 all-reduce)",
        "2.bias     [2]          8  *.bias: fp32 all-reduce"]
    assert lines[-3:] == ["first: 2 tensors, 576 bytes", "rest: 1 tensors, 128 bytes",
                          "*.bias: 1 tensors, 8 bytes"]
    assert list(tmp_path.iterdir()) == []  # nothing trained, no run dir


def test_inspect_params_with_a_config_error_prints_one_line_and_exits_2(tmp_path, monkeypatch,
                                                                        capsys):
    """The check runs inside Hydra's job, whose failure Hydra reports with a line of its own
    ("Error executing job with overrides: [...]") unless gradsync ends it first."""
    from gradsync.run import main as train

    monkeypatch.chdir(tmp_path)
    # an earlier in-process call that asked for tracebacks leaves no wish behind it
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    monkeypatch.setattr(sys, "argv", ["gradsync-train", "+inspect=params", "seed=-1"])
    with pytest.raises(ConfigError):
        train.main()
    assert os.environ.get("HYDRA_FULL_ERROR") == "1" and "GRADSYNC_TRACEBACK" not in os.environ
    capsys.readouterr()
    monkeypatch.delenv("HYDRA_FULL_ERROR")
    monkeypatch.setattr(sys, "argv", ["gradsync-train", "+inspect=params", "seed=-1"])
    with pytest.raises(SystemExit) as e:
        train.main()
    assert e.value.code == 2 and "HYDRA_FULL_ERROR" not in os.environ
    out = capsys.readouterr()
    assert out.err.splitlines() == ["gradsync: config error: seed=-1 is not allowed: an integer "
                                    "in [0, 2**63)"] and out.out == ""
    assert list(tmp_path.iterdir()) == []


def test_the_sweep_summary_shows_each_jobs_bytes_and_loss_against_the_first():
    from gradsync.run.sweep import _against_first

    def row(job, nbytes, loss, status="completed"):
        return {"job": job, "overrides": f"v={job}", "status": status,
                "allreduce_bytes": nbytes, "final_train_loss": loss, "eval_loss": loss + 1}

    rows = [row(0, 1000, 2.0), row(1, 0, 0.0, "failed"), row(2, 250, 2.5)]
    assert _against_first(rows) == [
        "Against job 0 (v=0):",
        "- job 2: all-reduce bytes x0.250 (75.0 % saved), final train loss +0.5 (+25.00 %), "
        "eval loss +0.5 (+16.67 %)"]
    assert _against_first([row(0, 1000, 2.0), row(1, 1000, 2.1)]) == []  # same bytes: no line
