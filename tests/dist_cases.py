"""Functions the DDP tests run on every rank of the pool (see dist_pool.py). They use the
project's real pieces on a real gloo process group and return plain tensors/numbers."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils.deterministic
from torch.nn.parallel import DistributedDataParallel

from gradsync.components import build
from gradsync.config.schema import RunConfig
from gradsync.data.contract import mse_per_sample
from gradsync.data.tokens import pad_batch, token_loss_per_sample
from gradsync.engines import capabilities
from gradsync.engines.torch_ddp import TorchDDP
from gradsync.models import MLP, Transformer
from gradsync.run import summary as run_summary
from gradsync.run.worker import run_training
from gradsync.sync.comm import install_counting_hook
from gradsync.sync.policy import SyncPolicy, as_policy
from gradsync.train import checkpoint
from gradsync.train.loop import run_window
from gradsync.train.normalize import BySamples, build_normalizer
from gradsync.train.precision import Precision
from gradsync.train.windows import Window


def window_data(seed: int, world: int, micro_sizes: list[int], in_dim: int = 6, out_dim: int = 3):
    """Every rank's micro-batches of one window, [rank][micro] -> (x, y), the same everywhere."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(m, in_dim, generator=g), torch.randn(m, out_dim, generator=g))
             for m in micro_sizes] for _ in range(world)]


TARGETS = {"always": "gradsync.sync.policies.AlwaysSync",
           "accumulate": "gradsync.sync.policies.AccumulateSync",
           "amp_aware": "gradsync.sync.policies.AmpAwareSync"}


def policy(name: str, uses_scaler: bool = False, **kwargs) -> SyncPolicy:
    """A built-in policy, built as the worker builds it from its config node."""
    return as_policy(build({"_target_": TARGETS[name], **kwargs}, {"uses_scaler": uses_scaler}))


def tiny_model(seed: int = 0):
    torch.manual_seed(seed)
    return MLP(6, 3, [5], "tanh")


def grads_per_micro_step(policy_name: str, micro_sizes: list[int]) -> dict:
    """Runs the loop's real run_window on one window and snapshots this rank's flattened
    gradient after every micro-step (the iterator is asked for micro-batch i+1 only after
    micro-step i finished)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(tiny_model(), gradient_as_bucket_view=True)
    counts = install_counting_hook(ddp)
    mine = window_data(0, world, micro_sizes)[rank]
    snaps: list[torch.Tensor] = []

    def flat_grad():
        return torch.cat([p.grad.detach().flatten().clone() for p in ddp.parameters()])

    def batches():
        for i, b in enumerate(mine):
            if i:
                snaps.append(flat_grad())
            yield b

    window = Window(0, len(micro_sizes), sum(micro_sizes), sum(micro_sizes),
                    sum(micro_sizes) * world, batches=batches())

    run_window(TorchDDP(ddp), window, policy(policy_name), mse_per_sample, BySamples(world),
               Precision("fp32", "cpu"))
    snaps.append(flat_grad())
    return {"grads": snaps, "sync_backwards": counts.sync_backwards,
            "allreduce_calls": counts.allreduce_calls, "allreduce_bytes": counts.allreduce_bytes}


def train_run(cfg: dict, run_dir: str) -> dict:
    """The worker's real training function on the pool's process group, as the job process
    runs it: `resume` resolved first (on each rank's run dir: under torchrun every node's job
    resolves it on its own disk), rank 0's summary written to summary.json."""
    summary = run_training(job_config(cfg, Path(run_dir)), Path(run_dir))
    params = None
    if dist.get_rank() == 0:
        run_summary.write(Path(run_dir), summary)
        params = checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")["model"]
    return {"summary": summary, "params": params}


def job_config(cfg: dict, run_dir: Path) -> RunConfig:
    """The RunConfig a job hands its ranks: `resume` resolved to a checkpoint path, or none."""
    run = RunConfig.from_plain(cfg)
    path = checkpoint.resolve_resume(run.resume, run_dir, cfg, dist.get_world_size(), [],
                                     sharded=capabilities(run.engine.name).sharded)
    run.resume = str(path) if path else "none"
    return run


