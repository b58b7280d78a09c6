"""The gradient noise scale measured at every synchronising window (train/noise_scale.py), the
adaptive schedule that follows it and learning-rate scaling (train/lr_scaling.py), on the
pool's 2 real gloo ranks: each window's |G_small|^2 and |G_big|^2 equal the mean gradients of
its real samples (uneven ranks, tokens, fp16's loss scale, a bf16 wire, a policy that syncs
every micro-batch); over many windows of a fixed model the averaged estimates converge to the
data set's exact |G|^2 and tr(Sigma); an adaptive, AdaScale'd run resumes bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

import dist_cases
import noise_cases
from configs import EXACT_RESUME, SAME, losses, plain_cfg
from gradsync.components import ConfigError
from gradsync.run.main import compose_plain
from gradsync.run.preflight import preflight
from gradsync.train import checkpoint
from gradsync.train.lr_scaling import ScaledLR, adascale_gain
from gradsync.train.noise_scale import NoiseScale
from gradsync.train.schedules import AdaptiveSchedule
from gradsync.train.windows import Window

pytestmark = [pytest.mark.dist]

STATS = ("grad_sq_small", "grad_sq_big", "batch_small", "batch_big")
# rank 0: three full micro-batches of 4; rank 1: 4, 4, then 2 real samples and 2 repeats
UNEVEN = [[4, 4, 4], [4, 4, 2]]


def assert_close(got: dict, want: dict, rel: float) -> None:
    for key in STATS:
        assert noise_cases.relative_error(got[key], want[key]) < rel, (key, got[key], want[key])


# --- one window, against plain autograd ------------------------------------------------------
@pytest.mark.parametrize("case", ["accumulate", "always", "bf16_wire"])
def test_a_windows_norms_are_those_of_its_real_samples_mean_gradients(pool2, case):
    """accumulate: the local norm is this rank's window gradient over its own real samples (4+4+4
    and 4+4+2), the reduced one the mean over all 22; always (N=3): the window's first
    synchronising backward is measured, micro-batch 0 alone (the later buckets hold an already
    reduced gradient plus a local one); a bf16 wire: the local norm is taken before the cast."""
    name, wire = {"accumulate": ("accumulate", {}), "always": ("always", {}),
                  "bf16_wire": ("amp_aware", {"comm_dtype": "bf16"})}[case]
    out, other = pool2.run(noise_cases.one_window_samples, name, UNEVEN, wire)
    assert out["stats"] == other["stats"]  # the same numbers on every rank
    want = noise_cases.reference_samples(out, 1 if case == "always" else None)
    if case == "bf16_wire":
        # measured before the cast: exact; after it, the bf16-rounded mean the step applies
        assert noise_cases.relative_error(out["stats"]["grad_sq_small"],
                                          want["grad_sq_small"]) < 1e-5
        assert 0 < noise_cases.relative_error(out["stats"]["grad_sq_big"],
                                              want["grad_sq_big"]) < 1e-2
    else:
        assert_close(out["stats"], want, 1e-5)
    assert out["stats"]["batch_small"] == pytest.approx(2 / (1 / 12 + 1 / 10) if case != "always"
                                                        else 4)
    # the per-window estimates are the two-batch formulas of these numbers
    s = out["stats"]
    b, big = s["batch_small"], s["batch_big"]
    assert s["grad_norm_sq_window"] == pytest.approx(
        (big * s["grad_sq_big"] - b * s["grad_sq_small"]) / (big - b), rel=1e-12)
    assert s["grad_trace_cov_window"] == pytest.approx(
        (s["grad_sq_small"] - s["grad_sq_big"]) / (1 / b - 1 / big), rel=1e-12)


def test_fp16_loss_scale_is_divided_out(pool2):
    """The buckets hold scaled gradients: the same window at loss scale 1024 and 65536 gives
    the same numbers up to fp16's rounding (a power of two scales exactly, but fewer fp16
    gradients are subnormal at the larger scale), and fp32's up to fp16 autocast's."""
    low, _ = pool2.run(noise_cases.one_window_samples, "accumulate", UNEVEN, {}, "fp16", 1024.0)
    high, _ = pool2.run(noise_cases.one_window_samples, "accumulate", UNEVEN, {}, "fp16",
                        65536.0)
    assert_close(low["stats"], high["stats"], 1e-6)
    assert high["stats"]["grad_sq_big"] < 10  # not 65536^2 times the fp32 value
    assert_close(high["stats"], noise_cases.reference_samples(high), 1e-2)


def test_token_windows_count_tokens_as_the_batch_unit(pool2):
    """Token-normalised windows with very unequal token counts per rank: the small batch is
    each rank's tokens, the big one the global token count, the norms those of the per-token
    mean gradients."""
    out, other = pool2.run(noise_cases.one_window_tokens, "accumulate")
    assert out == other
    assert_close(out, noise_cases.reference_tokens(), 1e-5)
    assert out["batch_big"] == 33 + 3 + 7 + 71  # the loss tokens of test_lm's sequences


def test_one_rank_compares_the_first_micro_batch_with_the_window(single_process_group):
    """One process: no all-reduce to measure around; the small batch is micro-batch 0 (read in
    place before micro-batch 1's backward), the big one the whole window."""
    out = noise_cases.one_window_samples("accumulate", [[4, 4, 3]], {})
    small = noise_cases.reference_samples(out, 1)
    whole = noise_cases.reference_samples(out)
    assert_close(out["stats"], {"grad_sq_small": small["grad_sq_small"], "batch_small": 4,
                                "grad_sq_big": whole["grad_sq_big"], "batch_big": 11}, 1e-5)


# --- many windows of a fixed model, against the exact values ---------------------------------
# 63 samples (odd: each epoch's last window holds 8 real samples on rank 0, 7 on rank 1), a
# window of one micro-batch of 8 per rank: 4 windows per epoch, 60 epochs
TRUTH_DATA = {"seed": 3, "num_samples": 63, "eval_samples": 16, "in_dim": 8, "out_dim": 8,
              "noise": 0.5, "hidden_sizes": [32], "activation": "tanh"}
TRUTH = ["data=synthetic", "data.num_samples=63", "data.eval_samples=16", "data.in_dim=8",
         "data.out_dim=8", "schedule.micro_batch_size=8", "data.noise=0.5",
         "model.hidden_sizes=[32]", "model.activation=tanh", "optimizer.lr=0.0",
         "optimizer.momentum=0.0", "schedule.window_size=1", "noise_scale.enabled=true",
         "noise_scale.decay=0.998", "trainer.max_epochs=60", "trainer.log_every_windows=50",
         "trainer.checkpoint_every_steps=0", "trainer.threads_per_worker=1",
         "trainer.progress_bar=false", "seed=3"]
WINDOWS = 240
TOLERANCE = 0.05  # relative, on the averaged |G|^2, tr(Sigma) and B_simple after 240 windows


def test_the_noise_scale_converges_to_the_exact_values_of_the_data_set(pool2, tmp_path):
    """lr=0 keeps the model fixed, so every per-sample gradient of the 63 samples is known
    exactly. Every window's logged norms equal those of the real samples torch's sampler gave
    each rank (uneven last windows: 8 and 7); the averaged estimates converge to the estimator's
    expectation, |G|^2 - S/n and S = n/(n-1) tr(Sigma) (sampling without replacement), within
    TOLERANCE, where the uncorrected |G|^2 is further off than that."""
    cfg = plain_cfg(TRUTH)
    r0, _ = pool2.run(dist_cases.train_run_rows, cfg, str(tmp_path))
    rows, s = r0["rows"], r0["summary"]
    g = noise_cases.per_sample_grads(r0["params"], TRUTH_DATA)
    seen = noise_cases.windows_seen(63, 2, 3, 60, 8, 1)
    assert len(seen) == len(rows) == WINDOWS
    worst = 0.0
    for row, ranks in zip(rows, seen, strict=True):
        want = noise_cases.window_norms(g, ranks)
        worst = max(worst, *(noise_cases.relative_error(row[k], want[k]) for k in STATS))
    assert worst < 1e-5
    assert rows[3]["batch_big"] == 15 and rows[3]["batch_small"] == pytest.approx(2 / (1/8 + 1/7))
    exact = noise_cases.truth(g)
    errors = {"norm_sq": noise_cases.relative_error(s["grad_norm_sq"], exact["expected_norm_sq"]),
              "trace": noise_cases.relative_error(s["grad_trace_cov"], exact["expected_trace"]),
              "b_simple": noise_cases.relative_error(s["noise_scale"],
                                                     exact["expected_b_simple"])}
    print(f"\nexact {exact}\nmeasured {s['grad_norm_sq']} {s['grad_trace_cov']} "
          f"{s['noise_scale']}\nrelative errors {errors}")
    assert max(errors.values()) < TOLERANCE
    assert s["noise_scale_windows"] == WINDOWS and s["noise_scale_unit"] == "samples"
    # without the finite-population correction the |G|^2 compared with would be off by more
    assert noise_cases.relative_error(s["grad_norm_sq"], exact["norm_sq"]) > TOLERANCE


# --- the adaptive schedule and AdaScale: identical on every rank, bitwise on resume ----------
ADAPTIVE = [*(o for o in EXACT_RESUME  # the window's N, not its micro-batch size
              if not o.startswith("schedule.") or o.startswith("schedule.micro_batch_size=")),
            "schedule=adaptive",
            "schedule.initial_window_size=4", "schedule.min_window_size=1",
            "schedule.max_window_size=4", "schedule.every_steps=2",
            "lr_scaling=adascale", "lr_scaling.reference_batch=32",
            "noise_scale.decay=0.5", "trainer.max_epochs=3", "trainer.log_every_windows=3",
            "trainer.checkpoint_every_steps=2", "trainer.keep_checkpoints=50", "seed=7"]


def rows_with_noise(rows: list[dict]) -> list[tuple]:
    """Every row's loss, LR, window size, gain and noise-scale fields, floats as hex."""
    keys = ("window_size", "lr_factor", "grad_sq_small", "grad_sq_big", "noise_scale",
            "grad_norm_sq", "grad_trace_cov")
    return [(*loss, *(float(r[k]).hex() if r.get(k) is not None else None for k in keys))
            for loss, r in zip(losses(rows), rows, strict=True)]


@pytest.fixture(scope="module")
def adaptive_run(pool2, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("adaptive")
    r0, r1 = pool2.run(dist_cases.train_run_rows, plain_cfg(ADAPTIVE), str(run_dir))
    return run_dir, r0, r1


def test_adaptive_window_follows_the_noise_scale_the_same_on_every_rank(adaptive_run):
    """N starts at 4 and changes only after optimizer steps that are multiples of `every` (2),
    at a window boundary, to the window that holds scale x B_simple samples (as that step's
    row logs B_simple), clamped to [1, 4]; an epoch's last window may be cut short. Rank 1
    used the same sizes (its summary). AdaScale's gain lies in [1, S]."""
    run_dir, r0, r1 = adaptive_run
    rows, s = r0["rows"], r0["summary"]
    schedule = AdaptiveSchedule(1.0, 4, 1, 4, 2, 2 * 8)
    n, previous, used = 4, 0, {4}
    for row, after in zip(rows, [*rows[1:], None], strict=True):
        last_of_epoch = after is None or after["epoch"] != row["epoch"]
        assert row["window_size"] == n or (row["window_size"] < n and last_of_epoch), row
        samples, previous = row["samples"] - previous, row["samples"]
        scale = samples / 32  # S: the window's real samples over the reference batch
        assert min(1, scale) - 1e-12 <= row["lr_factor"] <= max(1, scale) + 1e-12
        assert row["lr"] > 0
        if row["step"] % 2 == 0:
            b = row["noise_scale"]
            if b is None:  # no value to report (noise_scale.undefined): the ratio acted on
                g, t = row["grad_norm_sq"], row["grad_trace_cov"]
                b = t / g if g > 0 else (math.inf if t > 0 else math.nan)
            n = schedule.target(b) or n
            used.add(n)
    assert len(used) >= 2 and s["window_size"] == sorted(used)
    assert r1["summary"]["window_size"] == s["window_size"]  # rank 1 decided alike
    assert s["samples_seen"] == 3 * 199  # every sample once per epoch, whatever N
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("noise/noise_scale", "noise/grad_norm_sq", "noise/grad_trace_cov",
                "noise/grad_sq_small", "noise/grad_sq_big", "train/lr_factor", "train/lr",
                "train/window_size"):
        assert tag in tags, tag
    # at every log point (and every checkpoint's flush): the row of that window, where
    # B_simple has a value (None: noise_scale.undefined)
    logged = {e.step: e.value for e in acc.Scalars("noise/noise_scale")}
    valued = {w for w in range(3, len(rows) + 1, 3) if rows[w - 1]["noise_scale"] is not None}
    assert set(logged) >= valued and len(valued) >= 2
    assert logged == pytest.approx({w: rows[w - 1]["noise_scale"] for w in logged})
    assert s["noise_scale"] == rows[-1]["noise_scale"]
    assert s["grad_norm_sq"] == rows[-1]["grad_norm_sq"]


def test_an_adaptive_adascale_run_resumes_bitwise(pool2, adaptive_run, tmp_path):
    """From a checkpoint inside an epoch, after N changed: the same windows, window sizes, LRs,
    gains, noise-scale estimates and parameters, bit for bit."""
    run_dir, ref, _ = adaptive_run
    rows = ref["rows"]
    changed = next(r for r, q in zip(rows[1:], rows[:-1], strict=True)
                   if r["window_size"] != q["window_size"] and r["epoch"] == q["epoch"])
    step = next(r["step"] for r in rows[:-1] if r["step"] > changed["step"]
                and r["step"] % 2 == 0 and rows[r["window"]]["epoch"] == r["epoch"])
    ckpt = checkpoint.step_path(run_dir / "checkpoints", step)
    state = checkpoint.load(ckpt)
    assert state["progress"]["epoch_micro"] > 0  # inside an epoch
    assert state["schedule"]["size"] == rows[state["progress"]["windows"]]["window_size"]
    out, _ = pool2.run(dist_cases.train_run_rows, plain_cfg([*ADAPTIVE, f"resume={ckpt}"]),
                       str(tmp_path))
    assert rows_with_noise(out["rows"]) == rows_with_noise(rows)[state["progress"]["windows"]:]
    keys = (*SAME, "window_size", "noise_scale", "grad_norm_sq", "grad_trace_cov")
    assert {k: out["summary"][k] for k in keys} == {k: ref["summary"][k] for k in keys}
    for name, value in ref["params"].items():
        assert torch.equal(out["params"][name], value), name


# --- the pieces, by hand ---------------------------------------------------------------------
def test_the_estimator_folds_rows_into_ratio_of_averages():
    """Two windows, by hand: 1 rank's row sums, the unbiased estimates, the EMAs' bias
    correction, B_simple their ratio."""
    meter = NoiseScale(2, torch.device("cpu"), "samples", 0.5, [])
    # ranks with b = 4 and 6 -> b = 2 / (1/4 + 1/6) = 4.8, B = 10; |G_b|^2 = 3, |G_B|^2 = 2
    out = meter._fold([6.0, 1 / 4 + 1 / 6, 10.0, 2.0], 2.0 * 100)
    b, big = 4.8, 10.0
    g2, tr = (big * 2 - b * 3) / (big - b), (3 - 2) / (1 / b - 1 / big)
    assert out["grad_norm_sq_window"] == pytest.approx(g2)
    assert out["grad_trace_cov_window"] == pytest.approx(tr)
    assert out["grad_norm_sq"] == pytest.approx(g2) and out["noise_scale"] == pytest.approx(tr / g2)
    out2 = meter._fold([4.0, 1 / 4 + 1 / 6, 10.0, 2.0], 1.0 * 100)
    g2b, trb = (big * 1 - b * 2) / (big - b), (2 - 1) / (1 / b - 1 / big)
    # bias-corrected EMA of 2 values with decay 0.5: (0.5 x + 0.5 y ... ) / (1 - 0.25)
    ema_g = (0.5 * 0.5 * g2 + 0.5 * g2b) / 0.75
    ema_t = (0.5 * 0.5 * tr + 0.5 * trb) / 0.75
    assert out2["grad_norm_sq"] == pytest.approx(ema_g)
    assert out2["noise_scale"] == pytest.approx(ema_t / ema_g)  # ratio of averages
    assert out2["noise_scale"] != pytest.approx((tr / g2 + trb / g2b) / 2)
    # a window one rank did not measure (or with inf) changes nothing
    assert meter._fold([4.0, 0.25, 10.0, 1.0], 100.0) == meter.estimates()
    assert meter.windows == 2


def test_an_estimate_without_a_positive_value_is_reported_as_none_with_the_reason():
    """Once |G|^2's average is negative (the gradient lost in its noise) B_simple has no value:
    rows and summary.json say None and why, never inf; the schedule and AdaScale still act on
    the ratio (inf: the largest window, the full gain)."""
    meter = NoiseScale(2, torch.device("cpu"), "samples", 0.5, [])
    assert meter.summary()["noise_scale"] is None
    assert "no window was measured" in meter.summary()["noise_scale_note"]
    # b = 4, B = 8; |G_b|^2 = 1, |G_B|^2 = 0.4: |G|^2 = (8 x 0.4 - 4 x 1) / 4 = -0.2
    row = meter._fold([2.0, 0.5, 8.0, 2.0], 0.4 * 64)
    assert row["grad_norm_sq"] == pytest.approx(-0.2) and row["noise_scale"] is None
    assert meter.estimates()["noise_scale"] == math.inf
    s = meter.summary()
    assert s["noise_scale"] is None and s["grad_norm_sq"] == pytest.approx(-0.2)
    assert s["noise_scale_note"].startswith("the average |G|^2 estimate is -0.2 (not positive)")
    # |G_b|^2 = 0.5 < |G_B|^2 = 0.6: tr(Sigma) = -0.1 / (1/4 - 1/8) = -0.8, B_simple negative
    meter = NoiseScale(2, torch.device("cpu"), "samples", 0.5, [])
    assert meter._fold([1.0, 0.5, 8.0, 2.0], 0.6 * 64)["noise_scale"] is None
    assert "tr(Sigma) estimate is -0.8 (not positive)" in meter.summary()["noise_scale_note"]
    # |G_b|^2 = 1, |G_B|^2 = 0.8: |G|^2 0.6, tr(Sigma) 1.6; the averages 0.63, 0.8: a value
    assert meter._fold([2.0, 0.5, 8.0, 2.0], 0.8 * 64)["noise_scale"] == pytest.approx(0.8 / (
        (0.25 * 0.7 + 0.5 * 0.6) / 0.75))
    assert "noise_scale_note" not in meter.summary()


def test_adaptive_target_and_adascale_gain():
    s = AdaptiveSchedule(scale=2.0, initial=1, lowest=1, highest=8, every=5, units_per_micro=16)
    assert [s.target(b) for b in (0.0, 7.9, 8.1, 40.0, 1e9, math.inf)] == [1, 1, 1, 5, 8, 8]
    assert s.target(math.nan) is None
    # r = (phi S + 1) / (phi + 1), phi = B_simple / batch
    assert adascale_gain(4.0, 64.0, 128.0) == pytest.approx((0.5 * 4 + 1) / 1.5)
    assert adascale_gain(4.0, math.nan, 128.0) == 1.0
    assert adascale_gain(4.0, math.inf, 128.0) == 4.0
    assert adascale_gain(4.0, 1e12, 128.0) == pytest.approx(4.0)  # noise-dominated: linear
    assert adascale_gain(4.0, 1e-12, 128.0) == pytest.approx(1.0)  # no noise: no gain
    assert adascale_gain(0.5, 64.0, 16.0) == pytest.approx((4 * 0.5 + 1) / 5)  # S < 1


def test_scaled_lr_applies_the_factor_and_advances_the_schedule_by_the_clock():
    from torch.optim.lr_scheduler import LambdaLR

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LambdaLR(opt, lambda t: 0.5**t)  # halves per tick
    scaled = ScaledLR(sched, opt, "linear", reference=32, tick="samples")
    used, ticks = [], []
    for global_real in (64, 64, 16, 48):  # S = 2, 2, 0.5, 1.5: clock 2, 4, 4.5, 6
        window = Window(0, 1, 0, 0, global_real)
        scaled.before_step(window, None)
        used.append(opt.param_groups[0]["lr"])
        opt.step()
        scaled.step()
        ticks.append(sched.last_epoch)
    assert ticks == [2, 4, 4, 6]
    assert used == [2.0, 2 * 0.25, 0.5 * 0.0625, 1.5 * 0.0625]
    # a skipped step (no step()): the next window's factor replaces this one's, nothing ticks
    scaled.before_step(Window(0, 1, 0, 0, 64), None)
    scaled.before_step(Window(0, 1, 0, 0, 32), None)
    assert opt.param_groups[0]["lr"] == 0.5**6 and sched.last_epoch == 6
    state = scaled.state_dict()
    again = ScaledLR(LambdaLR(opt, lambda t: 0.5**t), opt, "linear", 32, "samples")
    again.load_state_dict(state)
    assert (again.clock, again.ticks, again.base) == (6.0, 6, [0.5**6])


@pytest.mark.parametrize("overrides, message", [
    (["noise_scale.enabled=true", "loss.normalize=micro_batch_mean"],
     "loss.normalize=micro_batch_mean weighs them unequally"),
    (["noise_scale.enabled=true", "sync=local_sgd"], "averages parameters instead"),
    (["schedule=adaptive", "sync=diloco"], "schedule=adaptive is measured around"),
    (["lr_scaling=adascale", "trainer.devices=1", "schedule.window_size=1"],
     "lr_scaling=adascale on 1 rank compares a window's first micro-batch"),
    (["schedule=adaptive", "trainer.devices=1"], "schedule.min_window_size=1 is not allowed"),
    (["schedule=adaptive", "schedule.min_window_size=5"],
     "schedule.initial_window_size=1 is not allowed: an integer in [5, 16]"),
    (["schedule=adaptive", "schedule.scale=0"], "schedule.scale=0.0 is not allowed"),
    (["noise_scale.decay=1.0"], "noise_scale.decay=1.0 is not allowed"),
    (["lr_scaling=linear", "lr_scaling.reference_batch=-1"],
     "lr_scaling.reference_batch=-1 is not allowed"),
    (["lr_scaling.name=cubic"], "lr_scaling.name='cubic' is not allowed"),
])
def test_bad_noise_scale_and_lr_scaling_options_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        preflight(compose_plain(overrides))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_sweep_plots_the_noise_scale_and_the_window_size(tmp_path):
    from gradsync.run import sweep
    from gradsync.train.metrics import final_metrics

    jobs = [sweep.Job(0, tmp_path, {"+experiment/window": "n4"}, {"status": "completed"}, [],
                      [], [(64, 100.0, 4), (128, 150.0, 4)]),
            sweep.Job(1, tmp_path, {"+experiment/window": "adaptive"}, {"status": "completed"},
                      [], [], [(16, 50.0, 1), (48, 90.0, 2), (80, 400.0, 2)]),
            sweep.Job(2, tmp_path, {"+experiment/window": "n1"}, {"status": "completed"}, [],
                      [], [])]  # measured nothing: no curve
    fig = sweep.plot_noise(jobs, tmp_path / "noise.png")
    ax_b, ax_n = fig.axes
    assert [list(line.get_xdata()) for line in ax_b.lines] == [[64, 128], [16, 48, 80]]
    assert list(ax_b.lines[1].get_ydata()) == [50.0, 90.0, 400.0]
    assert list(ax_n.lines[1].get_ydata()) == [1, 2, 2] and ax_b.get_yscale() == "log"
    assert [t.get_text() for t in ax_b.get_legend().get_texts()] == [
        "+experiment/window=n4", "+experiment/window=adaptive"]
    assert (tmp_path / "noise.png").read_bytes()[:4] == b"\x89PNG"
    summary = {"final_train_loss": 1.0, "eval": {}, "samples_per_s": 1.0, "sync_backwards": [1],
               "allreduce_calls": [1], "allreduce_bytes": [1], "peak_rss_mb": 1.0}
    assert "noise_scale" not in final_metrics(summary | {"noise_scale": None})
    assert final_metrics(summary | {"noise_scale": 123.0})["noise_scale"] == 123.0
