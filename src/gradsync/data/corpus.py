"""A real text corpus that ships with every Python: byte-level language modelling on the standard
library's own ``.py`` files, made at run time (no download).

The files are found through ``sysconfig`` (``site-packages`` / ``dist-packages`` left out),
listed by their path relative to the stdlib root, and put in a fixed pseudo-random order (the
SHA-256 of that path), so a ``max_bytes`` budget samples the whole library rather than its
alphabetically first modules. Each file goes whole to train or to eval (also decided by the
path's hash: ``eval_fraction`` of the files), so no eval text was ever trained on. A file is cut
into variable-length chunks at blank lines, each at most ``max_len`` bytes (a paragraph longer
than that is cut at ``max_len``); every byte is one token (vocabulary 256).

The corpus differs between Python builds: ``provenance`` gives its SHA-256 (over every chosen
file's split, path and bytes) and sizes, which the launcher records in run_info.json.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gradsync.components import CheckContext, ConfigError, checks, describes, require
from gradsync.data.contract import DataBundle, provides
from gradsync.data.tokens import token_bundle

VOCAB = 256  # bytes
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
BLANK_LINES = re.compile(rb"\n(?:[ \t]*\n)+")  # a chunk may end after a run of blank lines


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_files(root: Path) -> list[str]:
    """Every .py file under root (symlinked directories not followed, installed packages left
    out), as sorted POSIX paths relative to root."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    return sorted(found)


def _path_hash(rel: str) -> bytes:
    return hashlib.sha256(rel.encode()).digest()


@dataclass
class Corpus:
    """The chosen files (relative paths, in corpus order) and their text."""

    root: Path
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    text: dict[str, bytes] = field(default_factory=dict)
    sha256: str = ""

    @property
    def train_bytes(self) -> int:
        return sum(len(self.text[f]) for f in self.train_files)

    @property
    def eval_bytes(self) -> int:
        return sum(len(self.text[f]) for f in self.eval_files)


@functools.lru_cache(maxsize=4)
def select(root: Path, max_bytes: int, eval_fraction: float) -> Corpus:
    """Files in the order of their path's SHA-256 while the total stays within max_bytes (one
    that would exceed it is skipped, smaller ones after it still fit; files under 2 bytes are
    left out); each file to eval when its hash (other bits than the order's) falls in the first
    eval_fraction of the range, else to train. Read once per process and arguments: the
    launcher's check and run_info.json, and the workers it forks, share the result (never
    modified)."""
    corpus = Corpus(root)
    digest = hashlib.sha256()
    total = 0
    for rel in sorted(python_files(root), key=_path_hash):
        size = (root / rel).stat().st_size
        if size < 2 or total + size > max_bytes:  # empty files (__init__.py) hold no chunk
            continue
        data = (root / rel).read_bytes()
        total += len(data)
        to_eval = int.from_bytes(_path_hash(rel)[8:16], "big") < eval_fraction * 2**64
        (corpus.eval_files if to_eval else corpus.train_files).append(rel)
        corpus.text[rel] = data
        # the split, the path and the length delimit each file: no two corpora hash alike
        digest.update(b"E" if to_eval else b"T")
        digest.update(rel.encode() + b"\0" + len(data).to_bytes(8, "big") + data)
    corpus.sha256 = digest.hexdigest()
    return corpus


def chunks(text: bytes, max_len: int, min_len: int = 2) -> list[bytes]:
    """Consecutive pieces of text, each ending at a run of blank lines where it can: paragraphs
    are packed greedily while the chunk stays within max_len bytes, a longer paragraph is cut
    every max_len bytes. Chunks shorter than min_len (a lone byte predicts nothing) are
    dropped; otherwise the chunks joined give back the text."""
    cuts = [m.end() for m in BLANK_LINES.finditer(text)]
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True) if b > a]
    out: list[bytes] = []
    current = b""
    for piece in pieces:
        if len(current) + len(piece) <= max_len:
            current += piece
            continue
        if current:
            out.append(current)
        while len(piece) > max_len:
            out.append(piece[:max_len])
            piece = piece[max_len:]
        current = piece
    if current:
        out.append(current)
    return [c for c in out if len(c) >= min_len]


def windows(text: bytes, max_len: int) -> list[bytes]:
    """The text cut into windows of exactly max_len bytes, each starting where the previous
    one's last byte is (every byte but the first is a target exactly once, as nanoGPT's
    consecutive windows predict it); a shorter tail is left out, so no window is padded."""
    step = max_len - 1
    return [text[i:i + max_len] for i in range(0, len(text) - step, step)
            if len(text) - i >= max_len]


def _root(root: str | None) -> Path:
    return Path(root) if root else stdlib_root()


def _check_stdlib_text(a: dict[str, Any], ctx: CheckContext) -> None:
    require(a["max_len"] >= 2, "data.max_len",
            "an integer >= 2 (a chunk needs one input and one target byte)", a["max_len"])
    require(a["max_bytes"] >= 1, "data.max_bytes", "an integer >= 1", a["max_bytes"])
    require(0.0 < a["eval_fraction"] < 1.0, "data.eval_fraction", "a number in (0, 1)",
            a["eval_fraction"])
    root = _root(a["root"])
    require(a["root"] != "" and root.is_dir(), "data.root",
            "null (the standard library) or a directory", a["root"])
    corpus = select(root, a["max_bytes"], a["eval_fraction"])
    if not corpus.train_files or not corpus.eval_files:
        raise ConfigError(f"data: the corpus under {root} within max_bytes={a['max_bytes']} has "
                          f"{len(corpus.train_files)} train and {len(corpus.eval_files)} eval "
                          "files; both need at least one (raise data.max_bytes or change "
                          "data.eval_fraction)")


def provenance(max_len: int = 256, max_bytes: int = 2_000_000, eval_fraction: float = 0.1,
               root: str | None = None, packed: bool = False) -> dict[str, Any]:
    """What run_info.json records of the corpus: where it came from, its SHA-256 and sizes."""
    corpus = select(_root(root), max_bytes, eval_fraction)
    return {"root": str(corpus.root), "sha256": corpus.sha256,
            "bytes": corpus.train_bytes + corpus.eval_bytes, "train_bytes": corpus.train_bytes,
            "eval_bytes": corpus.eval_bytes, "train_files": len(corpus.train_files),
            "eval_files": len(corpus.eval_files)}


@describes(provenance)
@checks(_check_stdlib_text)
@provides("vocab_size", "max_len", unit="tokens")
def stdlib_text(max_len: int = 256, max_bytes: int = 2_000_000, eval_fraction: float = 0.1,
                root: str | None = None, packed: bool = False) -> DataBundle:
    """Byte-level next-token prediction on the standard library's .py files (root: another
    directory of .py files instead); eval loss / ln 2 is bits per byte. packed: the split's
    files joined and cut into windows of exactly max_len bytes, as nanoGPT trains (no padding,
    a window may span two files); otherwise chunks cut at blank lines within each file."""
    corpus = select(_root(root), max_bytes, eval_fraction)

    def sequences(files: list[str]) -> list[torch.Tensor]:
        pieces = (windows(b"".join(corpus.text[f] for f in files), max_len) if packed else
                  [c for f in files for c in chunks(corpus.text[f], max_len)])
        return [torch.frombuffer(bytearray(c), dtype=torch.uint8).long() for c in pieces]

    return token_bundle(sequences(corpus.train_files), sequences(corpus.eval_files), VOCAB,
                        max_len)
