"""The gradient noise scale against the truth: per-sample gradients of a fixed model over the
whole data set, computed here in float64 with plain autograd (no DDP, no gradsync loop), and
the windows a run saw, rebuilt from torch's DistributedSampler. Plus functions the pool's
ranks run (tests/test_noise_scale.py)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from dist_cases import lm_window_batches, policy, tiny_lm, tiny_model, window_data
from gradsync.data.contract import mse_per_sample
from gradsync.data.synthetic import synthetic
from gradsync.data.tokens import IGNORE_INDEX, pad_batch, token_loss_per_sample
from gradsync.engines.torch_ddp import TorchDDP
from gradsync.models import MLP
from gradsync.sync.comm import PLAIN, install_counting_hook
from gradsync.train.loop import run_window
from gradsync.train.noise_scale import NoiseScale
from gradsync.train.normalize import build_normalizer
from gradsync.train.precision import Precision, overflow_handling
from gradsync.train.windows import Window


def per_sample_grads(params: dict[str, torch.Tensor], data: dict) -> torch.Tensor:
    """[n, P] float64: the gradient of every training sample's own loss (mse over its outputs)
    at the fixed parameters, one autograd backward per sample."""
    bundle = synthetic(seed=data["seed"], num_samples=data["num_samples"],
                       eval_samples=data["eval_samples"], in_dim=data["in_dim"],
                       out_dim=data["out_dim"], noise=data["noise"])
    model = MLP(data["in_dim"], data["out_dim"], data["hidden_sizes"], data["activation"])
    model.load_state_dict(params)
    model.double()
    x, y = bundle.train.tensors
    rows = []
    for i in range(len(x)):
        model.zero_grad()
        loss = ((model(x[i:i + 1].double()) - y[i:i + 1].double()) ** 2).mean()
        loss.backward()
        rows.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
    return torch.stack(rows)


def truth(g: torch.Tensor) -> dict[str, float]:
    """The exact |G|^2 and tr(Sigma) of the data set, and what the two-batch estimator's
    expectations are when batches are drawn without replacement from these n samples (the
    finite-population correction): E[|G_b|^2] = |G|^2 + tr(Sigma)/b (n - b)/(n - 1), so the
    estimator's |G|^2 is |G|^2 - S/n and its tr(Sigma) is S = n/(n-1) tr(Sigma)."""
    n = len(g)
    mean = g.mean(0)
    norm_sq = float(mean @ mean)
    trace = float(((g - mean) ** 2).sum(1).mean())  # population: 1/n
    s = n / (n - 1) * trace
    return {"norm_sq": norm_sq, "trace": trace, "expected_norm_sq": norm_sq - s / n,
            "expected_trace": s, "expected_b_simple": s / (norm_sq - s / n)}


def windows_seen(n: int, world: int, seed: int, epochs: int, micro: int,
                 accum: int) -> list[list[list[int]]]:
    """[window][rank] -> the real sample indices of every window of `epochs` epochs, from
    torch's own DistributedSampler (shuffled with seed + epoch, padded by repeating its head:
    a rank's position j holds a real sample iff r + j W < n)."""
    out = []
    for epoch in range(epochs):
        shares = []
        for r in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True,
                                         seed=seed, drop_last=False)
            sampler.set_epoch(epoch)
            shares.append(list(sampler))
        per_window = micro * accum
        for start in range(0, len(shares[0]), per_window):
            out.append([[idx for j, idx in enumerate(shares[r][start:start + per_window],
                                                       start) if r + j * world < n]
                        for r in range(world)])
    return out


def window_norms(g: torch.Tensor, ranks: list[list[int]]) -> dict[str, float]:
    """|G_small|^2 (the mean over ranks of each rank's mean gradient's squared norm), |G_big|^2
    (the mean over all of the window's samples), the small batch (harmonic mean of the ranks'
    counts) and the big one."""
    small = sum(float(g[idx].mean(0) @ g[idx].mean(0)) for idx in ranks) / len(ranks)
    every = [i for idx in ranks for i in idx]
    big = g[every].mean(0)
    b = len(ranks) / sum(1 / len(idx) for idx in ranks)
    return {"grad_sq_small": small, "grad_sq_big": float(big @ big), "batch_small": b,
            "batch_big": float(len(every))}


# --- one window through the loop's run_window, on the pool's ranks ---------------------------
def _window_stats(meter: NoiseScale) -> dict[str, float]:
    meter.flush()
    return meter.take(1)


