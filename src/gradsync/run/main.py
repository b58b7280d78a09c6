"""gradsync-train: compose the config with Hydra, validate it, and launch the workers.

The only module besides config.py that knows Hydra. Bad input ends in one line on stderr and
exit code 2, before any worker starts; set HYDRA_FULL_ERROR=1 for the full traceback.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from gradsync.components import cwd_importable, describe
from gradsync.config.schema import RunConfig
from gradsync.config.validate import (
    EXTRA,
    RUNTIME,
    ConfigError,
    accepted_keys,
    register_configs,
    resolve_world_size,
    schema_keys,
    to_plain,
    validate,
)
from gradsync.run import slurm, sweep
from gradsync.run.devices import DeviceError, check_cuda
from gradsync.run.faults import exit_now, signal_name
from gradsync.run.launch import (
    Interrupted,
    WorkerFailed,
    adopt_submitit_ranks,
    launch,
    rank0_now,
    under_torchrun,
)
from gradsync.run.ranks import is_rank0, job_rank
from gradsync.run.rundir import Claim, RunDirBusy, remove_if_unused, staging_name
from gradsync.run.worker import pick_backend
from gradsync.train.checkpoint import ResumeError, resolve_resume
from gradsync.train.metrics import final_metrics, flat_hparams, write_hparams, write_json_atomic
from gradsync.train.repro import run_info, write_run_info

register_configs()
# Under torchrun and submitit every rank runs this app: conf/config.yaml names the run dir with
# rank 0's clock and lets only rank 0 write Hydra's own files (.hydra/, the job's log file).
OmegaConf.register_new_resolver("rank0_now", rank0_now, use_cache=True, replace=True)
OmegaConf.register_new_resolver(
    "if_rank0", lambda value, other: value if is_rank0() else other, replace=True)
# Under SLURM the run dir is named after the job and `resume` defaults to auto (slurm.py).
OmegaConf.register_new_resolver(
    "run_name", lambda fmt: slurm.run_name() or rank0_now(fmt), use_cache=True, replace=True)
OmegaConf.register_new_resolver("default_resume", slurm.default_resume, replace=True)
# Hydra's files go to a dir of this start's own until it is accepted (rundir.py)
OmegaConf.register_new_resolver("hydra_staging", staging_name, replace=True)


def conf_dir() -> str:
    """The configs: the repo's top-level conf/ when running from a source checkout (an editable
    install: people read and edit them there), else the copy shipped inside the package."""
    repo_conf = Path(__file__).resolve().parents[3] / "conf"
    if (repo_conf / "config.yaml").is_file():
        return str(repo_conf)
    return str(Path(__file__).resolve().parents[1] / "conf")


CONF_DIR = conf_dir()


# Mappings an override replaces whole (Hydra merges `key={...}` into the existing mapping, and
# refuses a new key of it in struct mode): `key={0:2,3:8}` becomes `key=null ++key={0:2,3:8}`.
REPLACED_MAPPINGS = ("schedule.accum_steps_by_epoch",)


def replace_mappings(overrides: list[str]) -> list[str]:
    out = []
    for arg in overrides:
        key, _, value = arg.partition("=")
        if key in REPLACED_MAPPINGS and value.startswith("{") and value.endswith("}") \
                and "},{" not in value.replace(" ", ""):
            out += [f"{key}=null", f"++{key}={value}"]
        else:
            out.append(arg)
    return out


def compose_plain(overrides: list[str]) -> dict:
    """The config the command line composes from these overrides, as plain data (not yet
    validated): for tests and benchmarks that run the pieces without a Hydra job."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_plain(compose("config", overrides=replace_mappings(overrides)))


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def hydra_main(cfg: DictConfig) -> dict:
    adopt_submitit_ranks()
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    staged = run_dir / hc.output_subdir if hc.output_subdir else None
    try:
        # rank 0 holds the run dir; Hydra's files become its .hydra/ once the start is accepted
        with Claim(run_dir, staged, lock=is_rank0()) as claim:
            return _start(cfg, hc.mode, run_dir, claim)
    except RunDirBusy as e:
        return _fail(hc.mode, run_dir, "run dir in use", str(e), 2, record=False)


