"""python -m gradsync.engines trace RUN_DIR: merge a run's per-rank sync trace files into
trace.json and print its summary table (engines/trace.py)."""

import sys

from gradsync.engines.trace import USAGE, main

if __name__ == "__main__":
    args = sys.argv[1:]
    if not args or args[0] != "trace":
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(args[1:]))