def one_window_samples(policy_name: str, micro_sizes: list[list[int]], wire: dict,
                       precision: str = "fp32", init_scale: float = 1.0) -> dict:
    """One window of the tiny MLP, rank r's micro-batches of micro_sizes[r] real samples (the
    rest of a micro-batch the sampler's repeats, as in an epoch's uneven last window): the
    meter's numbers and this rank's inputs, for a reference computed elsewhere."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(tiny_model(), gradient_as_bucket_view=True)
    built = policy(policy_name, uses_scaler=precision == "fp16", **wire)
    meter = NoiseScale(world, torch.device("cpu"), "samples", 0.5, ddp.module.parameters())
    install_counting_hook(ddp, (built.wire or PLAIN).comm_hook(), probe=meter.probe)
    width = max(max(m) for m in micro_sizes)
    data = window_data(3, world, [width] * len(micro_sizes[0]))
    mine = data[rank]
    real = [micro_sizes[r] for r in range(world)]
    local = width * len(mine)
    window = Window(0, len(mine), local, sum(real[rank]), sum(map(sum, real)), batches=iter(mine))
    prec = Precision(precision, "cpu", init_scale=init_scale, **overflow_handling(built))
    norm = build_normalizer("samples", "samples", world, torch.device("cpu"), 1.0)
    run_window(TorchDDP(ddp), window, built, mse_per_sample, norm, prec, meter)
    meter.end_window(1, window, norm, prec, ddp.parameters())
    return {"stats": _window_stats(meter), "data": data, "real": real,
            "params": {k: v.detach().clone() for k, v in tiny_model().state_dict().items()}}


def one_window_tokens(policy_name: str) -> dict:
    """One token-normalised window of the tiny transformer (test_lm's sequences: very unequal
    token counts per rank and micro-batch): the meter's numbers."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(tiny_lm(), gradient_as_bucket_view=True)
    built = policy(policy_name)
    meter = NoiseScale(world, torch.device("cpu"), "tokens", 0.5, ddp.module.parameters())
    install_counting_hook(ddp, (built.wire or PLAIN).comm_hook(), probe=meter.probe)
    mine = [pad_batch(seqs) for seqs in lm_window_batches()[rank]]
    samples = sum(len(x) for x, _ in mine)
    norm = build_normalizer("tokens", "tokens", world, torch.device("cpu"), 20.0)
    prec = Precision("fp32", "cpu")
    window = Window(0, len(mine), samples, samples, samples * world, batches=iter(mine))
    run_window(TorchDDP(ddp), window, built, token_loss_per_sample, norm, prec, meter)
    meter.end_window(1, window, norm, prec, ddp.parameters())
    return _window_stats(meter)


def reference_tokens(micro_batches: int | None = None) -> dict[str, float]:
    """The same window's numbers from plain autograd in float64: the gradient of each rank's
    summed token loss over its token count (the first `micro_batches` of its micro-batches),
    and of everything over the global count."""
    model = tiny_lm().double()
    grads, counts = [], []
    for rank_seqs in lm_window_batches():
        batches = [pad_batch(seqs) for seqs in rank_seqs][:micro_batches]
        model.zero_grad()
        total, count = 0.0, 0
        for x, y in batches:
            total = total + torch.nn.functional.cross_entropy(
                model(x).transpose(1, 2), y, reduction="sum", ignore_index=IGNORE_INDEX)
            count += int((y != IGNORE_INDEX).sum())
        total.backward()
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
        counts.append(count)
    return _window_statistics(grads, counts)


def reference_samples(out: dict, micro_batches: int | None = None) -> dict[str, float]:
    """one_window_samples' window from plain autograd in float64 (the real samples of each
    rank's first `micro_batches` micro-batches: the small batches, all ranks': the big one)."""
    model = tiny_model()
    model.load_state_dict(out["params"])
    model.double()
    grads, counts = [], []
    for rank_data, real in zip(out["data"], out["real"], strict=True):
        model.zero_grad()
        total, count = 0.0, 0
        for (x, y), k in list(zip(rank_data, real, strict=True))[:micro_batches]:
            total = total + ((model(x[:k].double()) - y[:k].double()) ** 2).mean(1).sum()
            count += k
        total.backward()
        grads.append(torch.cat([q.grad.flatten() for q in model.parameters()]))
        counts.append(count)
    return _window_statistics(grads, counts)


def _window_statistics(grads: list, counts: list[int]) -> dict[str, float]:
    """From each rank's summed window gradient and its real sample count: the mean squared norm
    of the ranks' mean gradients (the small batches), the squared norm of the all-ranks' mean
    (the big batch), and the two batch sizes (harmonic mean of the small ones)."""
    small = sum(float((gr / c) @ (gr / c)) for gr, c in zip(grads, counts, strict=True))
    big = sum(grads) / sum(counts)
    return {"grad_sq_small": small / len(grads), "grad_sq_big": float(big @ big),
            "batch_small": len(counts) / sum(1 / c for c in counts),
            "batch_big": float(sum(counts))}


def relative_error(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else math.inf
