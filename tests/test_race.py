"""Which policy wins: the stdlib corpus, the sweep summary's loss curves and to-target columns
(on job dirs written here by hand, so every number is known), and the policy_race preset with
one real job."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from conftest import REPO
from gradsync.components import ConfigError, describe
from gradsync.config.hydra import to_plain
from gradsync.data import corpus
from gradsync.run import sweep
from gradsync.run.main import CONF_DIR, register_schemas
from gradsync.run.preflight import preflight

register_schemas()


# --- the corpus ------------------------------------------------------------------------------
def test_stdlib_corpus_is_deterministic_and_splits_by_file_without_overlap():
    a = corpus.select(corpus.stdlib_root(), 300_000, 0.2)
    corpus.select.cache_clear()  # read the files again
    b = corpus.select(corpus.stdlib_root(), 300_000, 0.2)
    assert a.sha256 == b.sha256 and len(a.sha256) == 64
    assert (a.train_files, a.eval_files) == (b.train_files, b.eval_files)
    assert a.train_files and a.eval_files
    assert not set(a.train_files) & set(a.eval_files)
    assert 250_000 < a.train_bytes + a.eval_bytes <= 300_000
    assert all(not f.startswith(("site-packages/", "dist-packages/")) for f in a.text)
    # another budget is another corpus, with another digest; the split of a file never changes
    c = corpus.select(corpus.stdlib_root(), 200_000, 0.2)
    assert c.sha256 != a.sha256
    both = set(c.text) & set(a.text)
    assert both and all((f in c.eval_files) == (f in a.eval_files) for f in both)
    info = describe({"_target_": "gradsync.data.corpus.stdlib_text",
                     "max_bytes": 300_000, "eval_fraction": 0.2})
    assert info == {"root": str(corpus.stdlib_root()), "sha256": a.sha256,
                    "bytes": a.train_bytes + a.eval_bytes, "train_bytes": a.train_bytes,
                    "eval_bytes": a.eval_bytes, "train_files": len(a.train_files),
                    "eval_files": len(a.eval_files)}


def test_chunks_cut_at_blank_lines_within_max_len_and_give_back_the_text():
    text = b"import os\n\n\ndef f():\n    return 1\n  \n\n" + b"x" * 25 + b"\n\nend\n"
    out = corpus.chunks(text, max_len=12)
    assert b"".join(out) == text
    assert out == [b"import os\n\n\n", b"def f():\n   ", b" return 1\n  ", b"\n\n",
                   b"x" * 12, b"x" * 12, b"x\n\nend\n"]
    # a chunk ends at a run of blank lines, at a cut of max_len bytes, or at the text's end
    assert all(c.endswith(b"\n\n") or len(c) == 12 or c is out[-1] for c in out)
    assert corpus.chunks(text, max_len=100) == [text]
    assert corpus.chunks(b"a\n\nb", max_len=3) == [b"a\n\n"]  # a lone byte is dropped


def test_stdlib_text_bundle_is_byte_tokens_from_split_files(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "big.py").write_bytes(b"never read\n")
    for i in range(20):
        (tmp_path / "pkg" / f"m{i}.py").write_bytes(b"def f():\n    pass\n\n" * (i + 1))
    (tmp_path / "notes.txt").write_bytes(b"not python")
    bundle = corpus.stdlib_text(max_len=16, max_bytes=10_000, eval_fraction=0.3,
                                root=str(tmp_path))
    chosen = corpus.select(tmp_path, 10_000, 0.3)
    assert sorted(chosen.text) == [f"pkg/m{i}.py" for i in sorted(range(20), key=str)]
    assert bundle.sizes == {"vocab_size": 256, "max_len": 15} and bundle.unit == "tokens"
    train = b"".join(bytes(s.tolist()) for s in bundle.train.seqs)
    held_out = b"".join(bytes(s.tolist()) for s in bundle.eval.seqs)
    assert train == b"".join(chosen.text[f] for f in chosen.train_files)
    assert held_out == b"".join(chosen.text[f] for f in chosen.eval_files)
    assert all(2 <= len(s) <= 16 for s in bundle.train.seqs)


def test_packed_stdlib_text_is_windows_of_max_len_over_the_joined_files(tmp_path):
    """data.packed: nanoGPT's way, every window max_len bytes, each starting on the previous
    one's last byte, so every byte but the first is a target once; the short tail left out."""
    assert corpus.windows(b"abcdefghij", 4) == [b"abcd", b"defg", b"ghij"]
    assert corpus.windows(b"abcdefghi", 4) == [b"abcd", b"defg"]
    (tmp_path / "pkg").mkdir()
    for i in range(20):
        (tmp_path / "pkg" / f"m{i}.py").write_bytes(b"def f():\n    pass\n\n" * (i + 1))
    bundle = corpus.stdlib_text(max_len=16, max_bytes=10_000, eval_fraction=0.3,
                                root=str(tmp_path), packed=True)
    chosen = corpus.select(tmp_path, 10_000, 0.3)
    text = b"".join(chosen.text[f] for f in chosen.train_files)
    seqs = [bytes(s.tolist()) for s in bundle.train.seqs]
    assert {len(s) for s in seqs} == {16} and bundle.tokens_per_sample == 15.0
    joined = seqs[0] + b"".join(s[1:] for s in seqs[1:])
    assert text.startswith(joined) and len(text) - len(joined) < 15


