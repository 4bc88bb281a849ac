"""What benchmarks/decode_speed.py measures a decode step against: what the step must read (weights
and the cache entries its method reads) and the memory-bandwidth floor those bytes set (its
`bytes_per_step`, `floor_ms` and `x_floor`), and transformers' static-cache step on a same-shaped
Llama (`HFStatic`, its `hf_static` rows)."""

from __future__ import annotations

import math
import time

import torch

from attnlab.models.config import ModelConfig
from attnlab.models.lm import LM


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


PEAK_GBPS = (("H200", 4800.0), ("H100 NVL", 3900.0), ("H100 PCIe", 2000.0), ("H100", 3350.0),
             ("A100-PCIE", 1555.0), ("A100", 2039.0))  # HBM bandwidth from the data sheets, GB/s


def bandwidth(dev) -> tuple[float, str]:
    """GB/s for the floor: a known GPU's data-sheet peak, else a copy measured here (bytes read and
    written / seconds, best of 5), on the CPU with the threads the steps run with."""
    if dev.type == "cuda":
        name = torch.cuda.get_device_name()
        for key, gbps in PEAK_GBPS:
            if key in name:
                return gbps, f"data-sheet peak of {name}"
    x = torch.ones((1 << 28 if dev.type == "cuda" else 1 << 24) // 4, device=dev)  # 256 MiB / 16 MiB
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(5):
        sync(dev)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(dev)
        best = min(best, time.perf_counter() - t0)
    return round(2 * x.numel() * 4 / best / 1e9, 1), f"copy measured on {dev.type} ({torch.get_num_threads()} threads)"


def weight_bytes(model, emb, head, B: int) -> int:
    """Bytes of the weights one step reads: every parameter once, but of a token embedding emb untied
    from the output head's matrix only the B rows looked up (a tied one is the head's, read whole)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if head is emb else total - emb.numel() * emb.element_size() + B * emb.shape[1] * emb.element_size()


def step_bytes(m: LM, method: str, B: int, n: int, tail: int = 256) -> int:
    """What one step of `method` must read with n positions cached: the weights, and per layer and row
    the cache entries its rule reads. A head's entry: its group's vector key (hybrid, softmax), value
    and scalar key (4 bytes). exact: all n entries; window: the k + w keys read, the 2k + tail
    candidate scalar keys and two binary searches over n 8-byte codes; learned: all n search keys
    (d_search float32) and the K entries read, and the search projections' weights."""
    total = weight_bytes(m, m.tok_emb.weight, m.head.weight, B)
    for blk in m.blocks:
        a, es = blk.attn, next(m.parameters()).element_size()
        Hs, c = a.n_scalar, a.config
        k = 0 if a.mechanism == "scalar" else a.qk_dim * es  # per group / head
        v, groups = c.head_dim * es, a.value_groups if a.mechanism == "scalar" else a.n_kv
        if method.startswith("exact"):
            total += B * n * ((a.n_kv * k if k else 0) + groups * v + Hs * 4)
        elif method.startswith("window"):
            kw, w = c.options.train_window, c.options.local_window
            total += B * Hs * ((kw + w) * (k + v + 4) + (2 * kw + tail) * 4 + 2 * math.ceil(math.log2(max(n, 2))) * 8)
        elif method.startswith("learned"):
            K, d = c.options.train_window + c.options.local_window, 32  # learned_selector's K and d_search
            total += B * Hs * (n * d * 4 + K * (k + v + 4))
    if method.startswith("learned"):
        total += 2 * len(m.blocks) * m.cfg.d_model * 32 * m.blocks[0].attn.n_scalar * 4  # two maps per layer
    return total


def hf_step_bytes(model, B: int, n: int) -> int:
    """A Llama step's reads: its weights (`weight_bytes`) and every cached key and value of n positions."""
    c, es = model.config, next(model.parameters()).element_size()
    kv = 2 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * es
    weights = weight_bytes(model, model.model.embed_tokens.weight, model.lm_head.weight, B)
    return weights + c.num_hidden_layers * B * n * kv


class HFStatic:
    """A Llama of the model's dimensions through transformers' generate with a static cache: the time of
    one step is (t(1 + n new tokens) - t(1 new token)) / n after the same prompt."""

    def __init__(self, cfg: ModelConfig, idx: torch.Tensor, total: int):
        from transformers import LlamaConfig, LlamaForCausalLM

        hc = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.ffn_hidden,
                         num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                         num_key_value_heads=cfg.n_heads, max_position_embeddings=total + 8, tie_word_embeddings=False)
        hc._attn_implementation = "sdpa"
        self.model = LlamaForCausalLM(hc).to(idx.device).eval()
        self.idx = idx
        self.logits = None

    def time_steps(self, n: int) -> float:
        """Seconds per step of n steps (generate runs the prompt again each call)."""
        def run(k):
            sync(self.idx.device)
            t0 = time.perf_counter()
            self.model.generate(self.idx, max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                cache_implementation="static", pad_token_id=0)
            sync(self.idx.device)
            return time.perf_counter() - t0

        return (run(1 + n) - run(1)) / n
