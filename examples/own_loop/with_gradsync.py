"""nanoGPT's training loop (its train.py), tiny, on CPU ranks (gloo): byte windows of this
Python's standard library, a small GPT, AdamW with nanoGPT's decay groups, get_lr (warm-up, then
cosine), gradient accumulation that all-reduces on the last micro-batch only, gradients clipped
at 1.0. plain_ddp.py runs it with torch's DDP as nanoGPT does; with_gradsync.py is the same loop
with gradsync added (README.md here: the diff, and what each line buys).

    torchrun --standalone --nproc-per-node=2 plain_ddp.py [--max_iters=50 ...]
    torchrun --standalone --nproc-per-node=2 with_gradsync.py [--max_iters=50 ...]
"""

import ast
import math
import os
import sys

import torch
import torch.distributed as dist

import gradsync.data.corpus  # the data: byte windows of the standard library (no download)
import gradsync.models  # the GPT: gradsync's small causal Transformer

# the configuration: nanoGPT's names, --key=value overrides them (as its configurator.py)
out_dir = "out-" + os.path.basename(__file__).removesuffix(".py")
seed = 0
block_size = 64
packed = True  # windows of exactly block_size + 1 bytes; False: chunks cut at blank lines
batch_size = 8  # per rank, per micro-batch
gradient_accumulation_steps = 4  # micro-batches per optimizer step, per rank
n_layer, n_head, n_embd = 2, 2, 32
learning_rate, min_lr_ratio = 1e-3, 0.1  # nanoGPT's min_lr is learning_rate * min_lr_ratio
max_iters = 200  # also nanoGPT's lr_decay_iters: the cosine ends at the last step
warmup_iters = 20
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.99, 1.0
for arg in sys.argv[1:]:  # --key=value
    key, value = arg.removeprefix("--").split("=", 1)
    globals()[key] = value if isinstance(globals()[key], str) else ast.literal_eval(value)


def get_lr(it):
    """nanoGPT's get_lr, as learning_rate times a ratio (torch's LambdaLR computes it so)."""
    if it < warmup_iters:  # linear warm-up
        return learning_rate * ((it + 1) / (warmup_iters + 1))
    decay_ratio = min(1.0, (it - warmup_iters) / (max_iters - warmup_iters))
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # from 1 to 0
    return learning_rate * (min_lr_ratio + (1 - min_lr_ratio) * coeff)


dist.init_process_group("gloo")  # torchrun's env://
torch.set_num_threads(1)  # the bits depend on the thread count
data = gradsync.data.corpus.stdlib_text(max_len=block_size + 1, max_bytes=1_000_000, packed=packed)
loader = gradsync.loader(data.train, batch_size, seed=seed, collate=data.collate)
torch.manual_seed(seed)  # the same init on every rank (DDP broadcasts rank 0's anyway)
model = gradsync.models.Transformer(vocab_size=256, max_len=block_size, d_model=n_embd,
                                    n_layers=n_layer, n_heads=n_head)
# nanoGPT's configure_optimizers: weight decay on the matrices only (2 dimensions or more)
params = list(model.parameters())
optimizer = torch.optim.AdamW([
    {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
    {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
], lr=learning_rate, betas=(beta1, beta2))
policy = gradsync.AccumulateSync()  # sync the last micro-batch of each window
model = gradsync.engine(model, policy)  # torch's DDP, driven by the policy
normalizer = gradsync.normalizer(policy, "tokens", data.tokens_per_sample, data.uniform_length)
windows = gradsync.windows(loader, 0, gradient_accumulation_steps)  # epoch 0's windows
for iter_num, window in zip(range(max_iters), windows, strict=False):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    loss = gradsync.run_window(model, window, policy, data.loss, normalizer)
    gradsync.optimizer_step(model, optimizer, policy, normalizer, clip_grad_norm=grad_clip)
    if dist.get_rank() == 0 and iter_num % 10 == 0:
        print(f"iter {iter_num}: loss {loss.item():.4f}")
if dist.get_rank() == 0:
    os.makedirs(out_dir, exist_ok=True)
    gradsync.save_checkpoint(out_dir, iter_num + 1, model=model.module.state_dict())
dist.destroy_process_group()
