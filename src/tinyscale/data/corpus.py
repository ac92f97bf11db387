"""A byte-level text corpus that every Python install already has: the standard library's own source.

No download, no tokenizer: each byte is a token (VOCAB_SIZE = 256), so any machine with Python
can train the GPT on real text. The corpus is every `*.py` file under
`sysconfig.get_paths()["stdlib"]`, except those under `site-packages/`, `dist-packages/`,
`idlelib/`, any `tests/` directory, and the top-level `test/` package (the regression suite:
huge and full of deliberately odd code). Sub-packages' own `test/` folders (ctypes, unittest,
tkinter) are ordinary code and stay. Files are sorted by relative POSIX path and joined with a
single NUL byte (b"\\x00", which no source file contains), marking document boundaries the way
an end-of-text token does.

The split is by file, so no file straddles train and validation: a file is in validation when
`zlib.crc32(relative_path.encode()) % 100 < 5`. Hashing the path, not the file's rank in the
sorted list, keeps every other file where it was when a Python release adds or drops files.

The size depends on the Python version. Measured on CPython 3.11.7: 776 files, 12,545,615
bytes of source; train 717 files, 11,686,146 tokens; validation 59 files (7.6% of the files),
860,243 tokens (token counts include the separators). Loading takes well under a second.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import sysconfig
import zlib
from pathlib import Path

import torch

VOCAB_SIZE = 256  # one token per byte value
SEPARATOR = b"\x00"  # between files
VAL_PERCENT = 5  # a file is in validation when crc32(path) % 100 < VAL_PERCENT
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "tests", "idlelib"})


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """One split of the corpus. `tokens` is shared by every caller (cached): never modify it in place."""

    tokens: torch.Tensor = dataclasses.field(repr=False)  # (N,) torch.uint8: files joined by SEPARATOR
    files: tuple[str, ...] = dataclasses.field(repr=False)  # relative POSIX paths under root, in order
    root: str
    split: str  # "train" or "val"

    def __len__(self) -> int:
        return self.tokens.numel()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_val_file(relative_path: str) -> bool:
    """The split rule: a stable hash of the path, so it survives files being added or removed."""
    return zlib.crc32(relative_path.encode("utf-8")) % 100 < VAL_PERCENT


@functools.lru_cache(maxsize=1)
def _all_files() -> tuple[str, ...]:
    root = stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        if parts[0] == "test" or _EXCLUDED_DIRS.intersection(parts[:-1]) or not path.is_file():
            continue
        files.append(path.relative_to(root).as_posix())
    return tuple(sorted(files))


def stdlib_corpus(split: str = "train") -> Corpus:
    """The train or validation split, read once per process and then cached."""
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r} is not a corpus split: use 'train' or 'val'")
    return _load(split)


@functools.lru_cache(maxsize=None)  # keyed on the validated split alone: each is read once
def _load(split: str) -> Corpus:
    root = stdlib_root()
    files = tuple(f for f in _all_files() if is_val_file(f) == (split == "val"))
    if not files:
        raise ValueError(f"no Python sources found for split={split!r} under {root}: this Python install "
                         "has no standard-library sources; use synthetic_token_batches instead")
    data = SEPARATOR.join((root / f).read_bytes() for f in files)
    # bytearray: torch.frombuffer wants a writable buffer, and then the tensor owns its bytes.
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (N,)
    return Corpus(tokens=tokens, files=files, root=str(root), split=split)


def corpus_info() -> dict:
    """Where the corpus comes from and how big each split is (reads both splits)."""
    info: dict = {"root": str(stdlib_root()), "python": sys.version.split()[0]}
    for split in ("train", "val"):
        corpus = stdlib_corpus(split)
        info[split] = {"files": len(corpus.files), "bytes": len(corpus)}
    return info


def decode(ids: torch.Tensor) -> str:
    """Token ids back to text, for looking at samples (invalid UTF-8 shows as U+FFFD)."""
    return bytes(ids.flatten().to(torch.uint8).tolist()).decode("utf-8", errors="replace")


def sample_batches(tokens: torch.Tensor, *, num_batches: int, batch_size: int, seq_len: int,
                   seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random windows of the corpus as next-token batches: [(inputs, targets)], each (B, T) int64.

    Each row is seq_len + 1 consecutive tokens starting at an offset drawn from a CPU
    torch.Generator(seed); inputs are its first T tokens and targets its last T, so
    targets[:, t] is the token after inputs[:, t]. Same arguments, same batches.
    """
    for field, value in (("num_batches", num_batches), ("batch_size", batch_size), ("seq_len", seq_len)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"sample_batches {field}={value!r} is invalid: it must be a positive int")
    if tokens.dim() != 1:
        raise ValueError(f"tokens must be a 1-D tensor, got shape {tuple(tokens.shape)}: pass corpus.tokens")
    num_starts = tokens.numel() - seq_len  # a window starting at o needs o + seq_len + 1 <= N
    if num_starts < 1:
        raise ValueError(f"the corpus has {tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                         "use a shorter seq_len or a longer corpus")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    starts = torch.randint(0, num_starts, (num_batches, batch_size), generator=gen)  # (num_batches, B)
    offsets = starts[..., None] + torch.arange(seq_len + 1)  # (num_batches, B, T + 1)
    windows = tokens.cpu()[offsets].long()  # (num_batches, B, T + 1)
    # contiguous copies: collectives (broadcast, scatter) want dense tensors
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]  # (B, T) each
