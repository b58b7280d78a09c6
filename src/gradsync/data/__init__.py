"""Data: the contract a data component meets (DataBundle), the built-in data sets, the
corpus, the sampler and loader every run uses, and evaluation.

``gradsync.data.<name>`` reaches every built-in builder and the contract's helpers: the
``_target_`` paths of conf/data/ and a data component of one's own import from here."""

from gradsync.data.bundle import *  # noqa: F401,F403
from gradsync.data.bundle import DataBundle, provides  # noqa: F401
from gradsync.data.corpus import stdlib_text  # noqa: F401
