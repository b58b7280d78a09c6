"""One job: the entry point (main.py), the launcher and its workers, SLURM, the run dir, faults
and the sweep summary."""
