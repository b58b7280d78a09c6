"""The floor on overhead: a minimal hand-written DDP loop with no_sync() on the first N-1
micro-batches of each window and loss / N. With ddp=False it is the no-communication bound:
the same processes and compute, no DDP, no all-reduce."""

from __future__ import annotations

from contextlib import nullcontext

from torch.nn.parallel import DistributedDataParallel

import workload as w


def run(accum: int, ddp: bool = True, count_hook=None) -> dict:
    w.init()
    model = w.model()
    if ddp:
        model = DistributedDataParallel(model)
        if count_hook:
            count_hook(model)
    opt = w.optimizer(model.parameters())
    data, sampler = w.loader(w.dataset())
    loss_sum, count = 0.0, 0

    def epoch(epoch: int, limit: int) -> None:
        nonlocal loss_sum, count
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(data):
            if i == limit:
                break
            sync = not ddp or (i + 1) % accum == 0 or i + 1 == len(data)
            with nullcontext() if sync else model.no_sync():
                loss = w.loss_fn(model(x), y)
                (loss / accum).backward()
            if (i + 1) % accum == 0 or i + 1 == len(data):
                opt.step()
                opt.zero_grad()
            if epoch == 1:
                loss_sum, count = loss_sum + loss.item(), count + 1

    epoch(0, w.WARMUP_MICRO)
    w.start_clock()
    epoch(1, len(data))
    return w.result(w.stop_clock(), loss_sum, count)
