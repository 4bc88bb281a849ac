"""Decode-step cost and memory of retrieve-then-attend vs full attention, and the training cost per layer.

Decode (one query token at context N; SmolLM2-135M shapes: 9 query / 3 KV heads, head dim 64,
d_search 128, random vectors): full attention over N keys; learned exact top-K (N dot products in
d_search per candidate set; learned_exact16 with the search keys in fp16), learned FAISS HNSW
(learned_hnsw16: the graph's vectors in fp16, FAISS's fp16 scalar quantizer) and
learned FAISS IVF-flat (N / 128 lists, 1 in 16 probed, centroids learned on the first 16 keys per
list), each followed by exact attention over the K candidates; native HNSW (the model's own q/k in
the index); Quest page selection. A decode step also adds the new token's key to the index:
*_add_ms is the mean insertion cost per key while the index grows to N (HNSW insertion searches
the graph too; Quest updates one page's bounds; the exact index and Quest are timed one key per
add over the last 64 keys, as a decoder adds them), to be added to the search time; *_recall is
the share of the exact top-K an approximate index returns on these random vectors (the hardest
case for a partitioned index: trained keys cluster, random ones do not). Quest keeps its page bounds as keys arrive (`QuestIndex`), so a step reads
N / page bounds, not N keys. Medians of interleaved rounds with each method's ratio to full
attention taken within a round, and the memory each method keeps beside the KV cache (the
search keys, the HNSW graph, Quest's page bounds). The scoring-cost proxies of the seed (full
N*d_h, Quest N/P*2*d_h, HNSW M*ef*log2(N)*d_search) are listed too.

Training (--train): one layer's step (teacher from captured q/k, both losses, backward) on one
context of T tokens, every query row against --query-rows subsets.

    python benchmarks/search.py --ns 2048 8192 32768 --K 256 --groups 3 --out benchmarks/results/search_decode.json
    python benchmarks/search.py --train --T 2048 --query-rows 0 512 256 --out benchmarks/results/search_train.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleaved import interleaved, ratios, write_json  # noqa: E402

from attnlab.search.capture import Captured  # noqa: E402
from attnlab.index.ivf import IVFIndex  # noqa: E402
from attnlab.index.projections import SearchProjections  # noqa: E402
from attnlab.search.quest import QuestIndex  # noqa: E402
from attnlab.search.retrieval import ExactIndex, HNSWIndex, native_vectors  # noqa: E402
from attnlab.search.sparse import sparse_attention  # noqa: E402
from attnlab.search.train import query_rows, step_losses  # noqa: E402

SHAPES = dict(H=9, Hkv=3, D=64, ds=128, d_model=576)


def _hnsw_bytes(index: HNSWIndex) -> int:
    """Serialised size of every graph the index holds (vectors + links)."""
    import faiss

    return sum(int(faiss.serialize_index(g).size) for row in index.rows for g in row.values())


def decode_row(N: int, K: int, rounds: int, groups: int = 1, M: int = 32, ef: int = 128, page: int = 16) -> dict:
    H, Hkv, D, ds = SHAPES["H"], SHAPES["Hkv"], SHAPES["D"], SHAPES["ds"]
    g = torch.Generator().manual_seed(N)
    k, v = torch.randn(1, Hkv, N, D, generator=g), torch.randn(1, Hkv, N, D, generator=g)
    q = torch.randn(1, H, 1, D, generator=g)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    ks, qs = unit(torch.randn(1, groups, N, ds, generator=g)), unit(torch.randn(1, groups, 1, ds, generator=g))
    qn, kn = native_vectors(q, k, groups)
    allowed = torch.ones(1, 1, 1, N, dtype=torch.bool)
    exact, exact16 = ExactIndex(), ExactIndex(torch.float16)
    hnsw, native = HNSWIndex(ds, M, 64, ef), HNSWIndex(kn.shape[-1], M, 64, ef)
    hnsw16 = HNSWIndex(ds, M, 64, ef, dtype=torch.float16)
    nlist = max(16, N // 128)
    first = min(N, 16 * nlist)
    ivf = IVFIndex(ds, nlist, max(1, nlist // 16), train_at=first)
    quest = QuestIndex(page)
    add_ms = {}
    for name, index, keys in (("learned_hnsw", hnsw, ks), ("learned_hnsw16", hnsw16, ks), ("native_hnsw", native, kn)):
        t = time.perf_counter()
        index.add(keys)
        add_ms[name] = 1e3 * (time.perf_counter() - t) / N  # mean insertion cost per key while growing to N
    t = time.perf_counter()
    ivf.add(ks[:, :, :first])
    ivf_train_s = time.perf_counter() - t  # k-means once, on the first keys
    t = time.perf_counter()
    if N > first:
        ivf.add(ks[:, :, first:])
    add_ms["learned_ivf"] = 1e3 * (time.perf_counter() - t) / max(1, N - first)
    tail = min(N, 64)  # a bulk add costs less per key than a decoder's one key per step; time the latter
    for name, index, keys in (("learned_exact", exact, ks), ("learned_exact16", exact16, ks), ("quest", quest, k)):
        index.add(keys[:, :, : N - tail])
        t = time.perf_counter()
        for i in range(N - tail, N):
            index.add(keys[:, :, i:i + 1])
        add_ms[name] = 1e3 * (time.perf_counter() - t) / tail
    top, _ = exact.search(qs, allowed, K)
    recall = {name: (ix.search(qs, allowed, K)[0][..., :, None] == top[..., None, :]).any(-1).float().mean().item()
              for name, ix in (("learned_hnsw", hnsw), ("learned_hnsw16", hnsw16), ("learned_ivf", ivf),
                               ("learned_exact16", exact16))}
    scale = D ** -0.5

    def attend(select):
        idx, valid = select()
        return sparse_attention(q, k, v, idx, valid, scale)

    cases = {  # full attention reads the KV heads in place (grouped-query SDPA), as a decoder would
        "full": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        "learned_exact": lambda: attend(lambda: exact.search(qs, allowed, K)),
        "learned_exact16": lambda: attend(lambda: exact16.search(qs, allowed, K)),
        "learned_hnsw": lambda: attend(lambda: hnsw.search(qs, allowed, K)),
        "learned_hnsw16": lambda: attend(lambda: hnsw16.search(qs, allowed, K)),
        "learned_ivf": lambda: attend(lambda: ivf.search(qs, allowed, K)),
        "native_hnsw": lambda: attend(lambda: native.search(qn, allowed, K)),
        "quest": lambda: attend(lambda: quest.select(q, allowed, scale, K, groups)),
    }
    r = ratios(interleaved(cases, rounds), "full")
    n_pages = math.ceil(N / page)
    return {"N": N, "K": K, "groups": groups,
            **{f"{name}_ms": 1e3 * s["median_s"] for name, s in r.items()},
            **{f"{name}_x_full": s["median_ratio"] for name, s in r.items() if name != "full"},
            **{f"{name}_add_ms": t for name, t in add_ms.items()},
            **{f"{name}_recall": r for name, r in recall.items()},
            "ivf_nlist": nlist, "ivf_nprobe": ivf.nprobe, "ivf_train_s": ivf_train_s,
            "kv_cache_mb": 2 * Hkv * N * D * 4 / 2 ** 20,
            "learned_exact_mb": exact.keys.numel() * 4 / 2 ** 20,
            "learned_exact16_mb": exact16.keys.numel() * 2 / 2 ** 20,
            "learned_ivf_mb": (ks.numel() * 4 + groups * nlist * ds * 4 + ks[..., 0].numel() * 8) / 2 ** 20,
            "learned_hnsw_mb": _hnsw_bytes(hnsw) / 2 ** 20,
            "learned_hnsw16_mb": _hnsw_bytes(hnsw16) / 2 ** 20,
            "native_hnsw_mb": _hnsw_bytes(native) / 2 ** 20,
            "quest_mb": 2 * Hkv * n_pages * D * 4 / 2 ** 20,
            "proxy_full": N * D, "proxy_quest": N / page * 2 * D, "proxy_hnsw": M * ef * math.log2(N) * ds}


def train_rows(T: int, rows_list: list[int], rounds: int, groups: int = 3) -> list[dict]:
    H, Hkv, D, C, ds = SHAPES["H"], SHAPES["Hkv"], SHAPES["D"], SHAPES["d_model"], SHAPES["ds"]
    g = torch.Generator().manual_seed(T)
    caps = {0: Captured(torch.randn(1, T, C, generator=g), torch.randn(1, H, T, D, generator=g),
                        torch.randn(1, Hkv, T, D, generator=g), D ** -0.5)}
    seg = torch.zeros(1, T, dtype=torch.long)
    proj = SearchProjections([0], C, ds, groups=groups, rope=True)

    def step(n):
        def f():
            rows = query_rows(T, n, 0, 0)
            nce, kl, _ = step_losses(proj, caps, seg, 16, rows=rows)
            proj.zero_grad(set_to_none=True)
            (nce + kl).backward()
        return f

    cases = {f"rows={n or T}": step(n) for n in rows_list}
    r = ratios(interleaved(cases, rounds), next(iter(cases)))
    return [{"T": T, "query_rows": n or T, "groups": groups, "step_s": r[name]["median_s"],
             "x_first": r[name]["median_ratio"], "teacher_mb": (n or T) * T * groups * 4 / 2 ** 20}
            for n, name in zip(rows_list, cases)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--groups", type=int, default=1, help="candidate sets per token (3: one per KV head)")
    ap.add_argument("--train", action="store_true", help="time one layer's training step instead")
    ap.add_argument("--T", type=int, default=2048, help="--train: context length")
    ap.add_argument("--query-rows", type=int, nargs="+", default=[0, 512, 256], help="--train: 0 = every row")
    ap.add_argument("--threads", type=int, default=0, help="torch and FAISS threads (0: leave the defaults)")
    ap.add_argument("--out", default="bench_search.json")
    args = ap.parse_args(argv)
    if args.threads:
        import faiss

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)  # FAISS runs its own OpenMP pool
    if args.train:
        rows = train_rows(args.T, args.query_rows, args.rounds, args.groups)
    else:
        rows = [decode_row(N, args.K, args.rounds, args.groups) for N in args.ns]
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    write_json(args.out, {"kind": "train" if args.train else "decode", "rounds": args.rounds,
                          "threads": torch.get_num_threads(), "shapes": SHAPES, "rows": rows})


if __name__ == "__main__":
    main()
