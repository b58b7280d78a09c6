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

    def epoch(epoch: int, limit: int) -> tuple[float, int]:
        loss_sum, count = 0.0, 0
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
            loss_sum, count = loss_sum + loss.item(), count + 1
        return loss_sum, count

    return w.timed_epoch(epoch, len(data))