def run_training_with(wrap, cfg: dict, run_dir: str,
                      job: RunConfig | None = None) -> tuple[dict, list[dict] | None]:
    """The worker's real run_training, the parts it builds first passed through wrap(parts) (to
    record or poison something); returns the summary and rank 0's rows of metrics.jsonl.
    job: the RunConfig the job handed over (default: job_config(cfg, run_dir))."""
    import json

    from gradsync.run import worker

    build = worker.build_parts
    worker.build_parts = lambda *args, **kw: wrap(build(*args, **kw))
    try:
        summary = worker.run_training(job or job_config(cfg, Path(run_dir)), Path(run_dir))
    finally:
        worker.build_parts = build
    rows = None
    if dist.get_rank() == 0:
        rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def train_run_rows(cfg: dict, run_dir: str, dir_per_rank: bool = False) -> dict:
    """train_run plus the rows of metrics.jsonl (rank 0). dir_per_rank: each rank gets
    run_dir/rank<r>, as nodes without a shared disk would under torchrun."""
    import json

    if dir_per_rank:
        run_dir = f"{run_dir}/rank{dist.get_rank()}"
    out = train_run(cfg, run_dir)
    if dist.get_rank() == 0:
        text = (Path(run_dir) / "metrics.jsonl").read_text()
        out["rows"] = [json.loads(line) for line in text.splitlines()]
    out["deterministic"] = torch.are_deterministic_algorithms_enabled()
    out["nan_fill"] = torch.utils.deterministic.fill_uninitialized_memory  # type: ignore
    return out


def train_run_expecting(cfg: dict, run_dir: str, error: str) -> str:
    """Runs training that must raise `error` (a class name) on every rank; returns its text
    (the pool stays usable: no rank is left in a collective)."""
    try:
        run_training(RunConfig.from_plain(cfg), Path(run_dir))
    except Exception as e:
        if type(e).__name__ != error:
            raise
        return str(e)
    raise AssertionError(f"training did not raise {error}")


def agree_on_stop(polls: int, flag_rank: int, flag_at: int) -> int:
    """Polls a StopAgreement once per 'step'; rank flag_rank raises its flag before poll
    flag_at. Returns the poll at which this rank is told to stop (-1: never)."""
    from gradsync.run.faults import StopAgreement, StopFlag

    flag = StopFlag()
    group = dist.new_group(backend="gloo")
    agreement = StopAgreement(flag, group, dist.get_world_size(), interval_s=0.0)
    stopped_at = -1
    for i in range(polls):
        if dist.get_rank() == flag_rank and i == flag_at:
            flag.signum = 15
        if agreement.poll():
            stopped_at = i
            break
    agreement.close()
    dist.destroy_process_group(group)
    return stopped_at


# --- token-normalised windows (tests/test_lm.py) ----------------------------------------------
LM_VOCAB = 11
# [rank][micro-batch] -> sequence lengths. Every rank holds the same number of sequences (as
# the DistributedSampler ensures) but very different token counts (rank 0: 31+2 then 1+2 loss
# tokens; rank 1: 4+3 then 39+32), so per-micro-batch means weigh tokens very unequally.
LM_LENGTHS = [[[32, 3], [2, 3]], [[5, 4], [40, 33]]]


def lm_window_batches(lengths=LM_LENGTHS) -> list[list[list[torch.Tensor]]]:
    """[rank][micro] -> list of token sequences, the same in every process."""
    g = torch.Generator().manual_seed(0)
    return [[[torch.randint(0, LM_VOCAB, (n,), generator=g) for n in micro] for micro in rank]
            for rank in lengths]


