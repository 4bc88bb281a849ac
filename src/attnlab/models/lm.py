"""A small decoder-only language model whose attention in each layer is any attnlab mechanism.

    tokens -> embedding (+ optional learned positions)
           -> n_layers x [ x + Attention(RMSNorm(x)) ; x + SwiGLU(RMSNorm(x)) ]
           -> RMSNorm -> linear head (optionally tied to the embedding) -> logits

Position. Dot-product parts of a layer (softmax heads, the q.k term of hybrid heads,
principled heads) get RoPE, applied inside `attnlab.layers.Attention`. Scalar heads get
no rotary position: a scalar query/key has no plane to rotate, and a position term
would break the property the mechanism exists for: the kernel depends on qs - ks alone,
so keys sorted by value stay sorted and decode can binary-search them (the docstring of
`attnlab.layers.attention`, "Position", says the same from the layer's side). They
see position only through the causal mask and through what the residual stream
carries, which a causal stack can compute (a token can count its predecessors by
attending uniformly). The linear family is causal by construction, and GLA/SSD decays
are recency weights. `pos_embedding="learned"` adds absolute positions to the token
embedding for models that want explicit position everywhere (it caps the length at
`max_seq_len`).

Documents. When attention must not cross document boundaries (`data.pack = "documents"`),
the model is given the per-token document ids of each packed sequence, `forward(...,
doc_ids=...)`, and restarts at every boundary, equal to running each document alone. Where
every layer's op keeps documents apart itself (`takes_documents`: the ops' `docs` argument, taken by
softmax heads with every scaling and window, gla, ssd, cosformer, goat and goat_hybrid, and
scalar, hybrid and principled heads that read every key of their document, on every path), the
packed sequence runs as it is, RoPE positions counted from each document's first token: one pass,
static shapes, no host sync. Otherwise (learned positions, scalar heads with a sink, a trained or
decode window, principled heads with a sliding window) each row is cut into its document
segments, the segments run as a batch of their own (right-padded; padding comes after every
real token so causal attention never reads it) and the outputs go back in place: every
mechanism keeps its fast path and recurrent states start afresh, at the price of the segment
lengths read on the host.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from attnlab.checks import async_value_checks, check_output_finite, set_model_boundary
from attnlab.ops.common.precision import upcast

from .blocks import Block, RMSNorm, SwiGLU  # noqa: F401  (RMSNorm, SwiGLU: attnlab.models exports them from here)
from .config import ModelConfig
from .decode import DecodeOptions, DecodeState, key_rule_of
from .sampling import check_sampling, next_token
from .decode import selectable_layers  # noqa: F401  (attnlab.eval and attnlab.retrofit import it from here)


def document_segments(doc_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Cut each row of doc_ids (B, T) where the id changes. Returns, for every token in
    row-major order, its segment index and its position inside the segment, and the
    number of segments S (a segment never spans two rows)."""
    B, T = doc_ids.shape
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = start.flatten()  # (B*T,)
    seg = start.long().cumsum(0) - 1  # (B*T,)
    first = start.nonzero().squeeze(1)  # (S,) flat index of each segment's first token
    pos = torch.arange(B * T, device=doc_ids.device) - first[seg]  # (B*T,)
    return seg, pos, int(first.numel())


