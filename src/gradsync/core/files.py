"""Files replaced atomically: written under a temporary name beside the target, flushed and
fsynced, then renamed over it, so a crash mid-write never leaves a torn file under the final
name. Any error on the way (a full disk, a file-size limit) removes the temporary file and is
raised as it is: the caller reports it as what it is. Files are created with the process's
umask, like every other output of a run."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


@contextmanager
def replacing(path: Path, binary: bool = False, tmp: Path | None = None) -> Iterator[IO[Any]]:
    """``with replacing(path) as f: f.write(...)``: `path` holds what was written, or is left
    as it was and no temporary file remains (an OSError then names `path`)."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    created = False
    try:
        with open(tmp, "wb" if binary else "w") as f:
            created = True
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if created:
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file
            e.filename = str(path)
        raise


def write_json_atomic(path: Path, obj: Any) -> None:
    with replacing(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A JSON tree's leaves under dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``): how a
    checkpoint's config and a numerics fingerprint are compared key by key."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}
