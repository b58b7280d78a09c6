"""Functions the AMP tests run on every rank of the pool (see dist_pool.py): the project's real
precision, policies, loop and worker parts on a real gloo process group."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR

from dist_cases import policy as make_policy
from dist_cases import tiny_model, window_data
from gradsync.config.schema import RunConfig
from gradsync.data.contract import mse_per_sample
from gradsync.engines.torch_ddp import TorchDDP
from gradsync.run.worker import build_parts
from gradsync.sync.comm import PLAIN, install_counting_hook
from gradsync.train.loop import Progress, optimizer_step, run_window, train
from gradsync.train.metrics import RunLog
from gradsync.train.normalize import BySamples
from gradsync.train.precision import Precision, overflow_handling
from gradsync.train.windows import Window

MICRO = [3, 3, 3, 3]  # one window of four micro-batches per rank


def _params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _fp16_parts(sync_cfg: dict, init_scale: float, model: torch.nn.Module):
    """What optimizer_step asks of the loop's Parts, for a DDP model under fp16."""
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    kwargs = {k: v for k, v in sync_cfg.items() if k != "name"}
    built = make_policy(sync_cfg["name"], uses_scaler=True, **kwargs)
    precision = Precision("fp16", "cpu", init_scale=init_scale, **overflow_handling(built))
    counts = install_counting_hook(ddp, (built.wire or PLAIN).comm_hook())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    return SimpleNamespace(engine=TorchDDP(ddp, counts), optimizer=opt,
                           lr_scheduler=LambdaLR(opt, lambda s: 1.0),
                           precision=precision, policy=built,
                           trainer=SimpleNamespace(clip_grad_norm=0.0),
                           normalizer=BySamples(dist.get_world_size())), counts


def overflow_on_rank0(sync_cfg: dict, init_scale: float) -> dict:
    """Two windows under fp16. In the first, rank 0's second micro-batch overflows (a target of
    1e6 makes its scaled output gradient inf in fp16) while rank 1's data are ordinary; the
    second window is ordinary on both ranks. Records, per window, which micro-batches were
    computed and drawn, the scale each computed one saw, the step decision, the counters."""
    rank = dist.get_rank()
    p, counts = _fp16_parts(sync_cfg, init_scale, tiny_model())
    engine, precision, policy = p.engine, p.precision, p.policy
    initial = _params(engine.module)
    windows = []
    for w in range(2):
        mine = window_data(10 + w, dist.get_world_size(), MICRO)[rank]
        if w == 0 and rank == 0:
            x, y = mine[1]
            mine[1] = (x, y * 1e6)
        drawn: list[int] = []
        scales: list[float] = []

        def batches(mine=mine, drawn=drawn):
            for i, b in enumerate(mine):
                drawn.append(i)
                yield b

        def loss_fn(out, y, scales=scales):
            scales.append(precision.scale)
            return mse_per_sample(out, y)

        n = sum(MICRO)
        run_window(engine, Window(0, len(MICRO), n, n, n * dist.get_world_size(),
                                  batches=batches()), policy, loss_fn, p.normalizer, precision)
        syncs_before_step = counts.sync_backwards
        stepped, _ = optimizer_step(p.engine, p.optimizer, p.policy, p.normalizer,
                                    precision=p.precision, lr_scheduler=p.lr_scheduler,
                                    clip_grad_norm=p.trainer.clip_grad_norm)
        windows.append({
            "drawn": drawn, "computed": len(scales), "scales_seen": scales,
            "sync_backwards": syncs_before_step, "stepped": stepped,
            "scale_after": precision.scale, "lr_steps": p.lr_scheduler.last_epoch,
            "grads_zeroed": all(q.grad is None or not q.grad.any() for q in engine.parameters()),
            "params": _params(engine.module),
        })
    return {"initial": initial, "windows": windows, "overflow": vars(precision.overflow).copy(),
            "allreduce_bytes": counts.allreduce_bytes}


def train_all_ranks(cfg: dict) -> dict:
    """The worker's real parts and loop (no outputs written): every rank reports its own
    parameters, counters, scale and LR-scheduler position."""
    p = build_parts(RunConfig.from_plain(cfg), dist.get_rank(), dist.get_world_size(),
                    torch.device("cpu"))
    initial = _params(p.engine.module)
    state = train(p, Progress(), RunLog(Path("."), active=False))
    return {"initial": initial, "params": _params(p.engine.module), "step": state.step,
            "windows": state.windows, "scale": p.precision.scale,
            "lr_steps": p.lr_scheduler.last_epoch, "overflow": vars(p.precision.overflow).copy(),
            "sync_backwards": p.counts.sync_backwards, "allreduce_bytes": p.counts.allreduce_bytes,
            "allreduce_calls": p.counts.allreduce_calls, "last_loss": state.last_loss,
            "eval": state.last_eval}


def overflow_in_the_all_reduce(comm_dtype: str) -> dict:
    """One window of the same micro-batch four times on both ranks, at a scale that puts each
    micro-batch's largest scaled gradient at 30000 (fp16 holds up to 65504): the fp32 sum of
    the window reaches 120000, finite on each rank, but not once cast to fp16 for the wire."""
    model = tiny_model()
    x, y = window_data(30, 1, [3])[0][0]  # the same data on every rank
    (mse_per_sample(model(x), y)[0].sum() / 12).backward()
    biggest = max(q.grad.abs().max().item() for q in model.parameters())
    model.zero_grad(set_to_none=True)
    sync = {"name": "amp_aware", "comm_dtype": comm_dtype, "overflow_consensus": True}
    p, counts = _fp16_parts(sync, 30000.0 / biggest, model)
    initial = _params(model)
    run_window(p.engine, Window(0, 4, 12, 12, 12 * dist.get_world_size(),
                                batches=iter([(x, y)] * 4)),
               p.policy, mse_per_sample, p.normalizer, p.precision)
    scale_before = p.precision.scale
    stepped, _ = optimizer_step(p.engine, p.optimizer, p.policy, p.normalizer,
                                precision=p.precision, lr_scheduler=p.lr_scheduler,
                                clip_grad_norm=p.trainer.clip_grad_norm)
    return {"stepped": stepped, "scale_before": scale_before, "scale_after": p.precision.scale,
            "sync_backwards": counts.sync_backwards, "overflow": vars(p.precision.overflow).copy(),
            "moved": max((a - b).abs().max().item()
                         for a, b in zip(_params(model).values(), initial.values(), strict=True))}
