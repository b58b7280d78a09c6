"""GPU cases. Those that need a process of their own (a one-rank nccl group, a fresh CUDA
state): `python tests/gpu_cases.py <case> [args]` prints one JSON line. The others run on the
ranks of a pool whose default group is made as "cuda:gloo" (gpu_rank first): like nccl it
serves CUDA tensors only, and unlike nccl it lets 2 ranks share one GPU. Run by
tests/test_gpu.py."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

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
    from gradsync.run.main import compose_plain
    from gradsync.run.placement import Placement
    from gradsync.run.preflight import preflight
    from gradsync.run.worker import build_parts
    from gradsync.train.loop import optimizer_step, run_window
    from gradsync.train.windows import windows

    device = one_rank_nccl()
    cfg = compose_plain(["trainer.backend=nccl", "trainer.devices=1", f"precision={precision}",
                         "trainer.clip_grad_norm=1.0", "data=synthetic", "data.num_samples=1024",
                         "schedule.window_size=2", "model.dropout=0.1"])
    preflight(cfg, Placement("nccl", 1))
    p = build_parts(RunConfig.from_plain(cfg), 0, 1, device)
    epoch = windows(p.loader, 0, p.schedule.window_size(0), device=p.device)

    def window() -> torch.Tensor | None:
        cut = next(epoch, None)
        if cut is None:
            return None
        loss = run_window(p.engine, cut, p.policy, p.loss, p.normalizer, p.precision,
                          call=p.call)
        optimizer_step(p.engine, p.optimizer, p.policy, p.normalizer, precision=p.precision,
                       clip_grad_norm=p.trainer.clip_grad_norm, lr_scheduler=p.lr_scheduler)
        return loss

    for _ in range(2):  # DDP's first iterations (bucket rebuild) are set-up, not the hot path
        window()
    torch.cuda.synchronize()
    losses = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        while (loss := window()) is not None:
            losses.append(loss)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    values = torch.stack(losses).tolist()  # a logging step: here the host reads them
    dist.destroy_process_group()
    return {"windows": len(losses), "finite": all(v == v for v in values)}


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
    policy = as_policy(AccumulateSync("powersgd", powersgd_rank=1, powersgd_start_backwards=2))
    install_counting_hook(ddp, policy.wire.comm_hook())
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


# --- every policy, resumed bitwise ---------------------------------------------------------
# 199 samples (prime: the last window is short and one rank gets the sampler's repeat), micro 8,
# accum 3; 2 epochs of 5 windows on 2 ranks, 9 on 1; dropout and AdamW; a checkpoint every 2
# steps; every rank checks the replicas after each step (trainer.check_replicas=1: fault 2) and
# the drift of local SGD / DiLoCo is max-reduced at every log step (fault 1).
BASE = ["data=synthetic", "data.num_samples=199", "data.eval_samples=64", "data.in_dim=8",
        "data.out_dim=2", "schedule.micro_batch_size=8", "model.hidden_sizes=[16]",
        "model.dropout=0.1", "optimizer=adamw", "optimizer.lr=0.01", "schedule.window_size=3",
        "trainer.max_epochs=2", "trainer.log_every_windows=1", "trainer.checkpoint_every_steps=2",
        "trainer.keep_checkpoints=50", "trainer.check_replicas=1", "trainer.deterministic=true",
        "trainer.progress_bar=false", "seed=5"]
FP16 = ["precision=fp16", "precision.init_scale=4194304.0", "precision.growth_interval=3"]
POLICIES = {  # every 3: the checkpoint at step 4 falls between two averagings (fault 3)
    "always": ["sync=always"],
    "accumulate": [],
    "amp_aware_bf16_wire": ["sync=amp_aware", "sync.comm_dtype=bf16"],
    "amp_aware_fp16": [*FP16, "sync=amp_aware", "sync.comm_dtype=fp16"],
    "powersgd": ["sync.compression=powersgd", "sync.powersgd_start_backwards=2"],
    "local_sgd": ["sync=local_sgd", "sync.every=3"],
    "diloco": ["sync=diloco", "sync.every=3"],
    "mixed_wire_groups": ["sync.groups=[{params: '*.bias', comm_dtype: bf16}]"],  # fault 4
    "every_groups": ["sync.groups=[{params: '0.*', every: 3}]"],
}
RESUME_AT = 4
# PowerSGD's error feedback and warm-start factors are not in checkpoints (docs/sync-policies.md):
# its resume continues, not bitwise
NOT_BITWISE = {"powersgd"}


def gpu_rank() -> None:
    """A pool rank on the one GPU: cuBLAS told to be deterministic before its handle exists."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(0)


def policy_cfg(policy: str) -> dict:
    from gradsync.run.main import compose_plain
    from gradsync.run.placement import Placement
    from gradsync.run.preflight import preflight

    cfg = compose_plain([*BASE, *POLICIES[policy]])
    preflight(cfg, Placement("nccl", 2))
    return cfg


