"""The spelling of the index options in a selector's configuration: each prefixed by the index it
belongs to (`hnsw_ef_search`, `ivf_nlist`, `ivf_nprobe`, ...), since one configuration holds the
options of every index side by side (`attnlab.cache.selected.DecodeSelector`,
`attnlab.search.SelectorConfig`, the search commands). The index classes themselves keep the short
names of their own arguments (`IVFIndex(dim, nlist, nprobe)`).

The short names were also a selector's spelling once; TOML tables and the command line still take
them (`respell`).
"""

from __future__ import annotations

OLD_SPELLINGS = {"ef_construction": "hnsw_ef_construction", "ef_search": "hnsw_ef_search", "nlist": "ivf_nlist",
                 "nprobe": "ivf_nprobe", "train_at": "ivf_train_at"}  # older spelling -> the one spelling


def respell(table: dict, names, where: str = "") -> dict:
    """`table` (a TOML table or parsed options) with each older spelling of an option that `names`
    (a config's field names) spells the new way renamed to it; other keys are left as they are.

    Raises:
        ValueError: the table gives an option in both spellings, naming both keys (`where` their prefix).
    """
    out = dict(table)
    for old, new in OLD_SPELLINGS.items():
        if old in out and new in names and old not in names:
            if new in out:
                raise ValueError(f"{where}{old} and {where}{new} are one option ({old} is its older spelling); "
                                 f"give {where}{new} only")
            out[new] = out.pop(old)
    return out
