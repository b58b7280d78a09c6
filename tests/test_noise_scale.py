"""The gradient noise scale measured at every synchronising window (train/noise_scale.py), the
adaptive schedule that follows it and learning-rate scaling (train/lr_scaling.py), on the
pool's 2 real gloo ranks: each window's |G_small|^2 and |G_big|^2 equal the mean gradients of
its real samples (uneven ranks, tokens, fp16's loss scale, a bf16 wire, a policy that syncs
every micro-batch); over many windows of a fixed model the averaged estimates converge to the
data set's exact |G|^2 and tr(Sigma); an adaptive, AdaScale'd run resumes bit for bit."""

from __future__ import annotations

import pytest

import dist_cases
import noise_cases
from configs import plain_cfg

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
    """The buckets hold scaled gradients: the same window at loss scale 1 and 1024 (a power of
    two: exact) gives the same numbers bit for bit, and fp32's up to fp16 autocast's rounding."""
    at_1, _ = pool2.run(noise_cases.one_window_samples, "accumulate", UNEVEN, {}, "fp16", 1.0)
    at_1024, _ = pool2.run(noise_cases.one_window_samples, "accumulate", UNEVEN, {}, "fp16",
                           1024.0)
    assert at_1["stats"] == at_1024["stats"]
    assert_close(at_1["stats"], noise_cases.reference_samples(at_1), 1e-2)


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
         "data.out_dim=8", "data.micro_batch_size=8", "data.noise=0.5",
         "model.hidden_sizes=[32]", "model.activation=tanh", "optimizer.lr=0.0",
         "optimizer.momentum=0.0", "schedule.accum_steps=1", "trainer.noise_scale=true",
         "trainer.noise_scale_decay=0.998", "trainer.max_epochs=60", "trainer.log_every=50",
         "trainer.checkpoint_every=0", "trainer.threads_per_worker=1",
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
