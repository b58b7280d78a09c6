"""The frameworks people would use instead, on the same workload: Lightning with
accumulate_grad_batches and HF Accelerate with accumulate(). Benchmark-only extras (make bench
installs them); each joins the process group the harness already set up."""

from __future__ import annotations

import os

import torch

import workload as w


def lightning(accum: int, count_hook=None) -> dict:
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    os.environ.setdefault("GROUP_RANK", "0")  # TorchElasticEnvironment: no process launching
    w.init()
    data, _ = w.loader(w.dataset())
    clock = {"loss_sum": 0.0, "count": 0}

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = w.model()

        def training_step(self, batch, i):
            loss = w.loss_fn(self.net(batch[0]), batch[1])
            if self.current_epoch == 1:
                clock["loss_sum"] += loss.item()
                clock["count"] += 1
            return loss

        def on_train_batch_start(self, batch, i):
            if self.current_epoch == 0 and i == w.WARMUP_MICRO:
                return -1  # ends the warm-up epoch
            return None

        def on_train_epoch_start(self):
            if self.current_epoch == 1:
                w.start_clock()

        def on_train_epoch_end(self):
            if self.current_epoch == 1:
                clock["samples_per_s"] = w.stop_clock()

        def on_fit_start(self):
            if count_hook:
                count_hook(self.trainer.strategy.model)

        def configure_optimizers(self):
            return w.optimizer(self.parameters())

    trainer = L.Trainer(
        accelerator="cpu", devices=w.WORLD, num_nodes=1, strategy=DDPStrategy(),
        max_epochs=2, accumulate_grad_batches=accum, use_distributed_sampler=False,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, deterministic=False)
    torch.set_num_threads(1)
    trainer.fit(Module(), train_dataloaders=data)
    return w.result(clock["samples_per_s"], clock["loss_sum"], clock["count"])


def accelerate(accum: int, count_hook=None) -> dict:
    from accelerate import Accelerator

    w.init()
    acc = Accelerator(cpu=True, gradient_accumulation_steps=accum)
    torch.set_num_threads(1)
    data, sampler = w.loader(w.dataset())
    model = w.model()
    opt = w.optimizer(model.parameters())
    # the DataLoader is not prepared: it already shards with the same seeded sampler as the
    # other variants (prepare() would re-shard it its own way)
    model, opt = acc.prepare(model, opt)
    if count_hook:
        count_hook(model)

    def epoch(epoch: int, limit: int) -> tuple[float, int]:
        loss_sum, count = 0.0, 0
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(data):
            if i == limit:
                break
            with acc.accumulate(model):
                loss = w.loss_fn(model(x), y)
                acc.backward(loss)
                opt.step()
                opt.zero_grad()
            loss_sum, count = loss_sum + loss.item(), count + 1
        return loss_sum, count

    return w.timed_epoch(epoch, len(data))
