"""The faults a nccl run hits that a CPU run cannot see, pinned on the CPU: tensors that
torch's FakeTensorMode places on a fake `cuda:0` (no GPU needed; shapes and devices, no data)
show which device each tensor handed to a collective of the default group is on (nccl serves
CUDA tensors only), where a resumed run's anchor lives, and a stand-in for a nccl work whose
future is done once the collective is queued (its result lands only after `wait()`), as
torch's ProcessGroupNCCL does. tests/test_gpu.py runs the same paths on a real GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from gradsync.core.devices import WrongDevice, on_device
from gradsync.sync import layer_sync
from gradsync.sync.comm import CommCounts
from gradsync.sync.local_sgd import diloco, local_sgd
from gradsync.train import checks, steplog
from gradsync.train.state import to_cpu

CUDA = torch.device("cuda", 0)


def on_fake_cuda(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (built on the meta device, outside the mode) moved to the fake cuda:0 (call
    inside FakeTensorMode)."""
    return model.to_empty(device=CUDA)


class Handed(Exception):
    """Raised by the stand-in collective once it has seen what it was handed."""


def nccl_like(seen: list[torch.device]):
    """A collective of a default group that serves CUDA tensors only (nccl, cuda:gloo): it
    records the device of what it gets and stops there (fake tensors hold no data to reduce)."""
    def collective(tensor_or_list, *more, **kw):
        tensors = [tensor_or_list, *more] if isinstance(tensor_or_list, torch.Tensor) \
            else [*tensor_or_list, *more]
        seen.extend(t.device for t in tensors if isinstance(t, torch.Tensor))
        raise Handed
    return collective


def test_a_tensor_off_the_models_device_is_refused_before_a_default_group_collective():
    t = torch.zeros(2)
    assert on_device(t, torch.device("cpu")) is t
    with pytest.raises(WrongDevice) as e:
        on_device(t, torch.device("meta"))
    assert str(e.value) == ("a tensor on cpu was handed to a collective of the default group, "
                            "whose ranks train on meta: nccl serves only CUDA tensors; build "
                            "it on the model's device")


def test_local_sgd_drift_is_reduced_on_the_models_device(monkeypatch):
    """Fault 1: the log step's MAX all-reduce of the replicas' drift got a CPU float64 tensor:
    on nccl, a crash at the first log step after an averaging. The drifts now ride on the
    losses' all-reduce, in a block built on the model's device."""
    seen: list[torch.device] = []
    monkeypatch.setattr(steplog.dist, "all_reduce", nccl_like(seen))
    monkeypatch.setattr(steplog.dist, "get_rank", lambda group=None: 1)
    p = SimpleNamespace(device=CUDA, world_size=2, noise=None)
    steps = steplog.StepLog.__new__(steplog.StepLog)
    steps.p, steps.rows = p, [{"window": 4, "replica_drift": 0.25}, {"window": 5}]
    with FakeTensorMode(allow_non_fake_inputs=True):
        steps.losses = [torch.zeros((), device=CUDA), torch.zeros((), device=CUDA)]
        assert steps._drift_slots(steps.rows[:1]).device == CUDA
        with pytest.raises(Handed):
            steps.flush(SimpleNamespace(), None)
    assert seen == [CUDA]


