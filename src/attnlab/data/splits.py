"""Corpus splits: their names and the hash rule that assigns a file to one.

A file's split is decided by the first 8 bytes of sha256 of its path relative to the corpus
folder (POSIX separators), taken as a big-endian integer modulo 100: 0-1 -> "test",
2-3 -> "val", 4-99 -> "train" (96/2/2 %). The split depends on nothing but the path.
"""

from __future__ import annotations

import hashlib

SPLITS = ("train", "val", "test")
FILE_SPLITS = SPLITS + ("all",)
SPLIT_PERCENT = {"test": 2, "val": 2, "train": 96}


def split_of(relpath: str) -> str:
    """The split ("train" | "val" | "test") of a file given its relative POSIX path."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big") % 100
    if bucket < SPLIT_PERCENT["test"]:
        return "test"
    if bucket < SPLIT_PERCENT["test"] + SPLIT_PERCENT["val"]:
        return "val"
    return "train"