def shared_gpu_placement(backend: str, rank: int, world: int):
    """Where the worker puts a rank of the shared-GPU cases: each rank as alone on its node
    (local rank 0 of 1), so cuda:0 however many GPUs the machine has: the ranks really share one
    GPU (as cuda:LOCAL_RANK, rank 1 would go to cuda:1 on a 2-GPU box)."""
    from gradsync.run.placement import Placement

    return Placement(backend, world, "torchrun", rank, 0, 1)


def train_on_gpu(cfg: dict, run_dir: str) -> dict:
    """The worker's run_training on this rank's default group, on cuda:<current device>;
    rank 0 returns the final parameters and metrics rows too."""
    from gradsync.config.schema import RunConfig
    from gradsync.run.worker import run_training
    from gradsync.train import checkpoint

    # the CPU: to try the case itself on a gloo pool
    placement = shared_gpu_placement("nccl" if torch.cuda.is_available() else "gloo",
                                     dist.get_rank(), dist.get_world_size())
    summary = run_training(RunConfig.from_plain(cfg), Path(run_dir), placement)
    out: dict = {"summary": summary}
    if dist.get_rank() == 0:
        out["params"] = checkpoint.load(Path(run_dir) / "checkpoints" / "last.pt")["model"]
        out["rows"] = [json.loads(x) for x in
                       (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return out


def rows_key(rows: list[dict]) -> list[tuple]:
    return [(r["window"], r["step"], r["stepped"], r["loss"].hex(), r["lr"].hex(),
             r.get("replica_drift", 0.0).hex()) for r in rows]


def resumed_bitwise(policy: str, base_dir: str) -> dict:
    """One policy trained through, then continued from its checkpoint at step RESUME_AT in a
    fresh run dir (as a requeued job resumes): what differs (nothing, when exact)."""
    from gradsync.train import checkpoint

    cfg = policy_cfg(policy)
    through = train_on_gpu(cfg, f"{base_dir}/{policy}/through")
    ckpt = checkpoint.step_path(Path(f"{base_dir}/{policy}/through/checkpoints"), RESUME_AT)
    resumed = train_on_gpu(cfg | {"resume": str(ckpt)}, f"{base_dir}/{policy}/resumed")
    if dist.get_rank() != 0:
        return {}
    windows = checkpoint.load(ckpt)["progress"]["windows"]
    params = [k for k, v in through["params"].items() if not torch.equal(v, resumed["params"][k])]
    return {"windows": through["summary"]["windows"],
            "params_differ": params,
            "rows_equal": rows_key(resumed["rows"]) == rows_key(through["rows"])[windows:],
            "drift_rows": sum("replica_drift" in r for r in through["rows"]),
            "resumed_from": resumed["summary"]["resumed_from"] == str(ckpt),
            "device": through["summary"]["device"]}


def one_rank_nccl_resumed(base_dir: str) -> dict:
    """Every policy on a 1-rank nccl group, each resumed bitwise."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    one_rank_nccl()
    out = {policy: resumed_bitwise(policy, base_dir) for policy in POLICIES}
    dist.destroy_process_group()
    return out


# --- fault 4 on its own: each work waited on before its buffer is read ------------------------
class Bucket:
    """What a DDP comm hook reads of its GradBucket: one flat buffer, views per parameter."""

    def __init__(self, params: list, grads: torch.Tensor):
        self.buf, self.params = grads, params
        self.grads, offset = [], 0
        for p in params:
            self.grads.append(grads[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def buffer(self) -> torch.Tensor:
        return self.buf

    def parameters(self) -> list:
        return self.params

    def gradients(self) -> list:
        return self.grads


def grouped_mean(numel: int) -> dict:
    """grouped_allreduce on this pool's cuda:gloo group, a large bucket of two wire dtypes
    (fp32 weights, bf16 biases): the result must be the mean over ranks of what each rank
    put in, read after the reduction landed (each rank's values differ)."""
    from gradsync.sync.comm import CommCounts
    from gradsync.sync.layer_sync import LayerSync, grouped_allreduce

    model = torch.nn.Linear(numel, 4, device="cuda")
    layers = LayerSync([{"params": "bias", "comm_dtype": "bf16"}], None, CommCounts())
    layers.bind(model)
    params = list(model.parameters())
    rank = dist.get_rank()
    grads = torch.cat([torch.full((p.numel(),), float(rank + 1), device="cuda")
                       for p in params])  # ranks 1 and 2: the mean is 1.5, bf16-exact
    out = grouped_allreduce(layers, Bucket(params, grads)).wait()  # type: ignore[arg-type]
    torch.cuda.synchronize()
    return {"all_mean": bool((out == 1.5).all()), "numel": out.numel()}


if __name__ == "__main__":
    case, *args = sys.argv[1:]
    cases = {"hot_path": hot_path, "powersgd_rng": powersgd_rng,
             "one_rank_nccl_resumed": one_rank_nccl_resumed}
    print(json.dumps(cases[case](*args)))
