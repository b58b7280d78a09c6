"""``python -m gradsync`` (as torchrun and srun call it): the gradsync-train entry point."""

from gradsync.run.main import main

main()