def compose_plain(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_plain(compose("config", overrides=overrides))


def test_bad_corpus_options_are_one_line_config_errors(tmp_path):
    for override, message in (
            ("data.eval_fraction=1.5", "data.eval_fraction=1.5 is not allowed"),
            ("data.max_len=1", "data.max_len=1 is not allowed"),
            (f"data.root={tmp_path / 'nowhere'}", "data.root="),
            ("data.max_bytes=1", "both need at least one")):
        cfg = compose_plain(["experiment=policy_race", override])
        with pytest.raises(ConfigError, match=message.replace(".", r"\.")) as e:
            preflight(cfg)
        assert "\n" not in str(e.value)


# --- to-target columns on hand-made job dirs -------------------------------------------------
def write_job(sweep_dir: Path, num: int, policy: str, evals: list[tuple], train: list[tuple],
              final_eval: float | None) -> None:
    """evals/train: (samples, bytes, seconds, loss); final_eval None: a job that failed."""
    d = sweep_dir / str(num)
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {
        "job": {"num": num}, "overrides": {"task": [f"+experiment/race={policy}"]}}}))

    def rows(points: list[tuple], loss_key: str = "loss") -> str:
        return "".join(json.dumps({"window": i + 1, "samples": s, "allreduce_bytes": b,
                                   "train_s": t, loss_key: loss}) + "\n"
                       for i, (s, b, t, loss) in enumerate(points))

    (d / "metrics.jsonl").write_text(rows(train))
    (d / "evals.jsonl").write_text(rows(evals))
    if final_eval is None:
        (d / "summary.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
        return
    (d / "summary.json").write_text(json.dumps({
        "status": "completed", "world_size": 2, "micro_batch_size": 8, "window_size": 4,
        "optimizer_steps": 3, "final_train_loss": train[-1][3], "eval": {"loss": final_eval},
        "samples_per_s": 100.0, "sync_backwards": [3, 3], "allreduce_calls": [3, 3],
        "allreduce_bytes": [evals[-1][1]] * 2, "peak_rss_mb": 300.0, "train_s": 3.0}))


@pytest.fixture
def hand_sweep(tmp_path):
    sweep_dir = tmp_path / "sweep"
    # job 0: crosses 3.0 between its 2nd and 3rd evaluation; job 1: below 3.0 at its first one;
    # job 2: its final eval loss 3.2 is the worst, first reached between its 1st and 2nd
    # (after a bump above it: the first crossing counts); job 3 failed
    write_job(sweep_dir, 0, "always", [(64, 1000, 1.0, 4.0), (128, 2000, 2.0, 3.5),
                                       (192, 3000, 4.0, 2.5)], [(64, 1000, 1.0, 4.2)], 2.5)
    write_job(sweep_dir, 1, "accumulate", [(64, 250, 0.5, 2.9), (128, 500, 1.0, 2.8)],
              [(64, 250, 0.5, 3.1), (128, 500, 1.0, 2.9)], 2.8)
    write_job(sweep_dir, 2, "local_sgd_h8", [(100, 0, 1.0, 3.6), (200, 400, 3.0, 3.1),
                                             (300, 400, 5.0, 3.3), (400, 800, 7.0, 3.2)],
              [(100, 0, 1.0, 3.9)], 3.2)
    write_job(sweep_dir, 3, "diloco_h16", [(64, 0, 1.0, 5.0)], [(64, 0, 1.0, 5.5)], None)
    return sweep_dir


def to_target_cells(sweep_dir: Path) -> list[tuple[str, ...]]:
    with open(sweep_dir / "sweep_summary.csv", newline="") as f:
        return [(r["samples_to_target"], r["bytes_to_target"], r["seconds_to_target"],
                 r["target_loss"]) for r in csv.DictReader(f)]


def test_default_target_is_the_worst_final_eval_loss_and_every_completed_job_reaches_it(
        hand_sweep):
    result = sweep.write_summary(hand_sweep)
    assert result.jobs == 4 and result.failed == 1
    cells = to_target_cells(hand_sweep)
    # job 0: 3.2 lies 0.3/1.0 of the way from (128, 2000, 2.0, 3.5) to (192, 3000, 4.0, 2.5)
    assert [float(x) for x in cells[0]] == pytest.approx([128 + 0.3 * 64, 2000 + 0.3 * 1000,
                                                          2.0 + 0.3 * 2.0, 3.2])
    assert [float(x) for x in cells[1]] == [64, 250, 0.5, 3.2]  # its first evaluation
    # job 2: 3.2 lies 0.4/0.5 of the way from (100, 0, 1.0, 3.6) to (200, 400, 3.0, 3.1)
    assert [float(x) for x in cells[2]] == pytest.approx([180, 320, 2.6, 3.2])
    assert cells[3] == ("", "", "", "3.2")  # failed: its curve never counts
    md = (hand_sweep / "sweep_summary.md").read_text()
    assert "Target eval loss 3.2 (the worst final eval loss among completed jobs)" in md
    header = next(line for line in md.splitlines() if line.startswith("| job"))
    assert "| samples to target | MB sent to target | train s to target |" in header
    row0 = next(line for line in md.splitlines() if line.startswith("| 0 |"))
    assert "| 147 | 0.00 | 2.6 |" in row0


def test_a_job_that_never_reaches_the_target_gets_empty_cells(hand_sweep, capsys):
    """`python -m gradsync.run.sweep <dir> 2.85`, its main in this process (the command itself
    runs in tests/test_sweep.py)."""
    code = sweep.main([str(hand_sweep), "2.85"])
    stdout = capsys.readouterr().out
    assert code == 1  # job 3 failed
    cells = to_target_cells(hand_sweep)
    assert [float(x) for x in cells[0]] == pytest.approx([128 + 0.65 * 64, 2000 + 0.65 * 1000,
                                                          2.0 + 0.65 * 2.0, 2.85])
    # job 1: halfway from (64, 250, 0.5, 2.9) to (128, 500, 1.0, 2.8)
    assert [float(x) for x in cells[1]] == pytest.approx([96, 375, 0.75, 2.85])
    assert cells[2] == ("", "", "", "2.85")  # never below 3.1
    row2 = next(line for line in stdout.splitlines() if line.startswith("| 2 |"))
    assert "|  |  |  |" in row2
    assert "Target eval loss 2.85 (given)" in stdout


def test_sweep_png_has_loss_against_samples_bytes_and_seconds(hand_sweep, tmp_path):
    jobs = sweep.read_jobs(hand_sweep)
    fig = sweep.plot(jobs, tmp_path / "race.png", target=3.2)
    ax_samples, ax_bytes, ax_seconds = fig.axes
    # job 3 failed before it sent a byte: symlog from 0 keeps its curve on the plot
    assert ax_bytes.get_xscale() == "symlog" and ax_samples.get_xscale() == "linear"
    for ax, axis in ((ax_samples, 0), (ax_bytes, 1), (ax_seconds, 2)):
        evals = [line for line in ax.lines if line.get_marker() == "o"]
        assert len(evals) == 4  # one eval curve per job
        assert list(evals[2].get_xdata()) == [p[axis] for p in ((100, 0, 1.0), (200, 400, 3.0),
                                                                (300, 400, 5.0),
                                                                (400, 800, 7.0))]
        assert list(evals[2].get_ydata()) == [3.6, 3.1, 3.3, 3.2]
        assert [line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--"] \
            == [3.2]
    labels = [t.get_text() for t in ax_samples.get_legend().get_texts()]
    assert labels == ["+experiment/race=always", "+experiment/race=accumulate",
                      "+experiment/race=local_sgd_h8", "+experiment/race=diloco_h16 (failed)",
                      "target 3.2"]
    assert (tmp_path / "race.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- the race preset ---------------------------------------------------------------------------
RACE_DIR = Path(CONF_DIR) / "experiment" / "race"


def test_the_plot_shows_every_curve_whole_and_a_job_that_sent_nothing(tmp_path):
    """A job of one rank sends no byte: on a log axis it would vanish, so the bytes panel turns
    symlog from 0 and its curve is there; no panel clips a curve (the first steps' losses far
    above the final evaluations included), and the target is a line."""
    write_job(tmp_path, 0, "accumulate", [(64, 250, 0.5, 2.9), (128, 500, 1.0, 2.8)],
              [(8, 30, 0.1, 9.0), (64, 250, 0.5, 3.1), (128, 500, 1.0, 2.9)], 2.8)
    write_job(tmp_path, 1, "always", [(64, 0, 0.5, 3.0), (128, 0, 1.0, 2.85)],
              [(8, 0, 0.1, 9.5), (128, 0, 1.0, 2.95)], 2.85)
    fig = sweep.plot(sweep.read_jobs(tmp_path), tmp_path / "p.png", target=2.85)
    ax_samples, ax_bytes, _ = fig.axes
    assert ax_bytes.get_xscale() == "symlog" and ax_bytes.get_xlim()[0] == 0
    silent = [line for line in ax_bytes.lines if list(line.get_xdata()) == [0, 0]]
    assert len(silent) == 2  # job 1's train and eval curves, at 0 bytes
    for ax in fig.axes:
        low, high = ax.get_ylim()
        assert low <= 2.8 and high >= 9.5  # every loss inside the panel
        assert [line.get_ydata()[0] for line in ax.lines if line.get_linestyle() == "--"] \
            == [2.85]


def test_the_readme_and_make_help_count_the_race_contestants():
    """README's tour and `make help` say how many policies race: the sweep's contestants."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=policy_race"],
                      return_hydra_config=True)
    n = len(cfg.hydra.sweeper.params["+experiment/race"].split(","))
    word = ["Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten"][n - 2]
    readme = (REPO / "README.md").read_text()
    assert f"Which policy wins? {word} policies" in readme
    assert f"which policy wins: {n} sync policies" in (REPO / "Makefile").read_text()


def test_policy_race_sweeps_every_contestant_at_the_same_sample_budget():
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=policy_race"],
                      return_hydra_config=True)
    swept = cfg.hydra.sweeper.params["+experiment/race"].split(",")
    assert sorted(swept) == sorted(p.stem for p in RACE_DIR.glob("*.yaml"))
    budgets = set()
    targets = {}
    for name in swept:
        plain = compose_plain(["experiment=policy_race", f"+experiment/race={name}"])
        preflight(plain)
        targets[name] = plain["sync"]["_target_"].rsplit(".", 1)[1]
        first_n = plain["schedule"].get("window_size", plain["schedule"].get(
            "initial_window_size"))
        budgets.add((plain["data"]["_target_"], plain["model"]["_target_"],
                     plain["trainer"]["devices"], plain["trainer"]["max_epochs"],
                     plain["schedule"]["micro_batch_size"], first_n,
                     plain["seed"], plain["optimizer"]["lr"]))
    assert budgets == {("gradsync.data.corpus.stdlib_text", "gradsync.models.Transformer", 2, 2, 8,
                        4, 0, 0.005)}
    assert targets["always"] == "AlwaysSync" and targets["amp_aware_bf16"] == "AmpAwareSync"
    assert targets["accumulate"] == targets["powersgd"] == targets["adaptive"] \
        == "AccumulateSync"
    assert (targets["local_sgd_h8"], targets["diloco_h16"]) == ("local_sgd", "diloco")


def test_window_search_sweeps_fixed_windows_and_adaptive_at_the_same_sample_budget():
    """N = 1..16 and the adaptive schedule (with and without AdaScale) on the race's data, model
    and optimizer; every fixed N warms up and evaluates at the same samples (16 x N chunks per
    step), the adaptive ones count their LR schedule in steps of 64 chunks."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["experiment=window_search"],
                      return_hydra_config=True)
    swept = cfg.hydra.sweeper.params["+experiment/window"].split(",")
    assert sorted(swept) == sorted(p.stem for p in (Path(CONF_DIR) / "experiment" / "window")
                                   .glob("*.yaml"))
    seen = {}
    for name in swept:
        plain = compose_plain(["experiment=window_search", f"+experiment/window={name}"])
        preflight(plain)
        assert (plain["data"]["max_bytes"], plain["trainer"]["max_epochs"],
                plain["optimizer"]["lr"], plain["noise_scale"]["enabled"]) == (600000, 2,
                                                                               0.005, True)
        s, t = plain["schedule"], plain["trainer"]
        seen[name] = (s["name"], s.get("window_size"), plain["lr_scaling"]["name"],
                      plain["lr_scheduler"]["warmup_steps"], t["eval_every_steps"])
    for n in (1, 2, 4, 8):
        assert seen[f"n{n}"] == ("constant", n, "none", 40 // n, 16 // n)
    assert seen["n16"] == ("constant", 16, "none", 3, 1)
    assert seen["adaptive"] == ("adaptive", None, "adascale", 10, 4)
    assert seen["adaptive_plain"] == ("adaptive", None, "none", 10, 4)


@pytest.mark.slow
def test_a_race_job_records_the_corpus_and_its_bytes_and_seconds_per_row(tmp_path, cli_env):
    """One real contestant for 3 steps: run_info.json holds the corpus digest; every metrics row
    and every evaluation row holds the cumulative all-reduce bytes and loop seconds."""
    root = tmp_path / "lib"  # a small corpus of its own: the same files on every Python
    root.mkdir()
    for i in range(30):
        (root / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n\n" * 40)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", "experiment=policy_race",
         "+experiment/race=always", f"data.root={root}", "data.eval_fraction=0.3",
         "trainer.max_steps=3", "trainer.eval_every_steps=2", "trainer.log_every_windows=1",
         "trainer.progress_bar=false", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, env=cli_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    info = json.loads((run_dir / "run_info.json").read_text())["data"]
    assert info == corpus.provenance(max_len=128, max_bytes=600000, eval_fraction=0.3,
                                     root=str(root))
    assert info["train_files"] + info["eval_files"] == 30 and info["eval_files"] >= 1
    s = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    per_step = s["allreduce_bytes"][0] // 3  # always: 4 all-reduces of every gradient a step
    assert s["sync_backwards"] == [12, 12]
    assert [r["allreduce_bytes"] for r in rows] == [per_step, 2 * per_step, 3 * per_step]
    assert 0 < rows[0]["train_s"] < rows[1]["train_s"] < rows[2]["train_s"] == s["train_s"]
    assert [(e["step"], e["samples"], e["allreduce_bytes"]) for e in evals] == \
        [(2, rows[1]["samples"], 2 * per_step), (3, s["samples_seen"], 3 * per_step)]
    assert evals[-1]["loss"] == s["eval"]["loss"] and evals[0]["train_s"] == rows[1]["train_s"]
    assert math.log(256) > evals[0]["loss"] > 0  # nats per byte, below uniform
