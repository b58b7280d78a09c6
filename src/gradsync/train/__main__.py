"""``python -m gradsync.train``, the entry point's old module name: one line naming the new one
(``python -m gradsync``, as torchrun and srun call it), exit code 2."""

import sys

print("gradsync: `python -m gradsync.train` is now `python -m gradsync` (torchrun ... -m gradsync "
      "...; or gradsync-train)", file=sys.stderr)
sys.exit(2)
