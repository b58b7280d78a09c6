"""The training loop and what it asks: schedules, loss normalisation, precision, LR schedulers,
the training state and its checkpoints, what a run records.

``python -m gradsync.train`` is the entry point (``gradsync-train``; run/main.py).
"""


def main() -> None:
    """gradsync-train as installs before the move into packages named it
    (``gradsync.train:main``)."""
    from gradsync.run.main import main as run_main

    run_main()
