"""``python -m gradsync.train`` (as torchrun and srun call it): the gradsync-train entry point."""

from gradsync.run.main import main

main()
