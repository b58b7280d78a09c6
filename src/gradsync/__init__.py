"""gradsync: DDP training whose sync policies decide, micro-batch by micro-batch, whether a
backward runs inside ``no_sync()`` or synchronises."""

__version__ = "0.1.0"

# A rank a launcher spawned dies with it from this line on, before anything of the job is
# imported (core/lifeline.py); elsewhere nothing happens.
from gradsync.core.lifeline import bind_from_environment  # noqa: E402

bind_from_environment()
