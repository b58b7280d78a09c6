"""engine.trace_sync: every synchronisation of a run, per rank, as a Chrome/Perfetto trace.

Per optimizer step a rank records its micro-batches (forward+backward, synchronising or not)
and, for every gradient bucket of a synchronising backward: the parameters it holds, the bytes
and dtype it put on the wire, when its last gradient became ready, when its all-reduce was
launched and when it finished, how long the step waited for it, and whether the policy kept it
local (gradsync engine only). Both engines feed the same recorder: the counting comm hook
(sync/comm.py) reports each bucket it all-reduces, post-accumulate-grad hooks on the parameters
say when each gradient became ready, the engine's ``micro_batch`` and ``zero_grad`` mark the
micro-batches and the end of the step.

Each rank appends its events to ``trace/rank<r>.jsonl`` (one Chrome trace event per line,
flushed after every step: a crashed run keeps what it recorded); the job process merges them
into ``trace.json`` (``merge``; ``python -m gradsync.engines trace RUN_DIR`` merges by hand,
for a torchrun job whose rank 0 died, and prints a summary table). Open it in
https://ui.perfetto.dev or chrome://tracing: one process per rank, a ``steps`` track of steps,
micro-batches and waits, one track per bucket.

Derived per step (TensorBoard ``sync/wait_ms`` and ``sync/overlap``, summary.json):

- *wait*: time from the end of a synchronising backward's computation (its last gradient
  ready) until its last all-reduce finished; each bucket's share is the part of it that bucket
  adds after the ones that finished before it;
- *overlap*: the fraction of the time some all-reduce was in flight that the backward was still
  computing (1: communication fully hidden; 0: none of it).

Times are host clocks (``time.time_ns``). They measure the collectives only where the work runs
on the host (a model on the CPU): on CUDA a gradient is "ready" when autograd queued its kernel
and a nccl future completes once its collective is enqueued, so the wait would read ~0 and the
overlap ~1 whatever the GPU did. A model on CUDA therefore gets no wait and no overlap: ``None``
in metrics.jsonl, summary.json and the trace's args, "n/a" in the table, nothing in TensorBoard;
its trace keeps the buckets, their bytes, wires and host launch order (docs/engines.md).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

TRACE_DIR = "trace"  # per-rank event files, inside the run dir
TRACE = "trace.json"  # the merged trace
STEPS_TID = 0  # the track of steps, micro-batches and waits
BUCKET_TID = 10  # bucket i's track: BUCKET_TID + i
SHOWN_PARAMS = 8  # parameter names a bucket's event lists in full
USAGE = "usage: python -m gradsync.engines trace RUN_DIR"


@dataclass(eq=False)
class BucketRecord:
    index: int
    params: list[str]
    nbytes: int
    wire: str
    ready: int  # ns: the last of its gradients became ready
    launched: int | None  # None: not all-reduced (kept local, or never launched)
    finished: int | None = None
    groups: dict[str, Any] = field(default_factory=dict)
    note: str = ""  # why it was not all-reduced

    @property
    def skipped(self) -> bool:
        return self.launched is None


@dataclass(eq=False)
class MicroBatch:
    start: int
    sync: bool
    end: int = 0
    compute_end: int = 0  # its backward's last gradient became ready
    buckets: list[BucketRecord] = field(default_factory=list)


class SyncTrace:
    """One rank's recorder (see the module's docstring)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.names: dict[int, str] = {}  # id(param) -> name
        self.ready: dict[int, int] = {}  # id(param) -> ns, in the current micro-batch
        self.micro: list[MicroBatch] = []  # the current step's
        self.windows = 0  # steps recorded
        self.partition: tuple[tuple[str, ...], ...] = ()  # the buckets last seen
        self.file: Any = None
        self.pending: list[dict[str, Any]] = []  # events not yet written
        self.last: dict[str, float | None] = {}  # the last step's wait_ms and overlap
        self.wait_ns = 0  # over the run: waits, busy and hidden communication time
        self.busy_ns = 0
        self.hidden_ns = 0
        self.timed = True  # host clocks time the collectives: the model is not on CUDA (watch)

    now = staticmethod(time.time_ns)

    # --- what the engines call ------------------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """Record when each gradient becomes ready (post-accumulate-grad hooks; registered
        before the engine's own, so they run first). A model on CUDA is not timed (see the
        module's docstring)."""
        self.timed = all(p.device.type != "cuda" for p in model.parameters())
        for name, param in model.named_parameters():
            if param.requires_grad:
                self.names[id(param)] = name
                param.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self.micro and self.micro[-1].sync:
            self.ready[id(param)] = self.micro[-1].compute_end = time.time_ns()

    @contextmanager
    def micro_batch(self, sync: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward."""
        self.ready = {}
        m = MicroBatch(time.time_ns(), sync)
        self.micro.append(m)
        try:
            yield
        finally:
            m.end = time.time_ns()

    def bucket(self, bucket: Any, launched: int, fut: torch.futures.Future, nbytes: int,
               wire: str, groups: dict[str, Any]) -> None:
        """A bucket's all-reduce, launched at `launched` (the counting hook)."""
        rec = self._record(bucket.index(), bucket.parameters(), nbytes, wire, launched)
        rec.groups = {g: b for g, (_, b) in groups.items()}
        fut.add_done_callback(lambda _: setattr(rec, "finished", time.time_ns()))

    def skipped(self, index: int, params: Sequence[torch.Tensor],
                note: str = "kept local") -> None:
        """A bucket a synchronising backward did not all-reduce (gradsync engine): the policy
        kept it local, or it was never launched (`note` says why)."""
        self._record(index, params, 0, "", None).note = note

    def _record(self, index: int, params: Sequence[torch.Tensor], nbytes: int, wire: str,
                launched: int | None) -> BucketRecord:
        m = self.micro[-1] if self.micro else self._orphan()
        # its last gradient's time; a bucket launched before that hook ran (torch's reducer may
        # run first) or holding no gradient of this backward (an unused parameter): its launch
        ready = max((self.ready.get(id(p), 0) for p in params), default=0)
        at = launched or time.time_ns()
        rec = BucketRecord(index, [self.names.get(id(p), "?") for p in params], nbytes, wire,
                           min(ready, at) if ready else at, launched)
        m.buckets.append(rec)
        return rec

    def _orphan(self) -> MicroBatch:
        """A backward outside micro_batch() (not the loop's): recorded as a synchronising one."""
        m = MicroBatch(time.time_ns(), True)
        self.micro.append(m)
        return m

    def step_end(self, finished: bool = True) -> None:
        """The optimizer step of the window is done (the engine's zero_grad): its events are
        written, its wait and overlap kept in ``last``. finished=False: the run stopped inside
        the window (close)."""
        if not self.micro:
            return
        now = time.time_ns()
        self.windows += finished
        events: list[dict[str, Any]] = []
        wait = busy = hidden = 0
        for i, m in enumerate(self.micro):
            m.end = m.end or now
            events.append(_slice(f"micro-batch {i} ({'sync' if m.sync else 'no_sync'})",
                                 self.rank, STEPS_TID, m.start, m.end, {"micro_index": i}))
            w, b, h = self._buckets(m, events)
            wait, busy, hidden = wait + w, busy + b, hidden + h
        stats: dict[str, float | None] = {"wait_ms": None, "overlap": None}  # not timed
        if self.timed:
            stats = {"wait_ms": wait / 1e6}
            if busy:
                stats["overlap"] = hidden / busy
        if finished:
            self.last = stats
            self.wait_ns, self.busy_ns, self.hidden_ns = (
                self.wait_ns + wait, self.busy_ns + busy, self.hidden_ns + hidden)
        window = self.windows + (not finished)
        args = {"window": window, **stats,
                "synchronising_backwards": sum(m.sync for m in self.micro)}
        title = f"step {window}" + ("" if finished else " (unfinished)")
        events.insert(0, _slice(title, self.rank, STEPS_TID, self.micro[0].start, now, args))
        self.micro = []
        self._write(events)

    def _buckets(self, m: MicroBatch, events: list[dict[str, Any]]) -> tuple[int, int, int]:
        """The events of one micro-batch's buckets; returns its (wait, busy, hidden) ns."""
        sent = [b for b in m.buckets if not b.skipped]
        for b in sent:
            b.finished = b.finished or m.end  # a future that never reported: its wait's end
        partition = tuple(tuple(b.params) for b in m.buckets)
        if partition and partition != self.partition:
            self.partition = partition
            events.append({"name": "buckets", "ph": "i", "s": "p", "pid": self.rank,
                           "tid": STEPS_TID, "ts": m.start,
                           "args": {f"bucket {b.index}": b.params for b in m.buckets}})
        end = m.compute_end or max((b.ready for b in m.buckets), default=m.start)
        waited, done = {}, end
        for b in sorted(sent, key=lambda b: b.finished or 0):
            assert b.finished is not None
            waited[id(b)] = max(0, b.finished - done)
            done = max(done, b.finished)
        wait = done - end
        if wait > 0 and self.timed:
            events.append(_slice("wait for all-reduce", self.rank, STEPS_TID, end, done, {}))
        for b in m.buckets:
            args: dict[str, Any] = {
                "params": b.params if len(b.params) <= SHOWN_PARAMS else
                b.params[:3] + [f"... {len(b.params)} in all"] + b.params[-1:],
                "bytes": b.nbytes, "wire": b.wire, "skipped": b.skipped}
            tid = BUCKET_TID + b.index
            if b.skipped:
                events.append({"name": f"bucket {b.index} {b.note}", "ph": "i", "s": "t",
                               "pid": self.rank, "tid": tid, "ts": b.ready, "args": args})
                continue
            assert b.launched is not None and b.finished is not None
            args |= ({"ready_to_launch_ms": (b.launched - b.ready) / 1e6,
                      "allreduce_ms": (b.finished - b.launched) / 1e6,
                      "waited_ms": waited[id(b)] / 1e6} if self.timed else
                     {"ready_to_launch_ms": None, "allreduce_ms": None, "waited_ms": None})
            if b.groups:
                args["group_bytes"] = b.groups
            events.append(_slice(f"all-reduce bucket {b.index}", self.rank, tid, b.launched,
                                 b.finished, args))
        busy, hidden = _union([(b.launched or 0, b.finished or 0) for b in sent], end)
        return wait, busy, hidden

    def mark(self, name: str, args: dict[str, Any]) -> None:
        """An instant on the steps track (a policy's averaging of the models, say)."""
        self._write([{"name": name, "ph": "i", "s": "p", "pid": self.rank, "tid": STEPS_TID,
                      "ts": time.time_ns(), "args": args}])

    # --- the file -------------------------------------------------------------------------------
    def open(self, path: Path) -> None:
        """Append this rank's events to `path` from now on (a resumed run continues it)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a")
        self._write([])

    def _write(self, events: list[dict[str, Any]]) -> None:
        self.pending += events
        if self.file is None:
            return
        self.file.write("".join(json.dumps(e) + "\n" for e in self.pending))
        self.file.flush()
        self.pending = []

    def close(self) -> None:
        """The end of the run: a window it stopped in (an error, a signal) is written too."""
        self.step_end(finished=False)
        if self.file is not None:
            self.file.close()
            self.file = None

    def summary(self) -> dict[str, float | None]:
        """Over the run: mean wait per step (ms) and the overlap fraction (None on CUDA)."""
        if not self.timed:
            return {"wait_ms_per_step": None, "overlap": None}
        return {"wait_ms_per_step": self.wait_ns / 1e6 / self.windows if self.windows else 0.0,
                "overlap": self.hidden_ns / self.busy_ns if self.busy_ns else None}


def _slice(name: str, pid: int, tid: int, start: int, end: int,
           args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start,
            "dur": max(0, end - start), "args": args}


def _union(intervals: list[tuple[int, int]], cut: int) -> tuple[int, int]:
    """(length of the union of the intervals, the part of it before `cut`)."""
    total = before = 0
    reach = None
    for a, b in sorted(intervals):
        if reach is not None and a < reach:
            a = reach
        if b <= a:
            continue
        total += b - a
        before += max(0, min(b, cut) - a)
        reach = b
    return total, before


# --- the merged trace -----------------------------------------------------------------------------
def merge(run_dir: Path) -> Path | None:
    """trace/rank*.jsonl -> trace.json (Chrome's JSON trace format, times in microseconds from
    the first event); a torn last line is left out. None when there is nothing to merge."""
    from gradsync.core.files import write_json_atomic

    files = sorted((run_dir / TRACE_DIR).glob("rank*.jsonl"))
    events: list[dict[str, Any]] = []
    for f in files:
        for line in f.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    if not events:
        return None
    origin = min(e["ts"] for e in events)
    tracks: dict[int, set[int]] = {}
    for e in events:
        e["ts"] = (e["ts"] - origin) / 1e3
        if "dur" in e:
            e["dur"] = e["dur"] / 1e3
        tracks.setdefault(e["pid"], set()).add(e["tid"])
    meta: list[dict[str, Any]] = []
    for pid, tids in sorted(tracks.items()):
        meta.append({"name": "process_name", "ph": "M", "pid": pid,
                     "args": {"name": f"rank {pid}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid,
                     "args": {"sort_index": pid}})
        for tid in sorted(tids):
            label = "steps" if tid == STEPS_TID else f"bucket {tid - BUCKET_TID}"
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"name": label}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                         "args": {"sort_index": tid}})
    out = run_dir / TRACE
    write_json_atomic(out, {"traceEvents": meta + events, "displayTimeUnit": "ms"})
    return out


def table(trace: dict[str, Any]) -> str:
    """A merged trace in a few lines: per rank its steps, mean wait per step and overlap; per
    rank and bucket its all-reduces, parameters, bytes, wire, median duration and mean wait."""
    import statistics

    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    lines = ["| rank | bucket | all-reduces | kept local | params | bytes each | wire | "
             "all-reduce ms (median) | waited ms (mean) |", "|---|---|---|---|---|---|---|---|---|"]
    totals = []
    for rank in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == rank]
        steps = [e for e in mine if e["name"].startswith("step ")
                 and not e["name"].endswith("(unfinished)")]
        waits = [e["args"]["wait_ms"] for e in steps]
        overlaps = [e["args"]["overlap"] for e in steps if "overlap" in e["args"]]
        if None in waits:  # a model on CUDA: not timed
            totals.append(f"rank {rank}: {len(steps)} steps, wait n/a, overlap n/a (CUDA: host "
                          "clocks do not time the collectives)")
        else:
            totals.append(f"rank {rank}: {len(steps)} steps, wait "
                          f"{statistics.fmean(waits or [0]):.2f} ms per step, overlap "
                          f"{statistics.fmean(overlaps or [0]):.2f}")
        for tid in sorted({e["tid"] for e in mine if e["tid"] >= BUCKET_TID}):
            sent = [e for e in mine if e["tid"] == tid and e["ph"] == "X"]
            kept = sum(e["name"].endswith("kept local") for e in mine if e["tid"] == tid)
            last = sent[-1]["args"] if sent else {}
            timed = all(e["args"]["waited_ms"] is not None for e in sent)
            lines.append(
                f"| {rank} | {tid - BUCKET_TID} | {len(sent)} | {kept} | "
                f"{', '.join(last.get('params', []))} | {last.get('bytes', 0)} | "
                f"{last.get('wire', '')} | "
                + (f"{statistics.median([e['dur'] / 1e3 for e in sent] or [0]):.2f} | "
                   f"{statistics.fmean([e['args']['waited_ms'] for e in sent] or [0]):.2f} |"
                   if timed else "n/a | n/a |"))
    return "\n".join(totals + [""] + lines)


def main(argv: list[str]) -> int:
    """python -m gradsync.engines trace RUN_DIR: merge the ranks' files, print the table."""
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    out = merge(Path(argv[0]))
    if out is None:
        print(f"no {TRACE_DIR}/rank*.jsonl in {argv[0]}", file=sys.stderr)
        return 1
    print(f"{out}\n\n{table(json.loads(out.read_text()))}")
    return 0
