"""GPU cases that need a process of their own (a one-rank nccl group, a fresh CUDA state):
`python tests/gpu_cases.py <case> [args]` prints one JSON line. Run by tests/test_gpu.py."""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def one_rank_nccl() -> torch.device:
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    return torch.device("cuda", 0)


def hot_path(precision: str) -> dict:
    """The loop's windows (forward, backward, all-reduce, clip, step) under
    torch.cuda.set_sync_debug_mode("error"): any wait for the GPU on the host raises."""
    from gradsync.config.schema import RunConfig
    from gradsync.config.validate import validate
    from gradsync.data.bundle import epoch_batches
    from gradsync.run.main import compose_plain
    from gradsync.run.placement import Placement
    from gradsync.run.worker import build_parts
    from gradsync.train.loop import optimizer_step, run_window
    from gradsync.train.schedules import Shard, plan_epoch

    device = one_rank_nccl()
    cfg = compose_plain(["trainer.backend=nccl", "trainer.devices=1", f"precision={precision}",
                         "trainer.clip_grad_norm=1.0", "data=synthetic", "data.num_samples=1024",
                         "schedule.accum_steps=2", "model.dropout=0.1"])
    validate(cfg, Placement("nccl", 1))
    p = build_parts(RunConfig.from_plain(cfg), 0, 1, device)
    shard = Shard(len(p.sampler.dataset), 0, 1)  # type: ignore[arg-type]
    plan = plan_epoch(shard, p.micro_batch_size, p.schedule.accum_steps(0))
    batches = epoch_batches(p.loader, 0)

    def window(k: int) -> torch.Tensor:
        loss = run_window(p.engine, batches, plan[k], p.policy, p.precision, p.loss, p.device,
                          p.normalizer)
        optimizer_step(p, want_norm=False)
        return loss

    for k in range(2):  # DDP's first iterations (bucket rebuild) are set-up, not the hot path
        window(k)
    torch.cuda.synchronize()
    losses = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(2, len(plan)):
            losses.append(window(k))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    values = torch.stack(losses).tolist()  # a logging step: here the host reads them
    dist.destroy_process_group()
    return {"windows": len(plan) - 2, "finite": all(v == v for v in values)}


def powersgd_rng() -> dict:
    """torch's powerSGD_hook reseeds every CUDA generator when it starts compressing; our hook
    forks the bucket device's, so the CUDA stream (dropout's) is untouched."""
    from torch.nn.parallel import DistributedDataParallel

    from gradsync.sync.comm import install_counting_hook
    from gradsync.sync.policies import AccumulateSync
    from gradsync.sync.policy import as_policy

    device = one_rank_nccl()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)).to(device)
    ddp = DistributedDataParallel(model, device_ids=[0])
    policy = as_policy(AccumulateSync("powersgd", powersgd_rank=1, powersgd_start_step=2))
    install_counting_hook(ddp, policy.comm_hook())
    torch.cuda.manual_seed(123)
    unchanged = []
    for _ in range(4):  # exact, exact, then compressed (the hook seeds its Q here)
        x = torch.randn(8, 32).to(device)  # drawn on the CPU: the CUDA stream stays put
        before = torch.cuda.get_rng_state(device)
        ddp(x).square().sum().backward()
        torch.cuda.synchronize()
        unchanged.append(bool(torch.equal(before, torch.cuda.get_rng_state(device))))
    dist.destroy_process_group()
    return {"unchanged": unchanged}


if __name__ == "__main__":
    case, *args = sys.argv[1:]
    print(json.dumps({"hot_path": hot_path, "powersgd_rng": powersgd_rng}[case](*args)))
