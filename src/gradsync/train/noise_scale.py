"""The gradient noise scale, measured from the windows the loop already runs.

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training", App. A.1): the mean
gradient of a batch of b samples drawn from the data has E|G_b|^2 = |G|^2 + tr(Sigma)/b, with G
the true gradient and Sigma the per-sample gradient covariance. Two batch sizes b < B give
unbiased estimates of both terms::

    |G|^2     ~ (B |G_B|^2 - b |G_b|^2) / (B - b)
    tr(Sigma) ~ (|G_b|^2 - |G_B|^2) / (1/b - 1/B)

and the simple noise scale B_simple = tr(Sigma) / |G|^2 is the ratio of exponential moving
averages of the two (the ratio of averages, never the average of ratios: each window's |G|^2
estimate is noisy and may be negative).

Data-parallel training holds both batches at every synchronising window: each rank's own window
gradient just before the all-reduce (the small batch, its real samples) and the all-reduced
gradient just after (the big batch, the window's real samples over all ranks). The counting comm
hook (sync/comm.py) runs this module's GradientProbe: the norm of every gradient in a bucket
before the policy's all-reduce (before compression, error feedback, a low-precision cast) and
after it: no extra forward or backward, no copy of the gradients. |G_small|^2 is the mean over
ranks of the local squared norms; with ranks of unequal real sample counts b_r (an epoch's
uneven last window) E[mean_r |g_r|^2] = |G|^2 + tr(Sigma) mean_r(1/b_r), so b is the harmonic
mean of the b_r. The per-rank numbers travel in one small all-reduce that rides on the loss
all-reduce of the next log point (StepLog.flush), or is made on its own where a decision needs
the newest estimate (AdaScale: every window; the adaptive schedule: every `every` steps).

Normalisation: the buckets hold the gradient of each rank's loss as the loop divides it (by
global_real / W for samples, by a constant for tokens: train/normalize.py ``divisor``), times
the fp16 loss scale; both norms are rescaled to the mean over their own real samples (tokens on
token data: tokens are then the batch unit), so the estimates are for the loss as the data
defines it per unit. A policy that synchronises more than once per window (``always`` with
N > 1) is measured at the window's first synchronising backward: its micro-batches so far, on
this rank and over all ranks.

One rank: there is no all-reduce to measure around, so the small batch is the window's first
micro-batch (its gradient read in place before the second micro-batch's backward) and the big
batch the whole window: two extra reads of the gradients per window, no copy, and windows of
at least 2 micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm

from gradsync.components import ConfigError
from gradsync.sync.averaging import whole_model
from gradsync.sync.comm import to_device

if TYPE_CHECKING:
    from gradsync.config.schema import RunConfig
    from gradsync.sync.policy import SyncPolicy
    from gradsync.train.precision import Precision
    from gradsync.train.windows import Window

ROW = 4  # per window and rank: |g_r|^2, 1/b_r, the big batch's units on this rank, measured


class Divides(Protocol):
    """A loss normaliser as the meter needs it (train/normalize.py BySamples, ByTokens)."""

    name: str

    def divisor(self, window: Window) -> float:
        """What each micro-batch's summed loss of `window` was divided by."""
        ...


def measures(cfg: RunConfig) -> bool:
    """Whether a run measures the noise scale: asked for, or needed by the schedule or the LR."""
    return (cfg.noise_scale.enabled or cfg.schedule.name == "adaptive"
            or cfg.lr_scaling.name == "adascale")


