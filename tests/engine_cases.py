"""Functions the engine tests (test_gradsync_ddp.py) run on every rank of the pool: both
engines built by their real builders, on real gloo process groups."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import dist_cases
from gradsync.core.memory import storage_bytes
from gradsync.engines import build_engine
from gradsync.engines.trace import SyncTrace, merge
from gradsync.sync.averaging import Averager
from gradsync.sync.comm import CommCounts, InnerHook, Wire
from gradsync.sync.policies import AlwaysSync, last_micro_batch

# Net's layers a, b, c: parameters of 120, 20, 100, 20, 60 and 12 bytes; rebuilt with a cap
# of 50 bytes: [c.bias, c.weight], [b.bias, b.weight], [a.bias, a.weight].
SMALL_CAP_MB = 50 / 2**20


class Net(nn.Module):
    """Three layers; with unused=True a fourth one the forward never touches and one it uses
    only on rank 0, every other forward (a parameter locally unused on one rank)."""

    def __init__(self, unused: bool = False, buffers: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        self.norm = nn.BatchNorm1d(5) if buffers else None
        if unused:
            self.never = nn.Linear(6, 3)
            self.sometimes = nn.Linear(6, 3)
        self.unused = unused
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.norm is not None:
            h = self.norm(h)
        out = self.c(torch.tanh(self.b(h)))
        self.forwards += 1
        if self.unused and dist.get_rank() == 0 and self.forwards % 2:
            out = out + self.sometimes(x)
        return out


class WholeModel(Averager):
    """An averager of the whole model that never averages: the engine leaves the buffers to
    it."""

    whole_model = True


class Recording(AlwaysSync, Wire):
    """`always`, or accumulate's windows, with an all-reduce that records which parameters
    each bucket holds and whether it is the last (the policy is its own wire)."""

    def __init__(self, accumulate: bool, names: dict[int, str]):
        self.accumulate, self.names = accumulate, names
        self.buckets: list[tuple[int, tuple[str, ...], bool]] = []
        self.wire = self

    def should_sync(self, micro_index: int, window_size: int) -> bool:
        return not self.accumulate or last_micro_batch(micro_index, window_size)

    def comm_hook(self) -> InnerHook:
        default = InnerHook()

        def recording(state, bucket):
            self.buckets.append((bucket.index(), tuple(self.names[id(p)]
                                                       for p in bucket.parameters()),
                                 bucket.is_last()))
            return default.hook(state, bucket)

        return InnerHook(recording)


def partitions(engine: str, unused: bool, cap_mb: float | None, windows: int = 3) -> dict:
    """Windows of 2 micro-batches (the second synchronises) on `engine`: the buckets each
    synchronising backward all-reduced, and the parameters after every window."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net(unused)
    policy = Recording(True, {id(p): n for n, p in model.named_parameters()})
    kwargs = {} if cap_mb is None else {"bucket_cap_mb": cap_mb}
    eng = build_engine(engine, model=model, policy=policy, device=torch.device("cpu"),
                       world_size=2, counts=CommCounts(), allreduce="process_group",
                       find_unused_parameters=unused, **kwargs)
    opt = torch.optim.AdamW(eng.parameters(), lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    seen, params = [], []
    for _ in range(windows):
        for i in range(2):
            with eng.micro_batch(policy.should_sync(i, 2)):
                eng(torch.randn(4, 6, generator=g)).square().sum().backward()
        seen.append(policy.buckets)
        policy.buckets = []
        opt.step()
        eng.zero_grad(opt)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return {"buckets": seen, "params": params,
            "grads_none": [n for n, p in model.named_parameters() if p.grad is None]}


def unused_error(engine: str) -> str:
    """A parameter the forward never uses, without find_unused_parameters: the error's text."""
    torch.manual_seed(0)
    model = Net(unused=True)
    policy = Recording(False, {id(p): n for n, p in model.named_parameters()})
    eng = build_engine(engine, model=model, policy=policy, device=torch.device("cpu"),
                       world_size=2, counts=CommCounts(), allreduce="process_group")
    try:
        for _ in range(3):
            with eng.micro_batch(True):
                eng(torch.randn(4, 6)).square().sum().backward()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("no error")


def buffers_and_grads(engine: str, whole_model: bool) -> dict:
    """BatchNorm's running statistics (rank 0's broadcast in the forward that follows a
    synchronising one) and gradient_as_bucket_view off: every rank's buffers and gradients
    after each of 4 micro-batches (windows of 2)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net(buffers=True)
    if rank == 1:  # a different start: the engine's broadcast makes it rank 0's
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    policy = Recording(True, {id(p): n for n, p in model.named_parameters()})
    policy.averager = WholeModel() if whole_model else None  # buffers: each rank's own
    eng = build_engine(engine, model=model, policy=policy, device=torch.device("cpu"),
                       world_size=2, counts=CommCounts(), allreduce="process_group",
                       gradient_as_bucket_view=False)
    g = torch.Generator().manual_seed(rank)
    out = []
    for i in range(4):
        with eng.micro_batch(policy.should_sync(i % 2, 2)):
            eng(torch.randn(4, 6, generator=g)).square().sum().backward()
        out.append(([b.clone() for b in model.buffers()],
                    [p.grad.clone() for p in model.parameters()]))
    return {"steps": out, "start": [p.detach().clone() for p in model.parameters()]}


def traced_run(cfg: dict, run_dir: str) -> dict:
    """dist_cases.train_run, then (rank 0) the ranks' trace files merged as the job process
    merges them: trace.json, metrics.jsonl's rows and the TensorBoard scalars sync/*."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = dist_cases.train_run(cfg, run_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        path = merge(Path(run_dir))
        assert path is not None
        out["trace"] = json.loads(path.read_text())
        out["rows"] = [json.loads(x) for x in
                       (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
        acc = EventAccumulator(str(Path(run_dir) / "tb"))
        acc.Reload()
        out["tb"] = {tag: [(e.step, e.value) for e in acc.Scalars(tag)]
                     for tag in acc.Tags()["scalars"] if tag.startswith("sync/")}
    return out


def overlap_of_a_slow_all_reduce(engine: str) -> dict:
    """A model whose first-ready bucket's all-reduce takes 50 ms (a hook that sleeps on gloo's
    side, after the all-reduce), the rest of the backward ~0: the wait the trace measures."""
    import time

    torch.manual_seed(0)
    model = Net()
    policy = Recording(False, {id(p): n for n, p in model.named_parameters()})
    inner = policy.comm_hook()

    def slow(state, bucket):
        return inner.hook(state, bucket).then(lambda f: (time.sleep(0.05), f.value())[1])

    policy.comm_hook = lambda: InnerHook(slow)  # type: ignore[method-assign]
    trace = SyncTrace(dist.get_rank())
    eng = build_engine(engine, model=model, policy=policy, device=torch.device("cpu"),
                       world_size=2, counts=CommCounts(), allreduce="process_group",
                       trace=trace)
    opt = torch.optim.SGD(eng.parameters(), lr=0.0)
    for _ in range(2):
        with eng.micro_batch(True):
            eng(torch.randn(4, 6)).square().sum().backward()
        eng.zero_grad(opt)
    return {"last": trace.last, "events": trace.pending}


EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "debugging"


def example_run(cfg: dict, run_dir: str, error: str = "") -> dict | str:
    """A run whose components come from examples/debugging (importable on this rank):
    dist_cases.train_run, or train_run_expecting `error`."""
    import sys

    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    if error:
        return dist_cases.train_run_expecting(cfg, run_dir, error)
    return dist_cases.train_run(cfg, run_dir)


def gradient_memory(engine: str, view: bool) -> dict:
    """Two windows of 2 micro-batches with gradient_as_bucket_view `view`: the gradient bytes
    the engine reports, next to those measured: the parameters' gradients and the buckets'
    buffers (torch's reducer's, or gradsync's own), each storage once."""
    torch.manual_seed(0)
    model = Net()
    policy = Recording(True, {id(p): n for n, p in model.named_parameters()})
    eng = build_engine(engine, model=model, policy=policy, device=torch.device("cpu"),
                       world_size=2, counts=CommCounts(), allreduce="process_group",
                       gradient_as_bucket_view=view)
    opt = torch.optim.SGD(eng.parameters(), lr=0.01)
    for _ in range(2):
        for i in range(2):
            with eng.micro_batch(policy.should_sync(i, 2)):
                eng(torch.randn(4, 6)).square().sum().backward()
        grads = [p.grad for p in model.parameters()]  # after the window, before zero_grad
        opt.step()
        eng.zero_grad(opt)
    if engine == "torch_ddp":  # the reducer's buckets, as its comm hook sees them (their like)
        buckets = [b.buffer() for b in eng.ddp.reducer._get_zeros_like_grad_buckets()]
        measured = storage_bytes(grads) + (0 if view else sum(b.nbytes for b in buckets))
    else:
        measured = storage_bytes([*grads, *(b.buffer for b in eng.buckets)])
    return {"reported": eng.memory.grads.unsharded_bytes, "measured": measured,
            "params": sum(p.nbytes for p in model.parameters())}


def batchnorm_statistics(engine: str, sync_batchnorm: bool, device: str = "cpu",
                         train: bool = True) -> dict:
    """components_for_tests.BatchNormMLP on `engine` (engine.sync_batchnorm as given), one
    window of 2 micro-batches of 4 samples (the first inside no_sync), each rank its own data:
    the norm layer's class, this rank's buffers after the window, its inputs and the first
    layer's initial weights. train=False: built only (torch's SyncBatchNorm trains on CUDA)."""
    from components_for_tests import BatchNormMLP

    rank = dist.get_rank()
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # DDP's device_ids: this rank's GPU
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = BatchNormMLP(6, 3).to(dev)
    first = (model.inp.weight.detach().cpu().clone(), model.inp.bias.detach().cpu().clone())
    policy = Recording(True, {id(p): n for n, p in model.named_parameters()})
    eng = build_engine(engine, model=model, policy=policy, device=dev,
                       world_size=2, counts=CommCounts(), allreduce="process_group",
                       sync_batchnorm=sync_batchnorm)
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(4, 6, generator=g) for _ in range(2)]
    if train:
        for i, x in enumerate(xs):
            with eng.micro_batch(policy.should_sync(i, 2)):
                eng(x.to(dev)).square().sum().backward()
    return {"norm": type(eng.module.norm).__name__, "xs": xs, "first": first,
            "buffers": {n: b.detach().cpu().clone() for n, b in eng.module.named_buffers()}}
