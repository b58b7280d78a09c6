"""Configs composed by Hydra exactly as the command line composes them, for runs on the pool
that are compared with runs through the command line."""

from __future__ import annotations

from gradsync.run.main import compose_plain  # registers the schemas
from gradsync.run.preflight import preflight

# 199 samples (prime), 2 ranks, micro 8: 100 positions and 13 micro-batches per rank and epoch
# (the last one 4 positions, on rank 1 3 samples and the sampler's repeat), accum 3 -> windows
# 3,3,3,3,1: 5 optimizer steps per epoch, the last one a partial window; dropout (each rank
# draws its own masks), AdamW, linear warm-up then cosine.
EXACT_RESUME = ["data=synthetic", "data.num_samples=199", "data.eval_samples=64",
                "data.in_dim=8", "data.out_dim=2", "schedule.micro_batch_size=8",
                "model.hidden_sizes=[16]", "model.activation=tanh", "model.dropout=0.1",
                "optimizer=adamw", "optimizer.lr=0.01", "schedule.window_size=3",
                "lr_scheduler.warmup_steps=2", "trainer.threads_per_worker=1",
                "trainer.progress_bar=false"]
STEPS_PER_EPOCH = 5
# A command-line job of that config, 300 steps long, so that a signal sent while it trains lands
# well before its end (the ranks agree on a stop within about 0.1 s, which may be tens of these
# tiny steps). log_every_windows is beyond the run: rows reach metrics.jsonl only through the flush
# before every checkpoint (and at a stop), so a kill -9 that loses rows pending at a checkpoint
# shows.
LONG_JOB = [*EXACT_RESUME, "trainer.max_epochs=60", "trainer.log_every_windows=1000",
            "trainer.checkpoint_every_steps=10", "trainer.keep_checkpoints=3", "seed=11"]
LONG_JOB_STEPS = 60 * STEPS_PER_EPOCH
# what summary.json holds that a resumed run must reproduce exactly (timings aside)
SAME = ("optimizer_steps", "windows", "samples_seen", "final_train_loss", "eval",
        "sync_backwards", "allreduce_calls", "allreduce_bytes", "amp_skipped_steps",
        "amp_final_scale", "amp_aborted_windows", "allreduce_skipped",
        "overflow_flag_allreduces")


def plain_cfg(overrides: list[str]) -> dict:
    cfg = compose_plain(overrides)
    preflight(cfg)
    return cfg


def losses(rows: list[dict]) -> list[tuple]:
    """What must match bitwise in metrics.jsonl: everything a row holds except its timing
    (floats as hex: exact, and a NaN, the loss of an aborted fp16 window, equals itself)."""
    return [(r["window"], r["step"], r["stepped"], r["epoch"], r["samples"], r["lr"].hex(),
             r["loss"].hex()) for r in rows]