def test_check_replicas_gathers_on_the_models_device(monkeypatch):
    """Fault 2: trainer.check_replicas moved the checksums to the CPU, then all-gathered them
    on the default group."""
    seen: list[torch.device] = []
    monkeypatch.setattr(checks.dist, "all_gather", nccl_like(seen))
    monkeypatch.setattr(checks.dist, "get_world_size", lambda group=None: 2)
    model = torch.nn.Linear(3, 2, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(Handed):
        on_fake_cuda(model)
        checks.check_replicas(model, step=4)
    assert seen == [CUDA] * 3  # the two ranks' slots and this rank's checksums


def test_a_resumed_anchor_lives_on_the_models_device():
    """Fault 3: checkpoints load on the CPU; the anchor was built where the saved tensors were,
    and the first averaging after a resume on a GPU failed in torch.sub on mixed devices. The
    model here is on the meta device (no data: any device other than the checkpoint's CPU
    shows where the anchor goes; DiLoCo's outer optimizer is built on the anchor the same
    way, in the same ModelAveraging.start, and is checked on a GPU by tests/test_gpu.py)."""
    saved = local_sgd(every=2, comm_dtype="bf16")  # an fp32 wire keeps no anchor
    saved.start(torch.nn.Linear(3, 2), 0)
    state = to_cpu(saved.state_dict())  # as checkpoint.load(map_location="cpu") gives it
    policy = local_sgd(every=2, comm_dtype="bf16")
    policy.load_state_dict(state)
    assert policy.state_dict()["anchor"] is state["anchor"]  # not started: as it was loaded
    policy.start(torch.nn.Linear(3, 2, device="meta"), 3)
    assert policy.anchor is not None and policy.anchor.flat.device.type == "meta"
    assert {t.device.type for t in policy.anchor.params + policy.anchor.buffers} == {"meta"}


def test_a_diloco_resume_restores_the_outer_momentum_onto_the_anchor():
    saved = diloco(every=2)
    saved.start(torch.nn.Linear(3, 2), 0)
    saved.outer.step(saved.anchor.params, [torch.ones_like(t) for t in saved.anchor.params])
    state = to_cpu(saved.state_dict())
    policy = diloco(every=2)
    policy.load_state_dict(state)
    policy.start(torch.nn.Linear(3, 2), 3)
    opt = policy.outer.opt
    assert opt is not None and opt.param_groups[0]["params"] == policy.anchor.params
    for a, b in zip(saved.outer.opt.state.values(), opt.state.values(), strict=True):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


class NcclLikeFuture(torch.futures.Future):
    """A nccl work's future as torch's ProcessGroupNCCL returns it: complete as soon as the
    collective is queued; the reduced values are there for whoever waits on it (a stream wait
    on the GPU). Here: two ranks holding the same tensor, so the sum is twice it."""

    def __init__(self, tensor: torch.Tensor):
        super().__init__()
        self.tensor = tensor
        self.waited = False
        self.chained: list[torch.futures.Future] = []  # what then() returned
        self.set_result([tensor])

    def then(self, callback):
        """On nccl a CUDA future: its callback runs on a side stream that waits for the
        collective, and the future it returns records that stream's events."""
        child = super().then(callback)
        self.chained.append(child)
        return child

    def wait(self):
        if not self.waited:
            self.tensor.mul_(2)  # the other rank's share arrives
            self.waited = True
        return super().wait()


class NcclLikeWork:
    def __init__(self, tensor: torch.Tensor):
        self.future = NcclLikeFuture(tensor)

    def get_future(self) -> torch.futures.Future:
        return self.future


class Bucket:
    """What a DDP comm hook reads of its GradBucket."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.buf = torch.cat([p.grad.reshape(-1) for p in params])
        self.params = params
        offsets, grads = 0, []
        for p in params:
            grads.append(self.buf[offsets:offsets + p.numel()].view_as(p))
            offsets += p.numel()
        self.grads = grads

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list[torch.nn.Parameter]:
        return self.params

    def gradients(self) -> list[torch.Tensor]:
        return self.grads


def mixed_wire_bucket(monkeypatch):
    """A Linear's gradients in one bucket, its bias on a bf16 wire (sync.groups), every
    all-reduce an NcclLikeWork: (the works, the LayerSync, the bucket, its buffer before)."""
    model = torch.nn.Linear(4, 2)
    for q in model.parameters():
        q.grad = torch.arange(q.numel(), dtype=torch.float32).reshape(q.shape) / 4
    works: list[NcclLikeWork] = []

    def all_reduce(t, op=None, group=None, async_op=False):
        works.append(NcclLikeWork(t))
        return works[-1]

    monkeypatch.setattr(layer_sync.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(layer_sync.dist, "get_world_size", lambda group=None: 2)
    layers = layer_sync.LayerSync([{"params": "bias", "comm_dtype": "bf16"}], None, CommCounts())
    layers.bind(model)
    bucket = Bucket(list(model.parameters()))
    return works, layers, bucket, bucket.buffer().clone()


def test_mixed_wire_groups_wait_on_each_work_before_reading_what_it_reduced(monkeypatch):
    """Fault 4: sync.groups with two wire dtypes read the all-reduced buffers through
    collect_all(...).then(...), which on nccl runs before the reduction lands: each rank kept
    its own gradient / world size. Every rank holds the same gradients here, so the mean over
    ranks is each gradient itself, bit for bit (bf16-exact values)."""
    works, layers, bucket, want = mixed_wire_bucket(monkeypatch)
    out = layer_sync.grouped_allreduce(layers, bucket).wait()  # type: ignore[arg-type]
    assert len(works) == 2 and all(w.future.waited for w in works)  # fp32 and bf16: one work each
    assert out is bucket.buffer() and torch.equal(out, want)


def test_mixed_wire_groups_hand_ddp_a_future_chained_on_the_collectives_own(monkeypatch):
    """Issue 32 fault 3: the copy back was chained on collect_all's future, which has no
    devices: on nccl it ran at once on the backward's compute stream, and its waits queued the
    rest of the backward behind each all-reduce. The future DDP gets must be a then() of the
    last work's own (CUDA) future, as torch's _allreduce_fut returns, and its value the mean."""
    works, layers, bucket, want = mixed_wire_bucket(monkeypatch)
    fut = layer_sync.grouped_allreduce(layers, bucket)  # type: ignore[arg-type]
    assert len(works) == 2
    assert [len(w.future.chained) for w in works] == [0, 1]
    assert works[-1].future.chained[0] is fut
    assert all(w.future.waited for w in works)  # each result waited on before it was read
    assert torch.equal(fut.wait(), want)


class HostReads(TorchFunctionMode):
    """Counts what would wait for the GPU on a CUDA tensor (a read of its value on the host),
    seen on the CPU through torch's function overrides."""

    READS = ("__bool__", "__float__", "__int__", "item", "tolist")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_finite_check_before_a_checkpoint_reads_the_device_once():
    """Fault 9: one read per parameter tensor at each checkpoint (fp32's finiteness check)."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))  # 4 tensors
    with HostReads() as seen:
        checks.require_finite_parameters(model, step=3)
    assert len(seen.reads) == 1, seen.reads  # the verdict, read once (not once per tensor)
    model[0].bias.data[1] = float("nan")
    with pytest.raises(FloatingPointError, match="after optimizer step 3"):
        checks.require_finite_parameters(model, step=3)


def test_an_averaging_round_reads_the_device_once(single_process_group):
    """Fault 9: local SGD / DiLoCo read the drift twice per round (`den > 0`, then float)."""
    from gradsync.sync.averaging import Anchor, plain_average

    model = torch.nn.Linear(3, 2)
    anchor = Anchor.of(model)
    with torch.no_grad():
        model.weight.add_(0.5)
    with HostReads() as seen:
        drift = anchor.sync(model, plain_average, None, CommCounts())
    assert seen.reads == ["__float__"] and drift == 0.0  # one rank: it is the mean


def test_a_direct_averaging_round_reads_the_device_once(single_process_group):
    """local SGD's fp32 round (averaging.average_replicas) reads the drift once, too."""
    from gradsync.sync.averaging import average_replicas

    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with HostReads() as seen:
        drift = average_replicas(model, CommCounts())
    assert seen.reads == ["__float__"] and drift == 0.0  # one rank: it is the mean
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_the_sync_trace_of_a_model_on_cuda_reports_no_wait_and_no_overlap():
    """Issue 32 fault 5: on CUDA the host clocks time nothing (a nccl future completes at
    enqueue, a gradient is "ready" when its kernel is queued): the trace reported a wait of ~0
    and an overlap of ~1 as measured. The same records as test_wait_and_overlap_from_the_times
    (a wait of 30 ns, an overlap of 10 / 40 on the CPU) give None on a model on (fake) cuda:0,
    "n/a" in the table, and the buckets, bytes and wires still."""
    from gradsync.engines.trace import BucketRecord, MicroBatch, SyncTrace, table

    def traced(model: torch.nn.Module) -> SyncTrace:
        trace = SyncTrace(0)
        trace.watch(model)
        m = MicroBatch(start=0, sync=True, end=200, compute_end=100)
        m.buckets = [BucketRecord(0, ["a"], 4, "float32", ready=80, launched=90, finished=100),
                     BucketRecord(1, ["b"], 4, "float32", ready=100, launched=100, finished=130)]
        trace.micro = [m]
        trace.step_end()
        return trace

    cpu = traced(torch.nn.Linear(3, 2))
    assert cpu.last == {"wait_ms": 30 / 1e6, "overlap": 10 / 40}
    model = torch.nn.Linear(3, 2, device="meta")
    with FakeTensorMode(allow_non_fake_inputs=True):
        gpu = traced(on_fake_cuda(model))
    assert gpu.last == {"wait_ms": None, "overlap": None}
    assert gpu.summary() == {"wait_ms_per_step": None, "overlap": None}
    names = [e["name"] for e in gpu.pending]
    assert "wait for all-reduce" not in names and "wait for all-reduce" in \
        [e["name"] for e in cpu.pending]
    sent = [e for e in gpu.pending if e["name"].startswith("all-reduce bucket")]
    assert [(e["args"]["bytes"], e["args"]["wire"], e["args"]["waited_ms"],
             e["args"]["allreduce_ms"]) for e in sent] == [(4, "float32", None, None)] * 2
    shown = table({"traceEvents": gpu.pending})
    assert "rank 0: 1 steps, wait n/a, overlap n/a" in shown
    assert "| 0 | 0 | 1 | 0 | a | 4 | float32 | n/a | n/a |" in shown


def test_no_sync_scalars_reach_tensorboard_when_the_trace_has_no_times():
    """A step row holding the trace's None (a model on CUDA) sends no sync/ scalar; a timed
    row sends both."""
    class Stop(Exception):
        pass

    class Log:
        def __init__(self) -> None:
            self.sent: list[tuple[int, dict]] = []

        def scalars(self, step, values):
            self.sent.append((step, values))

        def steps(self, rows):
            raise Stop  # what follows (the log point's own scalars) is not this test's

    steps = steplog.StepLog.__new__(steplog.StepLog)
    steps.p, steps.log = SimpleNamespace(noise=None, world_size=1), Log()
    steps.mark_t, steps.mark_samples = 0.0, 0
    steps.rows = [{"window": 1, "sync_wait_ms": None, "sync_overlap": None},
                  {"window": 2, "sync_wait_ms": 0.5, "sync_overlap": 0.25}]
    steps.losses = [torch.tensor(1.0), torch.tensor(2.0)]
    with pytest.raises(Stop):
        steps.flush(SimpleNamespace(train_s=1.0, samples_seen=8, last_loss=0.0), None)
    assert steps.log.sent == [(2, {"sync/wait_ms": 0.5, "sync/overlap": 0.25})]
