"""The default experiment (`make train`: digits, MLP, 2 ranks, accumulate N=4, fp32, 30 epochs =
360 optimizer steps) trains the same bits release after release: its final parameters' SHA-256
is recorded here. Recorded at d224839 (before the issue-29 redesign) and unchanged since; a
refactor of the loop, the policies, the engines or the data that changes one bit of one parameter
fails it. The hash holds for the lock's torch (2.13.0, CPU): another torch or CPU may round
differently (make compat runs the exactness tests, not this one)."""

import hashlib

import pytest
import torch

import dist_cases
from conftest import REPO
from gradsync.run import summary as run_summary
from gradsync.run import sweep
from gradsync.run.main import compose_plain
from gradsync.train.metrics import final_metrics

# sha256 over the sorted parameter names and their bytes (see _digest)
RECORDED = "98c1f014538a08661a8b564a8a365faf8d80e480837e28b2b7117e18749c421d"


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@pytest.mark.dist
def test_the_default_experiment_trains_the_recorded_bits(pool2, tmp_path, capsys):
    """...and regenerates what the docs quote of it: docs/runs.md's end-of-run lines (but the
    samples/s and wall seconds they measured) and the N = 4 row of docs/sweeps.md's make sweep
    table (the same run: accum_sweep's N = 4 job is the default experiment)."""
    cfg = compose_plain(["trainer.progress_bar=false", "trainer.backend=gloo"])
    out = pool2.run(dist_cases.train_run, cfg, str(tmp_path))[0]
    s = out["summary"]
    assert s["optimizer_steps"] == 360
    assert s["final_train_loss"] == 0.009959691320545971
    assert _digest(out["params"]) == RECORDED

    runs = (REPO / "docs" / "runs.md").read_text()
    quoted = runs.split("```\ngradsync: outputs in ", 1)[1].split("```", 1)[0].splitlines()
    measured = dict(kv.split("=") for kv in quoted[1].split() if kv.split("=")[0] in (
        "samples/s", "wall_s"))
    run_summary.report(tmp_path, s | {"samples_per_s": float(measured["samples/s"]),
                                      "wall_s": float(measured["wall_s"])})
    printed = capsys.readouterr().out.splitlines()
    assert printed[2:4] == quoted[1:3]
    row = next(line for line in (REPO / "docs" / "sweeps.md").read_text().splitlines()
               if line.startswith("| 2 | 4 | completed |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    metrics = final_metrics(s)
    assert cells[4:8] == [sweep._cell("optimizer_steps", 360)] + [
        sweep._cell(k, metrics[k]) for k in ("final_train_loss", "eval_loss", "eval_accuracy")]
    assert cells[9] == sweep._cell("sent_bytes", metrics["sent_bytes"])


@pytest.mark.dist
def test_the_default_run_measuring_the_noise_scale_reports_no_inf(pool2, tmp_path, capsys):
    """noise_scale.enabled=true measures and changes nothing (the recorded bits); the default
    run ends with |G|^2's average below 0, so B_simple has no value: summary.json holds null
    and the reason (no inf anywhere), the end-of-run lines a warning and what crossed the
    wire."""
    import json

    cfg = compose_plain(["trainer.progress_bar=false", "trainer.backend=gloo",
                         "noise_scale.enabled=true"])
    out = pool2.run(dist_cases.train_run, cfg, str(tmp_path))[0]
    s = out["summary"]
    assert _digest(out["params"]) == RECORDED
    assert s["noise_scale"] is None and s["grad_norm_sq"] < 0 < s["grad_trace_cov"]
    assert s["noise_scale_note"].startswith(f"the average |G|^2 estimate is "
                                            f"{s['grad_norm_sq']:.3g} (not positive)")
    json.dumps(s, allow_nan=False)  # no inf, no nan
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bs = [r["noise_scale"] for r in rows if "noise_scale" in r]
    assert len(bs) == 360 and all(b is None or 0 < b < 1e6 for b in bs)
    assert any(b is not None for b in bs) and bs[-1] is None
    run_summary.report(tmp_path, s | {"wall_s": 1.0})
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and printed.err.startswith(
        "gradsync: warning: no gradient noise scale at the end of the run: the average |G|^2")
    # one all-reduce of the MLP's 26,122 fp32 gradients (64-128-128-10) per optimizer step
    assert s["sync_backwards"][0] == 360 and s["allreduce_bytes"][0] == 360 * 26_122 * 4
    assert "  sent (rank 0): sync_backwards=360 allreduce=37.62 MB  noise_scale=n/a\n" \
        in printed.out