def check(cfg: RunConfig, world_size: int, policy: SyncPolicy, probed: bool) -> None:
    """What the measurement needs from the rest of the config (before any worker starts).
    policy: the run's sync policy, as the config check built it (run/preflight.py
    check_policy); probed: whether the engine all-reduces through the counting hook (sync/comm.py),
    where the measurement is taken (its capabilities' gradient_probe)."""
    if not measures(cfg):
        return
    why = ("noise_scale.enabled=true" if cfg.noise_scale.enabled else
           "schedule=adaptive" if cfg.schedule.name == "adaptive" else "lr_scaling=adascale")
    if cfg.loss.normalize == "micro_batch_mean":
        raise ConfigError(f"{why} measures the gradient of the mean loss over a window's "
                          "samples; loss.normalize=micro_batch_mean weighs them unequally: use "
                          "auto, samples or tokens")
    if not probed:
        raise ConfigError(f"{why} is measured inside the all-reduce of an engine with a "
                          "gradient probe (torch_ddp, gradsync), not engine="
                          f"{cfg.engine.name}")
    if whole_model(policy.averager):
        raise ConfigError(f"{why} is measured around the all-reduce of the gradients; "
                          f"sync ({cfg.sync.target}) averages parameters instead: use a policy "
                          "that all-reduces gradients (accumulate, always, amp_aware)")
    s = cfg.schedule
    if world_size == 1 and s.name != "adaptive" and max(_window_sizes(cfg)) < 2:
        raise ConfigError(f"{why} on 1 rank compares a window's first micro-batch with the "
                          "whole window: every window here has 1 micro-batch; use "
                          "schedule.window_size >= 2 (or more ranks)")


