"""Renamed options: an old name answers with one line naming the new one (exit 2), whether it
comes as a command-line override (``schedule.every=8``) or from a YAML file of one's own (an
experiment preset, a ``--config-dir``). One line per rename in ``RENAMED``; the glossary of the
words the new names use is in docs/architecture.md ("Glossary"). A component's own option
(sync.warmup_steps of local SGD, not every sync target's) is renamed on its target instead: its
`renamed` mapping (sync/policy.py RENAMED), read by components.check and errors.py, in the same
words."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from typing import Any

from gradsync.components import ConfigError, renamed_line

# old dotted key -> the new one (and, after a space, what it counts or where it went)
RENAMED: dict[str, str] = {
    # the window is micro-batches of micro_batch_size samples: the schedule's, not the data's
    "data.micro_batch_size": "schedule.micro_batch_size",
    "schedule.every": "schedule.every_steps (optimizer steps between the adaptive schedule's "
                      "decisions)",
    # the engine's settings: a group of their own (conf/engine/<name>.yaml, EngineConfig)
    "trainer.engine": "engine=<name> (a config group: conf/engine/; engine.name in a YAML file)",
    "trainer.fsdp_units": "engine.fsdp_units",
    "trainer.replicas": "engine.replicas",
    "trainer.bucket_cap_mb": "engine.bucket_cap_mb",
    "trainer.gradient_as_bucket_view": "engine.gradient_as_bucket_view",
    "trainer.allreduce": "engine.allreduce",
    "trainer.find_unused_parameters": "engine.find_unused_parameters",
    "trainer.sync_batchnorm": "engine.sync_batchnorm",
    "trainer.trace_sync": "engine.trace_sync",
    # torch.compile and the noise scale: their own groups (CompileConfig, NoiseScaleConfig)
    "trainer.compile": "compile.enabled",
    "trainer.compile_backend": "compile.backend",
    "trainer.compile_mode": "compile.mode",
    "trainer.compile_dynamic": "compile.dynamic",
    "trainer.noise_scale": "noise_scale.enabled",
    "trainer.noise_scale_decay": "noise_scale.decay",
    # the window's size N (the glossary's word), and the cadences named with their unit
    "schedule.accum_steps": "schedule.window_size",
    "schedule.accum_steps_by_epoch": "schedule.window_size_by_epoch",
    "schedule.initial_accum_steps": "schedule.initial_window_size",
    "schedule.min_accum_steps": "schedule.min_window_size",
    "schedule.max_accum_steps": "schedule.max_window_size",
    "trainer.log_every": "trainer.log_every_windows (windows between logs, an fp16-skipped "
                         "step's included)",
    "trainer.eval_every": "trainer.eval_every_steps",
    "trainer.checkpoint_every": "trainer.checkpoint_every_steps",
}

# an option whose new name holds the same value: a config recorded under the old one (a
# checkpoint's) reads as the new one
_KEY = re.compile(r"[a-z_]+(\.[a-z_]+)+")
MOVED: dict[str, str] = {old: new.split(" ", 1)[0] for old, new in RENAMED.items()
                         if _KEY.fullmatch(new.split(" ", 1)[0])}


# a field of the files a run writes (summary.json, metrics rows, a checkpoint's progress) renamed
# since (old -> new): a file written before reads under today's names
RECORD_RENAMED: dict[str, str] = {"accum_steps": "window_size", "epoch_step": "epoch_windows"}


def renamed_record(record: dict[str, Any]) -> dict[str, Any]:
    """A record (a summary, a metrics row, a checkpoint's progress) with each old field under
    its new name, where the new one is not there already: a copy in the same order; the record
    itself when it holds no old field."""
    moved = {old: new for old, new in RECORD_RENAMED.items()
             if old in record and new not in record}
    if not moved:
        return record
    return {moved.get(k, k): v for k, v in record.items()}


def renamed(key: str) -> str | None:
    """The message for an old key (``+``/``++``/``~`` prefixes ignored), or None."""
    key = key.lstrip("+~")
    new = RENAMED.get(key)
    return None if new is None else renamed_line(key, new)


def refuse_renamed_overrides(overrides: Iterable[str]) -> None:
    """ConfigError for the first command-line override that sets an old name."""
    for arg in overrides:
        message = renamed(arg.partition("=")[0])
        if message:
            raise ConfigError(message)


def refuse_renamed_keys(plain: dict[str, Any]) -> None:
    """ConfigError for the first old name in a composed config (plain data)."""
    for old in RENAMED:
        node, last = _holder(plain, old)
        if node is not None and last in node:
            raise ConfigError(renamed_line(old, RENAMED[old]))


def _holder(plain: dict[str, Any], key: str) -> tuple[dict[str, Any] | None, str]:
    """The mapping a dotted key's last part would sit in (None where a parent is missing or
    not a mapping), and that last part."""
    *parents, last = key.split(".")
    node: Any = plain
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), last


def upgrade_renamed_keys(plain: dict[str, Any]) -> dict[str, Any]:
    """A config recorded under old names (a checkpoint's, written before a rename) with each
    value moved to its new name (MOVED), where the new name is not set already; a copy, the
    rest as it was. The same run then compares equal to a config composed today."""
    out = copy.deepcopy(plain)
    for old, new in MOVED.items():
        node, last = _holder(out, old)
        if node is None or last not in node:
            continue
        value = node.pop(last)
        *new_parents, new_last = new.split(".")
        target = out
        for part in new_parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                break
        else:
            target.setdefault(new_last, value)
    return out