def _start(cfg: DictConfig, mode: RunMode | None, run_dir: Path, claim: Claim) -> dict:
    try:
        plain = to_plain(cfg)
        validate(plain, torch.cuda.is_available())
        check_devices(plain)
    except Exception as e:  # a component's own check may raise anything: still one line
        if _traceback_wanted():
            raise
        message = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        return _refuse(mode, run_dir, claim, "config error", _first_line(message))
    try:
        _resolve_resume(plain, run_dir)
    except ResumeError as e:
        return _refuse(mode, run_dir, claim, "resume refused", str(e))
    claim.accept()
    try:
        return _train(plain, mode, run_dir)
    except Exception as e:  # a full disk, say: reported as what it is, not as a config error
        if _traceback_wanted():
            raise
        return _fail(mode, run_dir, "error", f"{type(e).__name__}: {e}", 1)


def _refuse(mode: RunMode | None, run_dir: Path, claim: Claim, kind: str, message: str) -> dict:
    """A start refused before training: a new run dir goes (a sweep keeps the job's .hydra/ to
    list it as failed), an earlier run's files stay as they were."""
    new = _is_new(run_dir)
    if mode == RunMode.RUN:
        remove_if_unused(run_dir)
    elif new:
        claim.accept()
    return _fail(mode, run_dir, kind, message, 2, record=new)


def _traceback_wanted() -> bool:
    return os.environ.get("GRADSYNC_TRACEBACK") == "1"


def _train(plain: dict, mode: RunMode | None, run_dir: Path) -> dict:
    if is_rank0():
        _write_run_info(plain, run_dir)
    started = time.perf_counter()
    try:
        signum = launch(RunConfig.from_plain(plain), run_dir)
    except WorkerFailed as e:  # under torchrun this process is the rank that failed: its
        # training (kept alive by the error's context) must not be freed (faults.exit_now)
        return _fail(mode, run_dir, "training failed", str(e), 1, hard=under_torchrun())
    except Interrupted as e:
        print(f"gradsync: {e}", file=sys.stderr, flush=True)
        sys.exit(128 + e.signum)
    if not is_rank0():
        return {}
    summary = json.loads((run_dir / "summary.json").read_text())
    if signum and summary["status"] == "interrupted":  # the workers may have got SIGTERM
        summary["stopped_by"] = signal_name(signum)
    summary["wall_s"] = time.perf_counter() - started  # the whole job: spawn, set-up, training
    write_json_atomic(run_dir / "summary.json", summary)
    if summary["status"] == "interrupted":
        _stopped(run_dir, summary, plain["trainer"].get("requeue", True))
    write_hparams(run_dir / "tb", flat_hparams(plain), final_metrics(summary),
                  summary["optimizer_steps"])
    _report(run_dir, summary)
    return summary


def _first_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " ".join(lines[:1]) or "unknown error"


def _fail(mode: RunMode | None, run_dir: Path, kind: str, message: str, code: int,
          record: bool = True, hard: bool = False) -> dict:
    """One line and a non-zero exit for a single run; in a sweep, a failed row and the sweep
    goes on (SweepSummary makes it exit 1 at the end). record=False leaves the run dir's
    summary.json alone; hard: the exit frees nothing (faults.exit_now)."""
    failed = {"status": "failed", "error": f"{kind}: {message}"}
    if record and run_dir.is_dir() and is_rank0():
        try:
            write_json_atomic(run_dir / "summary.json", failed)
        except OSError:  # a full disk: the line below says what went wrong
            pass
    print(f"gradsync: {kind}: {message}", file=sys.stderr, flush=True)
    if mode == RunMode.RUN:
        if hard:
            exit_now(code)
        sys.exit(code)
    return failed  # raising would make Hydra's sweeper stop and skip on_multirun_end


