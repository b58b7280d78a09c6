"""compile.enabled: torch.compile where each engine needs it (docs/components.md "Compile").

- torch_ddp: the DDP wrapper, compiled. Dynamo runs DDP's own forward eagerly and
  compiles the model inside it with its DDPOptimizer, which splits the graph at DDP's bucket
  boundaries so that each bucket's all-reduce can start while the backward goes on (torch's
  DDPOptimizer wants its first bucket, 1 MB, no larger than the others: bucket_cap_mb >= 1).
- gradsync: the model; the engine's gradient hooks fire as the compiled backward hands each
  gradient to autograd.
- fsdp, hsdp: each unit below the root, its forward alone (torchtitan compiles each block):
  FSDP2's hooks around it, which all-gather before and reduce-scatter after, stay eager.
Only the forward the engine runs in training is compiled: the module stays as it is (its
parameter names, no ``_orig_mod.``: checkpoints, ``sync.groups`` rules and ``+inspect=params``
see the eager model), and evaluation runs it eager (no recompile for no_grad).

What compiling cost is counted apart (``summary.json``'s ``compile``): the graphs dynamo built
(a recompile is one more: a new input shape before dynamic shapes take over, a new grad mode)
and the seconds it spent, which ``samples_per_s`` leaves out.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

# dynamo's timers: a frame's whole compilation (its forward graph, and the backward where AOT
# autograd compiles it then), and a backward compiled lazily at its first call (inductor)
COMPILE_TIMES = ("_compile.compile_inner", "backward._backward_impl")


@dataclass(frozen=True)
class Compile:
    backend: str = "inductor"
    mode: str | None = None
    dynamic: bool | None = None

    def wrap(self, module: Any) -> Any:
        """The forward the engine runs in training: `module` compiled (its parameters, its
        names: the module itself is left as it is, and evaluation runs it eager)."""
        import torch._dynamo
        from torch._dynamo.utils import compilation_time_metrics, counters

        # this run's graphs and seconds only: a process that compiled the same code before
        # (a notebook, a test's pool) would reuse its graphs, counted nowhere
        torch._dynamo.reset()
        counters.clear()
        compilation_time_metrics.clear()
        return torch.compile(module, backend=self.backend, mode=self.mode, dynamic=self.dynamic)

    def compile_forward(self, module: nn.Module) -> None:
        """`module`'s forward compiled where it computes gradients (a sharded engine's unit,
        between FSDP's hooks, which stay eager), eager under no_grad (evaluation)."""
        eager = module.forward
        compiled = self.wrap(eager)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return (compiled if torch.is_grad_enabled() else eager)(*args, **kwargs)

        module.forward = forward  # type: ignore[method-assign]

    def report(self) -> dict[str, Any]:
        """This process's graphs and compile seconds so far."""
        from torch._dynamo.utils import compilation_time_metrics, counters

        return asdict(self) | {
            "graphs": int(counters["stats"]["unique_graphs"]),
            "compile_s": float(sum(sum(compilation_time_metrics.get(k, []))
                                   for k in COMPILE_TIMES))}
