"""gradsync: DDP training whose sync policies decide, micro-batch by micro-batch, whether a
backward runs inside ``no_sync()`` or synchronises."""

__version__ = "0.1.0"
