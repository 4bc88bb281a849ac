"""Hugging Face text corpora through `datasets.load_dataset`: TinyStories, WikiText-103, any
dataset with a text column.

`path` is a hub id (needs network) or anything else `load_dataset` accepts: a local copy
of the dataset repository (same files, same layout), or a builder name such as "parquet",
"json" or "text" together with `data_files`. The tests use local copies, so the code that
reads the hub is the code they run. `datasets` is imported only when one of these is called.

Splits are attnlab's names: "train", "val" (the dataset's "validation") and "test".
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Iterable, Iterator

from ..checks import check_choice
from .splits import SPLITS

TINYSTORIES = "roneneldan/TinyStories"
WIKITEXT = "Salesforce/wikitext"
WIKITEXT103_RAW = "wikitext-103-raw-v1"
HF_SPLIT = {"train": "train", "val": "validation", "test": "test"}
_BATCH = 1024


def _datasets():
    try:
        import datasets
    except ImportError as e:  # an optional dependency (extra "hf")
        raise ImportError("Hugging Face corpora need the `datasets` package: pip install 'attnlab[hf]'") from e
    return datasets


def hf_texts(
    path: str,
    name: str | None = None,
    *,
    split: str,
    text_field: str = "text",
    data_files=None,
    cache_dir: str | os.PathLike | None = None,
    streaming: bool = False,
) -> Iterator[str]:
    """The `text_field` column of one split of a dataset, row by row, in stored order.

    `split` is passed to `load_dataset` unchanged (a Hugging Face split name)."""
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(
            path,
            name,
            split=split,
            data_files=data_files,
            cache_dir=None if cache_dir is None else str(cache_dir),
            streaming=streaming,
        )
    except ValueError as e:
        if "split" in str(e).lower():
            raise ValueError(f"split {split!r} is not in dataset {path!r} (config {name!r}): {e}") from e
        raise
    columns = ds.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"text_field must name a column of {path!r}, got {text_field!r}; columns: {columns}")
    for batch in ds.iter(batch_size=_BATCH):
        if text_field not in batch:
            raise ValueError(f"text_field must name a column of {path!r}, got {text_field!r}; columns: {list(batch)}")
        yield from batch[text_field]


def _take(rows: Iterable[str], max_docs: int | None) -> list[str]:
    out = []
    for row in rows:
        out.append(row)
        if max_docs is not None and len(out) >= max_docs:
            break
    return out


def hf_corpus(
    path: str,
    name: str | None = None,
    *,
    split: str = "train",
    text_field: str = "text",
    data_files=None,
    cache_dir: str | os.PathLike | None = None,
    max_docs: int | None = None,
) -> list[str]:
    """One document per row of a dataset's `split` ("train" | "val" | "test"); streams
    (downloads only what it reads) when `max_docs` is given."""
    check_choice("split", split, SPLITS)
    rows = hf_texts(
        path, name, split=HF_SPLIT[split], text_field=text_field, data_files=data_files,
        cache_dir=cache_dir, streaming=max_docs is not None,
    )
    return [r for r in _take(rows, max_docs) if r]


def _half_of(text: str) -> str:
    """"val" or "test" for a TinyStories validation story, by the parity of sha256(text)."""
    return "val" if hashlib.sha256(text.encode("utf-8")).digest()[0] % 2 == 0 else "test"


def tinystories(
    split: str = "train",
    *,
    path: str = TINYSTORIES,
    data_files=None,
    cache_dir: str | os.PathLike | None = None,
    max_docs: int | None = None,
) -> list[str]:
    """TinyStories (roneneldan/TinyStories), one story per document.

    The dataset has only train and validation splits: "val" and "test" are the two halves
    of its validation split, a story going to "val" when the first byte of sha256 of its
    text is even. With `max_docs`, "val"/"test" return at most that many of the first
    `max_docs` validation stories."""
    check_choice("split", split, SPLITS)
    rows = hf_texts(
        path, None, split="train" if split == "train" else "validation", data_files=data_files,
        cache_dir=cache_dir, streaming=max_docs is not None,
    )
    stories = [s for s in _take(rows, max_docs) if s and s.strip()]
    if split == "train":
        return stories
    return [s for s in stories if _half_of(s) == split]


_TITLE = re.compile(r"^ = [^=].* = $")


def wikitext_articles(lines: Iterable[str]) -> Iterator[str]:
    """Group WikiText rows (one line each, headings written " = Title = ") into articles:
    a new article starts at each top-level heading. An empty row is a blank line; blank
    lines before an article's heading and after its last line are dropped."""
    buf: list[str] = []
    for line in lines:
        if _TITLE.match(line.rstrip("\n")) and buf:
            yield "".join(buf).rstrip("\n") + "\n"
            buf = []
        if buf or line.strip():
            buf.append(line or "\n")
    if buf:
        yield "".join(buf).rstrip("\n") + "\n"


def wikitext103(
    split: str = "train",
    *,
    path: str = WIKITEXT,
    name: str | None = WIKITEXT103_RAW,
    data_files=None,
    cache_dir: str | os.PathLike | None = None,
    max_docs: int | None = None,
) -> list[str]:
    """WikiText-103 raw (Salesforce/wikitext, config wikitext-103-raw-v1), one Wikipedia
    article per document, rebuilt from the dataset's one-line rows."""
    check_choice("split", split, SPLITS)
    rows = hf_texts(
        path, name, split=HF_SPLIT[split], data_files=data_files,
        cache_dir=cache_dir, streaming=max_docs is not None,
    )
    return _take(wikitext_articles(rows), max_docs)
