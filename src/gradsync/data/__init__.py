"""Data: the contract a data component meets (contract.py: DataBundle), one module per built-in
data set (digits, synthetic, synthetic_lm, corpus: stdlib_text; token helpers in tokens.py),
the sampler and loader every run uses (loader.py), and evaluation (evaluation.py).

``gradsync.data.<name>`` names every built-in builder (the ``_target_`` paths of conf/data/)
and the contract's names a component of one's own uses."""

from gradsync.data.contract import (  # noqa: F401
    DataBuilder,
    DataBundle,
    argmax_correct,
    cross_entropy_per_sample,
    mse_per_sample,
    provides,
)
from gradsync.data.corpus import stdlib_text  # noqa: F401
from gradsync.data.digits import digit_arrays, digits  # noqa: F401
from gradsync.data.synthetic import synthetic  # noqa: F401
from gradsync.data.synthetic_lm import synthetic_lm  # noqa: F401
from gradsync.data.tokens import IGNORE_INDEX, TokenSequences, pad_batch  # noqa: F401