def token_loss(logits: torch.Tensor, targets: torch.Tensor, num_items_in_batch=None,
               reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (B, T, V) against targets (B, T), positions with target -100 left out,
    computed in >= float32: the mean over the counted positions, or, given num_items_in_batch (an int
    or a tensor; transformers' Trainer passes it under gradient accumulation), their sum divided by it;
    reduction "sum" (their sum) or "none" (every position's, (B*T,), 0 where left out). The loss of
    `LM.forward` and of `attnlab.hf`'s forward (with the labels shifted there), and what evaluation,
    retrofit fine-tuning and search's perplexity score."""
    lg = logits.to(upcast(logits.dtype)).flatten(0, 1)  # (B*T, V)
    if reduction != "mean":
        return F.cross_entropy(lg, targets.flatten(), ignore_index=-100, reduction=reduction)
    if num_items_in_batch is None:
        return F.cross_entropy(lg, targets.flatten(), ignore_index=-100)
    total = F.cross_entropy(lg, targets.flatten(), ignore_index=-100, reduction="sum")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class LM(nn.Module):
    """Decoder-only LM: token embedding, `n_layers` pre-norm blocks (RMSNorm, the layer's attention,
    RMSNorm, SwiGLU), a final RMSNorm and the output head (tied to the embedding by default).

    Each block's attention is `attnlab.layers.Attention` for the mechanism `cfg.layer_attn[i]`, built
    from `cfg.attention_configs()`. `forward(idx, targets=None, record=False, doc_ids=None)` maps
    idx (B, T) int64 to (logits (B, T, V), loss or None); `make_caches`, `prefill`, `step` and
    `generate` decode. Raises ValueError when cfg.vocab_size is not resolved (0) or a learned
    position table has no max_seq_len.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size < 1:
            raise ValueError(f"model.vocab_size must be resolved to >= 1 before building the model, got {cfg.vocab_size}")
        if cfg.pos_embedding == "learned" and cfg.max_seq_len < 1:
            raise ValueError("model.max_seq_len must be >= 1 with pos_embedding='learned'")
        self.cfg = cfg
        # recompute each block's activations in the backward pass (train.checkpoint_activations; the HF
        # wrapper's gradient_checkpointing_enable): training forwards that record nothing
        self.gradient_checkpointing = False
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos_embedding == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg, a) for a in cfg.attention_configs())
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def _init_weights(self) -> None:
        """Normal(0, init_std) for embeddings and the MLP, the MLP's output projection scaled
        by 1/sqrt(2 n_layers) (GPT-2) so the residual stream does not grow with depth.
        Attention layers keep their own init (their gates, τ and sink have meaningful starts)."""
        std = self.cfg.init_std
        for emb in (self.tok_emb, self.pos_emb, self.head):
            if emb is not None:
                nn.init.normal_(emb.weight, std=std)
        for blk in self.blocks:
            nn.init.normal_(blk.mlp.w1.weight, std=std)
            nn.init.normal_(blk.mlp.w3.weight, std=std)
            nn.init.normal_(blk.mlp.w2.weight, std=std / math.sqrt(2 * self.cfg.n_layers))

    def attention_layers(self) -> list:
        """The attention layer of every block, in order."""
        return [blk.attn for blk in self.blocks]

    def num_params(self) -> int:
        """Number of parameters (a tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """idx (B, T) -> token embeddings (B, T, C), plus the learned position embedding of
        positions start_pos .. start_pos + T - 1 when the model has one (ValueError past
        model.max_seq_len)."""
        x = self.tok_emb(idx)  # (B, T) -> (B, T, C)
        if self.pos_emb is not None:
            T = idx.shape[1]
            if start_pos + T > self.cfg.max_seq_len:
                raise ValueError(
                    f"idx reaches position {start_pos + T} but the learned position embedding holds "
                    f"model.max_seq_len={self.cfg.max_seq_len}"
                )
            x = x + self.pos_emb(torch.arange(start_pos, start_pos + T, device=idx.device))
        return x

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        record: bool = False,
        doc_ids: torch.Tensor | None = None,
        key_rules: dict | None = None,
    ):
        """idx (B, T) int64 -> logits (B, T, V); loss is mean cross-entropy over targets != -100.

        With record=True every attention layer keeps `layer.last` for the regularizers.
        With doc_ids (B, T), attention restarts at every change of document id. key_rules: {block
        index: `attnlab.cache.options.KeyRule`}, the keys each scalar/hybrid layer named reads; None:
        the rules of the enclosing `decode_window` / `select_keys` block (`layer_rules`)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        rules = self.layer_rules(key_rules)
        if doc_ids is not None:
            if doc_ids.shape != idx.shape:
                raise ValueError(f"doc_ids must have the shape of idx {tuple(idx.shape)}, got {tuple(doc_ids.shape)}")
        # Every layer and op checks its inputs' values (the input policy); eagerly as device-side asserts on
        # accelerators, no host sync per check (the logits' too). Under torch.compile the layers' checks stay
        # out of the graph and one assert at the end stands for them (checks.set_model_boundary).
        compiling = torch.compiler.is_compiling()
        before = set_model_boundary(True) if compiling else False
        try:
            with nullcontext() if compiling else async_value_checks():
                x = self._layers(idx, record, doc_ids, rules)
                logits = self.head(h := self.norm_f(x))  # (B, T, V)
                if not compiling:
                    check_output_finite("logits", logits, self)  # what no layer input shows: the last MLP, norm_f, head
        finally:
            if compiling:
                set_model_boundary(before)
        loss = None
        if targets is not None:
            if targets.shape != idx.shape:
                raise ValueError(f"targets must have the shape of idx {tuple(idx.shape)}, got {tuple(targets.shape)}")
            loss = token_loss(logits, targets)
        if compiling:  # for the logits: h, every parameter, the loss (inf on overflow; NaN alone: no target counted)
            seen = () if loss is None else (loss.nan_to_num(nan=0.0, posinf=math.inf, neginf=-math.inf),)
            check_output_finite("logits", logits, self, compiled_stand_in=(h, *seen))
        return logits, loss

    def layer_rules(self, key_rules: dict | None = None) -> list:
        """Each block's KeyRule or None: key_rules' (block index -> KeyRule) when given, else what the
        enclosing `decode_window` / `select_keys` block gives the block's layer (`decode.key_rule_of`)."""
        if key_rules is None:
            return [key_rule_of(blk.attn) for blk in self.blocks]
        n = len(self.blocks)
        if not isinstance(key_rules, dict) or not all(isinstance(i, int) and 0 <= i < n for i in key_rules):
            raise ValueError(f"key_rules must map block indices 0..{n - 1} to KeyRules, got {key_rules!r}")
        return [key_rules.get(i) for i in range(n)]

    def _layers(self, idx: torch.Tensor, record: bool, doc_ids: torch.Tensor | None, rules: list) -> torch.Tensor:
        ruled = any(rule is not None for rule in rules)  # a layer under a key rule takes no packed documents
        if doc_ids is not None and not ruled and self.takes_documents(idx.device):
            return self._trunk(idx, record, rules, docs=doc_ids)  # every layer keeps the documents apart in one pass
        if doc_ids is not None and torch.compiler.is_compiling():
            raise ValueError(f"doc_ids: packed documents under torch.compile need every layer to keep documents "
                             f"apart inside its op (takes_documents); {self.not_taking(idx.device, rules)} re-pads them "
                             f"into single documents, which needs their lengths on the host: train it without "
                             f"compile (train.compile=false) or with data.pack='stream'")
        if doc_ids is not None:
            seg, pos, n_seg = document_segments(doc_ids)
            L = int(pos.max()) + 1
            packed = idx.new_zeros(n_seg, L)  # (S, L): one document segment per row
            packed[seg, pos] = idx.flatten()
            h = self._trunk(packed, record, rules)  # (S, L, C)
            return h[seg, pos].view(*idx.shape, -1)  # (B, T, C)
        return self._trunk(idx, record, rules)  # (B, T, C)

    def not_taking(self, device: torch.device, rules: list | None = None) -> str:
        """What keeps this model from taking packed documents as they are on `device` (and each block's
        KeyRule or None, `layer_rules`: a layer under a rule takes none)."""
        if self.pos_emb is not None:
            return "the learned position embedding"
        rules = [None] * len(self.blocks) if rules is None else rules
        names = [f"layer {i} ({blk.attn.mechanism})" for i, (blk, rule) in enumerate(zip(self.blocks, rules))
                 if rule is not None or not blk.attn.takes_documents(device)]
        return ", ".join(names)

    def takes_documents(self, device: torch.device) -> bool:
        """Whether packed documents run as they are on `device`, each layer keeping documents apart
        inside its op (`Attention.takes_documents`: the ops' docs argument), rather than re-padded into
        a batch of single documents (which needs the segment lengths on the host: a sync per step)."""
        return self.pos_emb is None and all(blk.attn.takes_documents(device) for blk in self.blocks)

    def _trunk(self, idx: torch.Tensor, record: bool, rules: list, docs: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, C)
        recompute = self.gradient_checkpointing and self.training and not record and torch.is_grad_enabled()
        for blk, rule in zip(self.blocks, rules):
            if recompute:  # the block's activations are recomputed in the backward pass, not kept
                x = torch.utils.checkpoint.checkpoint(blk, x, False, docs, rule, use_reentrant=False)
            else:
                x = blk(x, record=record, docs=docs, key_rule=rule)
        return x

    # ------------------------------------------------------------------ decoding

    def make_caches(self, batch_size: int, window: int | None = None, budget: int | None = None,
                    compress: float | None = None, exact: bool = False, selector=None, *,
                    options: DecodeOptions | None = None) -> list:
        """One decode cache per layer. window=k makes layers with scalar heads (scalar, hybrid)
        use the sorted scalar cache over the k nearest keys; other layers keep their exact cache.
        budget=M (with window) caps each sorted cache at M keys per head (evicted after each step);
        compress=s (with window) merges runs of 4 keys spanning <= s after each step. Layers trained
        through a window (`train_window`) decode through it by default; exact=True reads every key.
        selector: an `attnlab.cache.selected.DecodeSelector`: scalar/hybrid layers read the K keys
        their learned search projections find (no window then). options: a `DecodeOptions` in place
        of these keywords. The options are checked against this model (`DecodeOptions.check`)."""
        if options is None:
            options = DecodeOptions(window=window, budget=budget, compress=compress, exact=exact, selector=selector)
        elif not isinstance(options, DecodeOptions):
            raise TypeError(f"options must be a DecodeOptions, got {type(options).__name__}")
        elif exact is not False or any(v is not None for v in (window, budget, compress, selector)):
            raise TypeError("give the decode options as keywords or as options=DecodeOptions(...), not both")
        selected = options.check(self)
        exact = options.exact or options.selector is not None  # a selector reads the exact caches' keys
        caches = []
        for blk in self.blocks:
            scalar = bool(blk.attn.n_scalar)  # only layers with scalar heads take the sorted cache's options
            caches.append(blk.attn.make_cache(batch_size, window=options.window if scalar else None,
                                              budget=options.budget if scalar else None,
                                              compress=options.compress if scalar else None, exact=exact and scalar))
        for i, layer in selected:
            layer.attach_selector(caches[i], options.selector, i)
        return caches

    def step(self, idx_t: torch.Tensor, caches: list, pos: int) -> torch.Tensor:
        """One decode step: idx_t (B, 1) at position `pos` -> logits (B, V)."""
        x = self.embed(idx_t, start_pos=pos)  # (B, 1, C)
        for blk, cache in zip(self.blocks, caches):
            x = blk.step(x, cache)
        return self.head(self.norm_f(x))[:, -1]  # (B, V)

    def prefill(self, idx: torch.Tensor, caches: list, last: int | None = None) -> torch.Tensor:
        """T tokens at once: idx (B, T), at the positions after what `caches` hold (pos = caches[0].pos),
        -> logits (B, T, V), or of the `last` positions only (B, last, V). One parallel forward per
        layer that also fills its cache; equals T calls of `step` (tested for every mechanism)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (B, T), got shape {tuple(idx.shape)}")
        if len(caches) != len(self.blocks):
            raise ValueError(f"caches must hold one cache per layer ({len(self.blocks)}), got {len(caches)}")
        x = self.embed(idx, start_pos=caches[0].pos)  # (B, T, C)
        for blk, cache in zip(self.blocks, caches):
            x = blk.prefill(x, cache)
        if last is not None:
            x = x[:, x.shape[1] - last:]
        return self.head(self.norm_f(x))  # (B, T, V)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        greedy: bool = True,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        window: int | None = None,
        selector=None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        compile: bool = False,
    ) -> torch.Tensor:
        """Extend idx (B, T0) by max_new_tokens: the prompt goes through every layer in one parallel
        forward that fills its decode cache (`prefill`), then one `step` per new token.

        greedy=True takes the argmax; otherwise samples from softmax(logits / temperature), keeping
        only the top_k most likely tokens and the smallest set whose probability reaches top_p when given
        (`attnlab.models.sampling`).
        window=k decodes scalar/hybrid layers from the sorted scalar cache over the k nearest keys
        (the prompt's readout is the windowed op, which equals stepping that cache); selector (an
        `attnlab.cache.selected.DecodeSelector`) decodes them through learned key selection instead
        (both checked as `DecodeOptions`). attention_mask (B, T0) of 0/1, left padding only: each
        row starts at its first 1 and decodes as if alone (positions from 0, no pad in any cache or
        state); see `DecodeState`. compile=True decodes through static buffers and a compiled step
        (`attnlab.models.static_decode.StaticDecoder`, kept for the next call of the same batch size
        and length; CUDA graphs on the GPU), reading what this method reads: every key, a trained
        window (`train_window`) through it, or window=k's nearest keys; every shipped mechanism, no
        selector (give `StaticDecoder` one) or attention_mask."""
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"idx must be (B, T0) with T0 >= 1, got shape {tuple(idx.shape)}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        check_sampling(greedy, temperature, top_k, top_p)
        if compile:
            if selector is not None or attention_mask is not None:
                raise ValueError("compile=True decodes through static buffers: give no selector (pass it to a "
                                 "StaticDecoder) or attention_mask")
            dec = self.static_decoder(idx.shape[0], idx.shape[1] + max_new_tokens, window)
            feed = lambda x: dec.step(x)[:, None]  # noqa: E731
        else:
            state = DecodeState(self, idx.shape[0], DecodeOptions(window=window, selector=selector))
            feed = state.feed
        was_training = self.training
        self.eval()
        out = idx
        logits = dec.prefill(idx) if compile else state.feed(idx, attention_mask, last=1)[:, -1]  # (B, V)
        for i in range(max_new_tokens):
            nxt = next_token(logits, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                             generator=generator)  # (B, 1)
            out = torch.cat([out, nxt], dim=1)
            if i + 1 < max_new_tokens:
                logits = feed(nxt)[:, -1]
        self.train(was_training)
        return out

    def __getstate__(self):  # pickling and deepcopy leave the compiled decoder behind
        state = dict(super().__getstate__())
        state.pop("_static", None)
        return state

    def static_decoder(self, batch_size: int, max_len: int, window: int | None = None):
        """A compiled `StaticDecoder` of this model for batch_size rows and max_len positions (and a
        decode window): the one made for the last call when it fits (same batch size and window, as
        many positions or more), else a new one."""
        from .static_decode import StaticDecoder

        dec = self.__dict__.get("_static")  # not a submodule: it holds the model
        if dec is None or dec.batch_size != batch_size or dec.max_len < max_len or dec.window != window:
            dec = StaticDecoder(self, batch_size, max_len, compile=True, window=window)
            self.__dict__["_static"] = dec
        return dec