def _window_sizes(cfg: RunConfig) -> list[int]:
    s: Any = cfg.schedule
    if s.name == "constant":
        return [s.window_size]
    if s.name == "epochwise":
        return [int(n) for n in s.window_size_by_epoch.values()]
    return [s.global_batch_size // cfg.micro_batch_size]  # global_batch on 1 rank


def _grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    return get_total_norm([q.grad for q in params if q.grad is not None])


@dataclass
class WindowRecord:
    """One rank's raw numbers of one window, kept (no arithmetic, no host sync) until the next
    flush turns every pending window into its row at once."""

    window: int  # the window's number (metrics row)
    small: list[torch.Tensor]  # norms (per parameter) of this rank's small-batch gradient
    big: list[torch.Tensor]  # norms of the big batch's (all-reduced) gradient
    small_units: torch.Tensor | int  # this rank's units in the small batch
    big_units: torch.Tensor | int  # this rank's units in the big batch
    measured: bool
    divisor: float  # what the window's micro-batch losses were divided by
    scale: torch.Tensor | None  # the fp16 loss scale of its backwards


def _sum_squares(norms: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """[window] the sum of the squared norms of each window's parameters (or whole gradient),
    in float64, in the order given."""
    flat = [n for window in norms for n in window]
    out = torch.zeros(len(norms), dtype=torch.float64, device=device)
    if flat:
        index = to_device(torch.tensor([i for i, window in enumerate(norms) for _ in window]),
                          device)
        out.index_add_(0, index, torch.stack(flat).double().square())
    return out


def _columns(rows: list[list[Any]], device: torch.device) -> torch.Tensor:
    """[row, column] float64 on `device` of numbers and 0-dim tensors: the numbers in one copy
    from the host (no host sync: to_device), the tensors (on the device) written in place."""
    host = torch.tensor([[0.0 if isinstance(v, torch.Tensor) else float(v) for v in row]
                         for row in rows], dtype=torch.float64)
    out = to_device(host, device)
    for i, row in enumerate(rows):
        for j, v in enumerate(row):
            if isinstance(v, torch.Tensor):
                out[i, j] = v
    return out


def undefined(e: dict[str, float]) -> str | None:
    """Why the estimates `e` (NoiseScale.estimates) give no B_simple to report, in one line;
    None when B_simple is a positive number. The moving average of |G|^2 estimates goes
    negative once the true gradient is small against its noise (late in training, near a
    minimum): B_simple is then beyond every batch the windows compare, a ratio with no value
    (the adaptive schedule and AdaScale act on it as infinite: the largest window, the full
    gain)."""
    if not e:
        return "no window was measured (no window with a synchronising backward and b < B)"
    norm_sq, trace, b_simple = e["grad_norm_sq"], e["grad_trace_cov"], e["noise_scale"]
    if not (math.isfinite(norm_sq) and math.isfinite(trace)):
        return f"the averages are not finite (|G|^2 {norm_sq:.3g}, tr(Sigma) {trace:.3g})"
    if norm_sq <= 0:
        return (f"the average |G|^2 estimate is {norm_sq:.3g} (not positive): the gradient is "
                "below the noise the windows resolve, B_simple is beyond every batch measured")
    if not b_simple > 0:
        return (f"the average tr(Sigma) estimate is {trace:.3g} (not positive): the windows' "
                "gradients vary less than their batch sizes predict, B_simple has no value")
    return None


class GradientProbe:
    """The norm of every parameter's gradient in one synchronising backward's buckets, before
    the policy's all-reduce (this rank's own gradient, before compression, error feedback or a
    low-precision cast) and after it (the reduced bucket the step applies). Armed by the loop
    for the first synchronising backward of a window (train/noise_scale.py); disarmed by that
    backward's last bucket. Norms of the gradients where they lie (no copy, no host sync),
    kept per parameter in the model's order, so their sum does not depend on how DDP laid the
    buckets out (it rebuilds them after the first iteration; a resumed run starts unbuilt)."""

    def __init__(self, parameters: Iterable[torch.Tensor]) -> None:
        self.order = {id(q): i for i, q in enumerate(parameters)}
        self.armed = False
        self.fired = False  # a synchronising backward was measured since arm()
        self.local: dict[int, torch.Tensor] = {}  # parameter index -> norm before the all-reduce
        self.reduced: dict[int, torch.Tensor] = {}  # and after it

    def arm(self) -> None:
        self.armed, self.fired = True, False
        self.local, self.reduced = {}, {}

    def before(self, bucket: dist.GradBucket) -> Callable[[torch.futures.Future[torch.Tensor]],
                                                          torch.Tensor]:
        """Measure the bucket now; returns the callback that measures what the all-reduce
        returns (the reduced bucket, laid out alike)."""
        self.fired = True
        buf = bucket.buffer()
        spans = [(self.order[id(q)], int(g.storage_offset() - buf.storage_offset()), g.numel())
                 for q, g in zip(bucket.parameters(), bucket.gradients(), strict=True)]
        self._norms(self.local, buf, spans)

        def after(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            reduced = fut.value()
            self._norms(self.reduced, reduced, spans)
            return reduced

        return after

    @staticmethod
    def _norms(into: dict[int, torch.Tensor], buf: torch.Tensor,
               spans: list[tuple[int, int, int]]) -> None:
        norms = torch._foreach_norm([buf[start:start + n] for _, start, n in spans])
        into.update(zip((i for i, _, _ in spans), norms, strict=True))

    @staticmethod
    def in_order(norms: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [norms[i] for i in sorted(norms)]


class NoiseScale:
    """The meter: built by the worker when the run measures (``measures``); its probe goes into
    the engine's counting hook. The loop calls ``start_window`` and ``before_backward``
    (run_window) and ``end_window`` (before the optimizer step); ``flush`` all-reduces the
    windows' rows (collective: every rank calls it at the same windows). Its moving averages
    are the same on every rank and saved in checkpoints."""

    def __init__(self, world_size: int, device: torch.device, unit: str, decay: float,
                 parameters: Iterable[torch.nn.Parameter]):
        """parameters: the model's, in its order (the order the squared norms are summed in)."""
        self.world_size, self.device, self.decay = world_size, device, decay
        self.tokens = unit == "tokens"
        self.probe = GradientProbe(parameters) if world_size > 1 else None
        # the moving averages (not bias-corrected) and how many windows they hold
        self.windows = 0
        self.ema_norm_sq = 0.0
        self.ema_trace = 0.0
        self.last_batch = math.nan  # units (samples or tokens) of the newest window flushed
        self.pending: list[WindowRecord] = []
        self.results: dict[int, dict[str, float | None]] = {}  # window -> its fields, until logged
        self._units: torch.Tensor | int = 0
        self._small: tuple[torch.Tensor, torch.Tensor | int] | None = None  # 1 rank

    # --- inside a window (the loop) --------------------------------------------------------
    def start_window(self) -> None:
        self._units, self._small = 0, None
        if self.probe is not None:
            self.probe.arm()

    def before_backward(self, index: int, real: int, counts: torch.Tensor,
                        params: Iterable[torch.nn.Parameter]) -> None:
        """Before micro-batch `index`'s backward; `real` of its samples count, `counts` their
        loss units. The micro-batches up to the window's first synchronising backward make the
        small batch (the probe has fired once that backward ran)."""
        units = counts.sum() if self.tokens else real
        if self.probe is not None:
            if not self.probe.fired:
                self._units = self._units + units
            return
        if index == 1:  # one rank: the gradients hold micro-batch 0's alone
            self._small = (_grad_norm(params), self._units)
        self._units = self._units + units

    def end_window(self, window_no: int, window: Window, normalizer: Divides,
                   precision: Precision, params: Iterable[torch.nn.Parameter]) -> None:
        """After the window's last backward, before unscaling: this rank's record of the window
        (kept until the next flush). Every rank adds one per window, measured or not."""
        divisor, scale = normalizer.divisor(window), precision.scale_tensor()
        if self.probe is not None:  # the big batch: every rank's small one
            probe = self.probe
            self.pending.append(WindowRecord(window_no, probe.in_order(probe.local),
                                             probe.in_order(probe.reduced), self._units,
                                             self._units, probe.fired, divisor, scale))
            return
        small, units = self._small if self._small is not None else (None, 0)
        self.pending.append(WindowRecord(window_no, [] if small is None else [small],
                                         [_grad_norm(params)], units, self._units,
                                         small is not None, divisor, scale))

    # --- the all-reduce ----------------------------------------------------------------------
    def _rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pending windows' rows ([window, ROW]: |g_r|^2, 1/b_r, the big batch's units on
        this rank, measured) and big-batch terms ([window]: |G_B|^2 B^2, the same on every
        rank). The buckets hold s * (this rank's sum of per-unit gradients) / divisor: rescaled
        to the mean over its b units; the reduced ones hold the mean over ranks of those, s *
        (the sum over every rank) / (W divisor), rescaled here to the sum, and after the flush
        by 1 / B^2."""
        recs, dev = self.pending, self.device
        small_sq = _sum_squares([r.small for r in recs], dev)
        big_sq = _sum_squares([r.big for r in recs], dev)
        b, big_units, divisor, scale, measured = _columns(
            [[r.small_units, r.big_units, r.divisor, 1.0 if r.scale is None else r.scale,
              r.measured] for r in recs], dev).unbind(1)
        small = small_sq * (divisor / (scale * b)).square()
        ok = (b > 0) & torch.isfinite(small) & measured.bool()
        rows = torch.stack([torch.where(ok, small, 0.0), torch.where(ok, 1 / b, 0.0),
                            big_units, ok.double()], dim=1)
        return rows, big_sq * (self.world_size * divisor / scale).square()

    def flush(self, carry: torch.Tensor | None = None) -> torch.Tensor | None:
        """Collective: sum the pending windows' rows over ranks, in one all-reduce with `carry`
        (a float64 vector on the device, e.g. the log point's losses; returned summed), and
        fold each window into the moving averages, in window order."""
        if not self.pending and carry is None:
            return None
        if self.pending:
            rows, bigs = self._rows()
        else:
            rows = torch.zeros(0, ROW, dtype=torch.float64, device=self.device)
            bigs = torch.zeros(0, dtype=torch.float64, device=self.device)
        n = 0 if carry is None else carry.numel()
        flat = rows.flatten() if carry is None else torch.cat([carry.flatten(), rows.flatten()])
        if self.world_size > 1:
            dist.all_reduce(flat)
        read = torch.cat([flat[n:], bigs]).tolist()  # the flush's one host read
        k = len(self.pending)
        sums, big_terms = read[:k * ROW], read[k * ROW:]
        for i, (rec, big) in enumerate(zip(self.pending, big_terms, strict=True)):
            self.results[rec.window] = self._fold(sums[i * ROW:(i + 1) * ROW], big)
        self.pending = []
        return None if carry is None else flat[:n].view_as(carry)

    def _fold(self, row: list[float], big: float) -> dict[str, float | None]:
        small_sum, inv_b_sum, big_batch, measured = row
        w = self.world_size
        self.last_batch = big_batch
        out: dict[str, float] = {}
        if measured == w and big_batch > 0 and math.isfinite(big):
            small, b = small_sum / w, w / inv_b_sum
            big_sq = big / big_batch**2
            if big_batch > b:
                norm_sq = (big_batch * big_sq - b * small) / (big_batch - b)
                trace = (small - big_sq) / (1 / b - 1 / big_batch)
                self.windows += 1
                d = self.decay
                self.ema_norm_sq = d * self.ema_norm_sq + (1 - d) * norm_sq
                self.ema_trace = d * self.ema_trace + (1 - d) * trace
                out = {"grad_sq_small": small, "grad_sq_big": big_sq, "batch_small": b,
                       "batch_big": big_batch, "grad_norm_sq_window": norm_sq,
                       "grad_trace_cov_window": trace}
        return out | self.reported()

    # --- what it measured ------------------------------------------------------------------
    def estimates(self) -> dict[str, float]:
        """The bias-corrected moving averages of |G|^2 and tr(Sigma), and B_simple (their
        ratio; inf when the |G|^2 average is not positive but the noise is); {} before the
        first measured window. Of what has been flushed."""
        if not self.windows:
            return {}
        correction = 1 - self.decay**self.windows
        norm_sq, trace = self.ema_norm_sq / correction, self.ema_trace / correction
        if norm_sq > 0:
            b_simple = trace / norm_sq
        else:
            b_simple = math.inf if trace > 0 else math.nan
        return {"grad_norm_sq": norm_sq, "grad_trace_cov": trace, "noise_scale": b_simple}

    def reported(self) -> dict[str, float | None]:
        """The estimates as rows and summary.json report them: B_simple None where it has no
        positive value (``undefined``)."""
        e: dict[str, float | None] = dict(self.estimates())
        if e and undefined(e) is not None:  # type: ignore[arg-type]
            e["noise_scale"] = None
        return e

    def current(self) -> dict[str, float]:
        """Collective: the estimates with every window so far folded in (flushes)."""
        self.flush()
        return self.estimates()

    def take(self, window: int) -> dict[str, float | None]:
        """A window's fields for its metrics row (once)."""
        return self.results.pop(window, {})

    def summary(self) -> dict[str, Any]:
        """summary.json: the final B_simple and averaged estimates. B_simple is None where it is
        no positive number (nothing measured, or an average that is not positive: ``undefined``
        says why, in ``noise_scale_note``); the averages stay as measured."""
        e = self.estimates()
        why = undefined(e)
        return {"noise_scale": self.reported().get("noise_scale"),
                "grad_norm_sq": e.get("grad_norm_sq"), "grad_trace_cov": e.get("grad_trace_cov"),
                "noise_scale_windows": self.windows,
                "noise_scale_unit": "tokens" if self.tokens else "samples"} | (
            {"noise_scale_note": why} if why else {})

    def state_dict(self) -> dict[str, Any]:
        assert not self.pending, "the loop flushes before a checkpoint"
        return {"windows": self.windows, "ema_norm_sq": self.ema_norm_sq,
                "ema_trace": self.ema_trace, "last_batch": self.last_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.windows = state["windows"]
        self.ema_norm_sq, self.ema_trace = state["ema_norm_sq"], state["ema_trace"]
        self.last_batch = state["last_batch"]