def tiny_lm(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(LM_VOCAB, 40, d_model=8, n_layers=1, n_heads=2, mlp_ratio=2)


def lm_window_grad(normalize: str, precision: str = "fp32",
                   tokens_per_sample: float = 20.0) -> dict:
    """One window through the loop's real run_window, then the scaler's unscale and the
    normaliser's rescale, as optimizer_step does; returns this rank's gradient and loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(tiny_lm(), gradient_as_bucket_view=True)
    mine = [pad_batch(seqs) for seqs in lm_window_batches()[rank]]
    samples = sum(len(x) for x, _ in mine)
    norm = build_normalizer(normalize, "tokens", world, torch.device("cpu"), tokens_per_sample)
    prec = Precision(precision, "cpu")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.0)
    loss = run_window(TorchDDP(ddp),
                      Window(0, len(mine), samples, samples, samples * world, batches=iter(mine)),
                      policy("accumulate"), token_loss_per_sample, norm, prec)
    prec.unscale(opt)
    norm.before_step(ddp.parameters())
    grad = torch.cat([p.grad.detach().flatten() for p in ddp.parameters()])
    return {"grad": grad, "loss": float(loss), "scale": prec.scale}


# --- data that does not divide evenly (tests/test_uneven.py) ------------------------------------
def train_recording_steps(cfg: dict) -> dict:
    """The worker's real parts and loop (no outputs written); at every optimizer step, records
    the parameters the window's forwards used and the gradient the step applies (None: the
    step leaves that parameter alone)."""
    from gradsync.run.worker import build_parts
    from gradsync.train.loop import Progress, train
    from gradsync.train.metrics import RunLog

    p = build_parts(RunConfig.from_plain(cfg), dist.get_rank(), dist.get_world_size(),
                    torch.device("cpu"))
    steps: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    forwards: list[int] = []  # DDP's own forwards: training micro-batches (eval uses .module)
    p.engine.ddp.register_forward_pre_hook(lambda module, args: forwards.append(1))

    def record(optimizer, args, kwargs):
        params = list(p.engine.module.parameters())
        steps.append(([q.detach().clone() for q in params],
                      [None if q.grad is None else q.grad.detach().clone() for q in params]))

    p.optimizer.register_step_pre_hook(record)
    state = train(p, Progress(), RunLog(Path("."), active=False))
    return {"steps": steps, "samples_seen": state.samples_seen, "last_loss": state.last_loss,
            "eval": state.last_eval, "micro_steps": len(forwards),
            "params": [q.detach().clone() for q in p.engine.module.parameters()]}


def own_gpu_refusal(gpus: list[str]) -> str | None:
    """devices.check_own_gpu on the default group, this rank's GPU UUID gpus[rank] (on cuda:0
    of each): its DeviceError's text, or None."""
    from gradsync.core.devices import DeviceError, check_own_gpu

    try:
        check_own_gpu(gpus[dist.get_rank()], 0)
    except DeviceError as e:
        return str(e)
    return None


def train_run_buffers(cfg: dict, run_dir: str) -> dict:
    """train_run, plus this rank's buffers at the end of the run (the model it evaluated)."""
    held = {}

    def keep(parts):
        held["parts"] = parts
        return parts

    summary, _ = run_training_with(keep, cfg, run_dir)
    module = held["parts"].engine.module
    return {"summary": summary,
            "buffers": {n: b.detach().clone() for n, b in module.named_buffers()}}


def counted_tokens(parts):
    """The uniform-length shortcut off: each window's tokens counted and all-reduced."""
    parts.normalizer.uniform = False
    return parts


def as_built(parts):
    return parts


def train_counting_tokens(cfg: dict, run_dir: str, count: bool) -> dict:
    """run_training_with, the token count all-reduced (count) or known from uniform-length
    sequences; rank 0's final parameters and rows."""
    summary, rows = run_training_with(counted_tokens if count else as_built, cfg, run_dir)
    params = (checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")["model"]
              if dist.get_rank() == 0 else None)
    return {"summary": summary, "rows": rows, "params": params}
