"""Seeds: the run seed and the streams derived from it.

Model initialisation draws from the run seed alone (identical on every rank and for every world
size); everything a rank draws afterwards (dropout, say) comes from its own stream, derived from
(seed, rank), so ranks never share random numbers by accident; data is built and loaded from
streams of its own (data/loader.py, data/contract.py).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (seed, rank, epoch...): neighbouring inputs give
    unrelated streams, unlike seed + rank."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1, np.uint64)[0] >> 1)


def seed_everything(seed: int) -> None:
    """Python, NumPy and torch from the run seed: identical on every rank (model init)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Python's, NumPy's and torch's CPU streams seeded from `seed` inside, as they were after:
    what is built inside draws the same wherever it is built (data, built by the config check
    and by the workers)."""
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.default_generator.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])


def seed_rank(seed: int, rank: int) -> None:
    """Switch this rank to its own streams once the shared draws (model init) are done."""
    seed_everything(derive_seed(seed, rank))
