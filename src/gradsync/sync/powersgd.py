"""PowerSGD (Vogels et al., 2019) as the all-reduce of the accumulate and amp_aware policies:
torch's own ``powerSGD_hook`` all-reduces rank-r factors P and Q of every gradient matrix
instead of the matrix, with error feedback (what the approximation left out is added to the
next window's gradient) and warm-started Q. Approximate communication: the model it trains
differs from exact training; the benchmark reports by how much.

Error feedback and skipped fp16 steps: a window whose gradients overflowed reaches the hook
with inf/nan in it (or, with amp_aware's consensus, never reaches it), and the scaler then
skips the step on every rank. The hook's memory of that window (its error and warm-start
factors) is then garbage; it is dropped on every rank alike and starts again from zero and
from the state's seeded generator, so no inf/nan outlives the skipped step and the replicas
stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    powerSGD_hook,
)


@dataclass
class PowerSGD:
    state: PowerSGDState
    last_elements: int = 0  # elements the last bucket put on the wire

    def forget(self) -> None:
        """After a skipped step: drop the error feedback and warm-start factors."""
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()


def build_powersgd(rank: int, start_step: int, seed: int = 0) -> PowerSGD:
    """rank: of the approximation; start_step: synchronising backwards all-reduced exactly
    before compression starts (torch needs >= 2 with error feedback)."""
    return PowerSGD(PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                  start_powerSGD_iter=start_step, use_error_feedback=True,
                                  warm_start=True, random_seed=seed,
                                  compression_stats_logging_frequency=2**62))


def powersgd_hook(ps: PowerSGD, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's hook, noting how many elements it sends: the whole bucket while it still
    all-reduces exactly, else the factors plus the tensors not worth compressing (biases)."""
    s = ps.state
    exact = s.iter < s.start_powerSGD_iter
    before = s.total_numel_after_compression
    # torch's hook seeds its random Q with torch.manual_seed inside fork_rng(devices=[]): the
    # CPU stream comes back, the CUDA generators (dropout's) would not. Fork the bucket's.
    device = bucket.buffer().device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        fut = powerSGD_hook(s, bucket)
    ps.last_elements = (bucket.buffer().numel() if exact
                        else s.total_numel_after_compression - before)
    return fut


def sent_bytes(ps: PowerSGD, bucket: dist.GradBucket) -> int:
    return ps.last_elements * bucket.buffer().element_size()