class SweepSummary(Callback):
    """conf/config.yaml registers it under hydra.callbacks. When a multirun ends it writes the
    sweep summary from the job dirs, prints it, and ends the sweep with exit code 1 if any job
    failed: sys.exit, because Hydra turns exceptions raised in callbacks into warnings.
    target_loss (hydra.callbacks.sweep_summary.target_loss): the eval loss the to-target
    columns measure; null: the worst final eval loss among the completed jobs."""

    def __init__(self, target_loss: float | None = None) -> None:
        self.target_loss = target_loss

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            result = sweep.write_summary(sweep_dir, self.target_loss)
        except Exception as e:  # a warning and exit code 0 otherwise
            print(f"gradsync: sweep summary failed: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(1)
        print(f"\n{result.markdown}", flush=True)
        if result.failed:
            print(f"gradsync: sweep: {result.failed} of {result.jobs} jobs failed; see "
                  f"{sweep_dir / 'sweep_summary.md'}", file=sys.stderr, flush=True)
            sys.exit(1)


def _is_new(run_dir: Path) -> bool:
    """A start refused in a run dir that holds an earlier run's outputs must not overwrite
    them."""
    return not (run_dir / "summary.json").exists()


def _resolve_resume(plain: dict, run_dir: Path) -> None:
    """Pick the checkpoint to start from (refusing incompatible ones) and hand the workers its
    path in place of `resume`."""
    notes: list[str] = []
    try:
        path = resolve_resume(plain["resume"], run_dir, plain, resolve_world_size(plain), notes)
    finally:
        for note in notes:
            print(f"gradsync: resume: {note}", file=sys.stderr, flush=True)
    plain["resume"] = str(path) if path else "none"
    if path and is_rank0():
        print(f"gradsync: resuming from {path}", file=sys.stderr, flush=True)


def _write_run_info(plain: dict, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    resumed = None if plain["resume"] == "none" else plain["resume"]
    info = run_info(plain, Path(CONF_DIR).parent, pick_backend(plain["trainer"]["backend"]),
                    resolve_world_size(plain), resumed)
    for group in RUNTIME:  # what a component says of itself: e.g. a corpus's SHA-256
        described = describe(plain[group], RUNTIME[group], EXTRA.get(group, ()))
        if described is not None:
            info[group] = described
    write_run_info(run_dir / "run_info.json", info)


def _stopped(run_dir: Path, s: dict, requeue: bool) -> None:
    """A run stopped by a signal after checkpointing: say where, and how to go on. Under SLURM
    a preemption warning (SIGUSR1/SIGUSR2) requeues the job (the checkpoint is durable now)."""
    signum = signal.Signals[s["stopped_by"]]
    job = slurm.job_id()
    how = (f"continue with: gradsync-train resume=auto {shlex.quote(f'hydra.run.dir={run_dir}')} "
           "(and the same overrides)")
    if job and signum in slurm.PREEMPT_SIGNALS and requeue:
        how = slurm.requeue(job)
    print(f"gradsync: stopped by {s['stopped_by']} after optimizer step "
          f"{s['optimizer_steps']}; checkpoint {s['checkpoint']}\n  {how}", file=sys.stderr,
          flush=True)
    sys.exit(128 + signum)


def check_devices(plain: dict) -> None:
    """On nccl: enough GPUs for the ranks of this process, with the precision native on them
    (DeviceError -> ConfigError). Creates no CUDA context: the launcher (or a torchrun rank
    before set_device) must not hold one on GPU 0."""
    if pick_backend(plain["trainer"]["backend"]) != "nccl":
        return
    spawned = not under_torchrun()
    world = plain["trainer"]["devices"] if spawned else int(os.environ["WORLD_SIZE"])
    try:
        check_cuda(plain["precision"]["name"], job_rank(), world, spawned)
    except DeviceError as e:
        raise ConfigError(str(e)) from None


def _report(run_dir: Path, s: dict) -> None:
    evals = " ".join(f"eval_{k}={v:.4f}" for k, v in s["eval"].items())
    print(f"\ngradsync: outputs in {run_dir}\n"
          f"  steps={s['optimizer_steps']} samples={s['samples_seen']} "
          f"final_train_loss={s['final_train_loss']:.4f} {evals} "
          f"samples/s={s['samples_per_s']:.0f} wall_s={s['wall_s']:.1f}\n"
          f"  TensorBoard: tensorboard --logdir {run_dir / 'tb'}", flush=True)


def one_line(exc: BaseException) -> str:
    """Hydra/OmegaConf errors as one line naming the key and what is allowed."""
    cause = exc.__cause__
    text = f"{exc}\n{cause}" if cause else str(exc)
    missing = re.search(r"Could not find '([^']+)/([^']+)'", text)
    if missing:
        group, option = missing.groups()
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        return f"{group}={option}: no such option; choose one of: {', '.join(options)}"
    full_key = re.search(r"full_key: (\S+)", text)
    if full_key and re.search(r"Key '[^']+' (is )?not in", text):
        obj = re.search(r"object_type=(\w+)", text)
        group = full_key.group(1).split(".")[0]
        if obj and obj.group(1) == "dict" and group in RUNTIME:
            node = _chosen_option(group)
            return (f"{full_key.group(1)}: unknown key for {node.get('_target_')}; accepted "
                    f"keys: {accepted_keys(group, node)}")
        keys = sorted(schema_keys(obj.group(1))) if obj else []
        return f"{full_key.group(1)}: unknown key; allowed keys: {', '.join(keys)}"
    if full_key:
        return f"{full_key.group(1)}: {str(cause or exc).strip().splitlines()[0]}"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _chosen_option(group: str) -> dict:
    """The YAML of a component group's option chosen on the command line (else the default):
    for an error message about one of its keys."""
    import yaml

    option = next((a.partition("=")[2] for a in sys.argv[1:] if a.startswith(f"{group}=")),
                  None)
    if option is None:
        defaults = yaml.safe_load((Path(CONF_DIR) / "config.yaml").read_text())["defaults"]
        option = next((d[group] for d in defaults if isinstance(d, dict) and group in d), "")
    path = Path(CONF_DIR) / group / f"{option}.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, ValueError):
        return {}


MULTIRUN_FLAGS = {"-m", "--multirun", "hydra.mode=MULTIRUN"}
INSPECT_PARAMS = "+inspect=params"


def inspect_params(overrides: list[str]) -> None:
    """`gradsync-train ... +inspect=params`: the model's parameters (name, shape, bytes) and the
    sync.groups rule each one falls under, from the config the same overrides compose; nothing
    is trained and no run dir is made. Exit 2 with one line for a bad config."""
    from gradsync.sync.layer_sync import model_parameters, parameter_table

    try:
        plain = compose_plain(overrides)
        validate(plain, torch.cuda.is_available())
        sync = plain["sync"]
        infos = model_parameters(plain["model"], plain["data"], plain["seed"])
        print(parameter_table(infos, sync.get("groups"), sync.get("comm_dtype", "fp32")))
    except Exception as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        message = str(e) if isinstance(e, ConfigError) else one_line(e)
        print(f"gradsync: config error: {_first_line(message)}", file=sys.stderr)
        sys.exit(2)


def main() -> None:
    if INSPECT_PARAMS in sys.argv[1:]:
        cwd_importable()
        inspect_params([a for a in sys.argv[1:] if a != INSPECT_PARAMS])
        return
    slurm.adopt_srun_ranks()  # a plain srun task becomes an env:// rank, as under torchrun
    if under_torchrun() and MULTIRUN_FLAGS & set(sys.argv[1:]):
        # Each job of a sweep joins a process group again through the same torchrun store,
        # which outlives the previous job's group: the second job hangs there. Refuse up front.
        print("gradsync: config error: a multirun (-m) under torchrun is not supported: run one "
              "job per torchrun, or sweep through hydra/launcher=slurm (one SLURM job per run)",
              file=sys.stderr)
        sys.exit(2)
    # Hydra prints its own multi-line errors unless HYDRA_FULL_ERROR=1, which makes it raise:
    # we then print one line ourselves, or the traceback if the user asked for it.
    user_wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    if user_wants_traceback:
        os.environ["GRADSYNC_TRACEBACK"] = "1"
    if any(a.split("=", 1)[0].lstrip("+") == "hydra.run.dir" and not a.split("=", 1)[1].strip()
           for a in sys.argv[1:] if "=" in a):
        print("gradsync: config error: hydra.run.dir='' is not allowed: a directory path (empty "
              "would write into the current directory)", file=sys.stderr)
        sys.exit(2)
    cwd_importable()  # a user's own _target_ modules, next to where they run
    sys.argv[1:] = replace_mappings(sys.argv[1:])
    try:
        hydra_main()
    except KeyboardInterrupt:  # a Ctrl-C before the workers started (they handle it after)
        print("gradsync: interrupted before training started", file=sys.stderr)
        sys.exit(128 + signal.SIGINT)
    except Exception as e:  # raised while Hydra composed the config
        if user_wants_traceback:
            raise
        print(f"gradsync: config error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
