"""accumulate vs amp_aware under bf16 and fp16, side by side in one run.

Each row is a real `gradsync-train` run (its own job, real workers); the table reads their
summary.json files: training samples/s (loop time, without start-up and evaluation) and what
one window (optimizer-step attempt) all-reduced per rank. The last two rows inject overflows
(an initial loss scale of 2^40) to show what overflow consensus saves when steps are skipped.

    .venv/bin/python bench/amp_policies.py [--epochs N] [hydra overrides...]
e.g. `bench/amp_policies.py --epochs 3 model.hidden_sizes=[1024,1024]`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROWS = [
    ("accumulate", "fp32", ["sync=accumulate", "precision=fp32"]),
    ("accumulate", "bf16", ["sync=accumulate", "precision=bf16"]),
    ("amp_aware", "bf16", ["sync=amp_aware", "precision=bf16"]),
    ("accumulate", "fp16", ["sync=accumulate", "precision=fp16"]),
    ("amp_aware", "fp16", ["sync=amp_aware", "precision=fp16"]),
    ("accumulate", "fp16 2^40", ["sync=accumulate", "precision=fp16",
                                 "precision.init_scale=1099511627776"]),
    ("amp_aware", "fp16 2^40", ["sync=amp_aware", "precision=fp16",
                                "precision.init_scale=1099511627776"]),
]


def run(overrides: list[str], run_dir: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.run.main", f"hydra.run.dir={run_dir}",
         "trainer.progress_bar=false", *overrides],
        capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"run failed ({' '.join(overrides)}): {proc.stderr.strip().splitlines()[-1]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=5)
    args, extra = ap.parse_known_args()
    common = [f"trainer.max_epochs={args.epochs}", *extra]
    header = (f"{'policy':<11} {'precision':<10} {'samples/s':>10} {'bytes/window':>13} "
              f"{'flags/window':>13} {'steps':>6} {'skipped':>8} {'aborted':>8} "
              f"{'eval_loss':>10}")
    print(f"gradsync AMP benchmark: default experiment, {' '.join(common)}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for i, (policy, label, overrides) in enumerate(ROWS):
            s = run([*overrides, *common], Path(tmp) / str(i))
            windows = s["windows"]
            print(f"{policy:<11} {label:<10} {s['samples_per_s']:>10.0f} "
                  f"{s['allreduce_bytes'][0] / windows:>13.0f} "
                  f"{s['overflow_flag_allreduces'][0] / windows:>13.2f} "
                  f"{s['optimizer_steps']:>6} {s['amp_skipped_steps']:>8} "
                  f"{s['amp_aborted_windows'][0]:>8} {s['eval']['loss']:>10.4f}", flush=True)


if __name__ == "__main__":
    main()
