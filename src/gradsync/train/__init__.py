"""The training loop and what it asks: schedules, loss normalisation, precision, LR schedulers,
the training state and its checkpoints, what a run records.
"""
