"""Retrieval over search keys, below the decode caches: learned search projections and their losses,
exact / FAISS HNSW / FAISS IVF indexes, and Quest's page bounds. `attnlab.cache`, `attnlab.eval`,
`attnlab.search` and `attnlab.models` import them from here; this package imports only `ops` and
`checks`. FAISS is imported when an HNSW or IVF index is built."""

from .pages import quest_page_bounds, scalar_range_bound, scalar_term
from .projections import SearchProjections, check_projections, search_losses
from .retrieval import ExactIndex, HNSWIndex, block_starts, topk_candidates

__all__ = ["ExactIndex", "HNSWIndex", "SearchProjections", "block_starts", "check_projections", "quest_page_bounds",
           "scalar_range_bound", "scalar_term", "search_losses", "topk_candidates"]
