"""Decoding with static shapes: buffers of a fixed length, the position a device tensor, and a step
that compiles into one graph (a CUDA graph on the GPU).

`LM.generate` decodes through per-layer caches whose buffers grow and whose steps check and branch
in Python: hundreds of small host-driven operations per token. A `StaticDecoder` makes every buffer
once (`max_len` positions), writes a token's entries at the position held in a device tensor and
reads under a mask of the positions written: the same shapes every step and no host sync, so
`torch.compile` makes one graph of it (on CUDA `mode="reduce-overhead"`, the gpt-fast recipe).

    dec = StaticDecoder(model, batch_size=1, max_len=4096, compile=True)
    out = dec.generate(prompt, 200)                # = model.generate(prompt, 200) (greedy)

Scalar and hybrid heads (Gaussian or Cauchy, GQA, the gain, grouped values, the sink and its weight,
dot-product heads beside them) live in this module's buffers and are read by `static_scalar`;
softmax, GOAT, goat_hybrid and principled in a key store whose sliding window is a ring of w slots,
and GLA, SSD and cosformer in their fixed-size state (`static_state`). Exact reading costs
O(max_len) per step; on CUDA, from 4K positions, the softmax and scalar-family exact steps split the
cache into chunks read in parallel and combined by log-sum-exp (split-K, `static_split`). A layer
trained through a window (`train_window`, `local_window`), or any scalar layer under `window=k`,
reads its k + w keys through sorted int64 codes merged every `tail` steps between steps
(`static_window`): O(log max_len + k + w + tail), and an O(t) merge every `tail` steps at position t, the prompt through the model's own forward in one
pass; `budget=M` adds the sorted cache's evictions (the prompt's in one pass too,
`ops.scalar.budget_evictions`). A `selector` (`DecodeSelector`, index "exact") reads the K keys the
search projections score highest: one matmul over a static buffer and a top-K per step, the prompt
in one pass per chunk. A step reads no value back to the host and makes no shape from data (its
value checks are device-side asserts), so it is captured whole as a CUDA graph.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache.selected import KEY_DTYPES
from ..cache.sorted import QUERY_HISTORY
from ..checks import async_value_checks, check_output_finite, set_model_boundary
from ..ops.scalar.budget import NEVER, budget_evictions
from .decode import decode_window
from .static_scalar import ScalarReadouts
from .static_split import padded, split_chunk
from .static_state import KEYED, RECURRENT, KeyStore, make_state, own_code, softmax_step
from .static_window import LAST, extend_codes, extend_scratch_size, merge_codes

__all__ = ["StaticDecoder", "supported"]

SCALAR = ("scalar", "hybrid")  # mechanisms whose heads carry scalar keys (a hybrid's add q·k/√d)


def supported(layer) -> str | None:
    """None when a `StaticDecoder` decodes `layer` (an `attnlab.layers.Attention`), else why not."""
    if layer.mechanism in KEYED + SCALAR + RECURRENT:
        return None
    return f"mechanism {layer.mechanism!r} (static decoding takes {', '.join(KEYED + SCALAR + RECURRENT)} layers)"


class StaticDecoder(ScalarReadouts, nn.Module):
    """Exact decoding of `model` (an `attnlab.models.LM`) through static buffers (module docstring).

    Args:
        model: the LM; every layer must be `supported`.
        batch_size: rows decoded together, an int >= 1.
        max_len: positions the buffers hold (prompt + new tokens), an int >= 1.
        compile: compile the step with torch.compile (on CUDA `mode="reduce-overhead"`).
        exact: layers trained through a window read every key instead (default: through the window).
        window: layers with scalar heads read the `window` nearest keys in scalar space (and their
            `local_window` ring), as `LM.generate(window=...)` does; None: a window-trained layer's
            own k, every key otherwise.
        budget: with a window, at most `budget` older keys per head stay (those nearest the recent
            queries' range, evicted after every step, as `LM.generate(window=..., budget=...)`);
            each step then scores every live slot; the prompt's evictions are computed in one pass.
        tail: a windowed layer's older keys scored directly between two merges of its sorted codes.
        selector: an `attnlab.cache.selected.DecodeSelector` with index="exact": hybrid layers read
            the K keys their search projections score highest (one matmul over the stored search
            keys and a top-K per step, the device route of learned selection), in place of a window.
        split: how a softmax or scalar-family layer's exact step reads a long cache: "auto" splits it
            on CUDA from `static_split.SPLIT_MIN` positions into chunks of `static_split.CHUNK` keys
            (split-K), None never splits, an int splits into chunks of that many keys (the buffers
            padded to whole chunks).

    Raises:
        ValueError: batch_size or max_len not a positive int, max_len past the learned position
            embedding's length, a split that is not "auto", None or an int >= 1, or a layer this
            decoder does not take (naming it and why).
    """

    def __init__(self, model, batch_size: int, max_len: int, *, compile: bool = False, exact: bool = False,
                 tail: int = 256, selector=None, window: int | None = None, budget: int | None = None,
                 split="auto"):
        super().__init__()
        for name, n in (("batch_size", batch_size), ("max_len", max_len), ("tail", tail)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be an int >= 1, got {n!r}")
        for i, blk in enumerate(model.blocks):
            why = supported(blk.attn)
            if why is not None:
                raise ValueError(f"StaticDecoder: layer {i} has {why}; decode it with LM.generate")
        if model.pos_emb is not None and max_len > model.cfg.max_seq_len:
            raise ValueError(f"max_len={max_len} is past the learned position embedding's "
                             f"model.max_seq_len={model.cfg.max_seq_len}")
        if selector is not None:
            from ..cache.selected import DecodeSelector

            if not isinstance(selector, DecodeSelector) or selector.index != "exact" or exact:
                raise ValueError("selector must be a DecodeSelector with index='exact' (scored on the device), "
                                 "and exact=False")
            selector.check([(i, blk.attn) for i, blk in enumerate(model.blocks) if blk.attn.mechanism in SCALAR])
        if window is not None or budget is not None:
            from ..cache.options import DecodeOptions

            if exact or selector is not None:
                given = f"window={window}" + ("" if budget is None else f" with budget={budget}")
                raise ValueError(f"{given} reads a window of nearest keys: give it without exact=True or a selector")
            DecodeOptions(window=window, budget=budget).check(model)  # the checks LM.generate(window=...) makes
        self.model, self.batch_size, self.max_len, self.tail = model, batch_size, max_len, tail
        self.selector, self.window, self.budget = selector, window, budget
        self.kwin = [window or blk.attn.config.train_window if blk.attn.mechanism in SCALAR else None
                     for blk in model.blocks]  # each layer's k nearest keys, or None: every key
        self.windowed = [not exact and selector is None and k is not None for k in self.kwin]
        self.merged = [0] * len(model.blocks)  # host copies of each windowed layer's merge point
        p = next(model.parameters())
        self.chunk = split_chunk(split, max_len, p.device)  # keys per chunk of a split exact step, or None
        B, N = batch_size, padded(max_len, self.chunk)  # the buffers hold whole chunks (the rest never visible)
        self.states = nn.ModuleDict()  # layers read through a key store or a recurrent state (static_state)
        self.dots = nn.ModuleDict()  # the dot-product heads of mixed scalar layers
        for i, blk in enumerate(model.blocks):
            a = blk.attn
            state = make_state(a, B, N, p.device, p.dtype, self.chunk)
            if state is not None:
                self.states[str(i)] = state
                continue
            if a.n_scalar < a.config.n_heads:  # a mixed layer's dot-product heads: a key store of their own
                self.dots[str(i)] = KeyStore({"k": (a.n_kv, a.qk_dim, p.dtype), "v": (a.n_kv, a.config.head_dim, p.dtype)},
                                             B, N, a.config.sliding_window, p.device)
            if a.mechanism != "scalar":  # a scalar head's score reads no vector key
                self.register_buffer(f"k{i}", p.new_zeros(B, a.n_kv, N, a.qk_dim), persistent=False)
            groups = a.value_groups if a.mechanism == "scalar" else a.n_kv
            self.register_buffer(f"v{i}", p.new_zeros(B, groups, N, a.config.head_dim), persistent=False)
            if a.mechanism in SCALAR:
                self.register_buffer(f"ks{i}", p.new_zeros(B, a.n_scalar, N, dtype=torch.float32), persistent=False)
                if selector is not None:
                    self.register_buffer(f"sk{i}", p.new_zeros(B, a.n_scalar, N, selector.projections.d_search,
                                                               dtype=KEY_DTYPES[selector.key_dtype]), persistent=False)
            if self.windowed[i] and budget is not None:  # live older keys, and the recent scalar queries
                self.register_buffer(f"alive{i}", torch.ones(B, a.n_scalar, N, dtype=torch.bool, device=p.device),
                                     persistent=False)
                self.register_buffer(f"qh{i}", torch.zeros(B, a.n_scalar, QUERY_HISTORY, device=p.device),
                                     persistent=False)
            elif self.windowed[i]:
                self.register_buffer(f"codes{i}", torch.full((B, a.n_scalar, 2, N), LAST, device=p.device),
                                     persistent=False)  # the sorted codes, low and high (static_window)
                self.register_buffer(f"m{i}", torch.zeros((), dtype=torch.long, device=p.device), persistent=False)
        sizes = [extend_scratch_size(c) for name, c in self.named_buffers() if name.startswith("codes")]
        if sizes:  # the merges' temporaries, one buffer shared by the layers (they merge one after another)
            self.register_buffer("merge_scratch", torch.empty(max(sizes), dtype=torch.int64, device=p.device),
                                 persistent=False)
        self.fused = [blk.attn.fusable()
                      and not getattr(self.states[str(i)] if str(i) in self.states else None, "stack_qkv_off", False)
                      for i, blk in enumerate(model.blocks)]  # q, k, v as one matmul of stacked weights
        for i, blk in enumerate(model.blocks):
            if self.fused[i]:
                w, b = blk.attn.fused_qkv()
                self.register_buffer(f"qkvw{i}", w.detach().clone(), persistent=False)
                if b is not None:
                    self.register_buffer(f"qkvb{i}", b.detach().clone(), persistent=False)
        self._qkv_seen: list = [None] * len(model.blocks)  # the weights' versions the stacks were made from
        self.register_buffer("pos", torch.zeros((), dtype=torch.long, device=p.device), persistent=False)
        self.register_buffer("slots", torch.arange(N, device=p.device), persistent=False)
        self.length = 0  # positions written (a host copy of pos: no synchronisation to check it)
        self._step = self.step_logits
        if compile:  # a step of its own: any number of decoders compile in one process (`own_code`)
            self._step = torch.compile(own_code(self.step_logits), fullgraph=True,
                                       mode="reduce-overhead" if p.device.type == "cuda" else None)

    def _attend(self, i: int, blk, h: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Layer i's readout for the tokens h (B, T, C) at `positions` (T,), their entries written into
        the buffers first; visible (T, N) marks the buffer slots each token reads."""
        a = blk.attn
        B, T = h.shape[:2]
        p = a.project(h, positions.expand(B, T), qkv=self._qkv(i))
        n = visible.shape[-1]  # the slots read: all of them in a step, those up to the chunk's end in a prefill
        if str(i) in self.states:
            return self.states[str(i)].attend(a, p, positions, n)
        o = self._scalar_attend(i, a, p, h, positions, visible)
        if str(i) in self.dots:  # a mixed layer: its dot-product heads after the scalar heads
            e, _, ok = self.dots[str(i)].read({"k": p.k, "v": p.v}, positions, n)
            chunk = None if self.dots[str(i)].ring else self.chunk
            od = softmax_step(p.q, e, ok, a.config.scale, a.config.p, chunk)
            o = torch.cat([o, od.to(o.dtype)], dim=1)
        return o

    def _qkv(self, i: int):
        """Layer i's stacked q, k, v weights (and bias) for `Attention.project`, or None."""
        return (getattr(self, f"qkvw{i}"), getattr(self, f"qkvb{i}", None)) if self.fused[i] else None

    def _sync_qkv(self, force: bool = False) -> None:
        """Stack each layer's wq, wk, wv again where they changed since (an optimizer step, a load: their
        version counters or storage; force: always, as a prompt does), between steps: a step reads the
        stacks, not a copy of the weights made at every step (GPT-2 small: 85 MB a step)."""
        for i, blk in enumerate(self.model.blocks):
            if not self.fused[i]:
                continue
            a = blk.attn
            seen = tuple((t._version, t.data_ptr()) for m in (a.wq, a.wk, a.wv) for t in (m.weight, m.bias) if t is not None)
            if force or seen != self._qkv_seen[i]:
                w, b = a.fused_qkv()
                getattr(self, f"qkvw{i}").copy_(w)
                if b is not None:
                    getattr(self, f"qkvb{i}").copy_(b)
                self._qkv_seen[i] = seen

    def _merge(self, t: int, force: bool = False) -> None:
        """Before the step at position t: a windowed layer whose directly scored older keys would pass
        `tail` (or every one, force) brings its codes up to t - w: the keys since its last merge sorted
        in (`extend_codes`), or every key sorted again when forced (between steps, not in the compiled
        graph)."""
        for i, blk in enumerate(self.model.blocks):
            if not self.windowed[i] or self.budget is not None:  # a budget scores every live slot: no codes
                continue
            w = blk.attn.config.local_window
            if force or t - w + 1 - self.merged[i] > self.tail:
                upto = max(0, min(t - w + 1, t))  # every position below it written already
                codes, ks = getattr(self, f"codes{i}"), getattr(self, f"ks{i}")
                if force:
                    codes.copy_(merge_codes(ks, upto))
                else:  # keys below the merge point never change: only the new ones are sorted in
                    extend_codes(codes, ks, self.merged[i], upto, self.merge_scratch)
                getattr(self, f"m{i}").fill_(upto)
                self.merged[i] = upto

    def _forward(self, idx: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        m = self.model
        x = m.tok_emb(idx)
        if m.pos_emb is not None:
            x = x + m.pos_emb(positions)[None]
        for i, blk in enumerate(m.blocks):
            h = blk.norm1(x)
            x = x + blk.attn.finish(self._attend(i, blk, h, positions, visible), h)
            x = x + blk.mlp(blk.norm2(x))
        return m.head(m.norm_f(x))

    def step_logits(self, idx_t: torch.Tensor) -> torch.Tensor:
        """One token idx_t (B, 1) at position `self.pos` -> logits (B, V); fixed shapes throughout
        (what is compiled). Does not advance `pos` (`step` does). Compiled, the layers' and ops' value
        checks stay out of the graph and one assert that the logits are finite stands for them (the
        model boundary of `LM.forward`; the parameters were checked where they entered): a captured
        step holds one device-side assert, not one per checked tensor of every layer."""
        positions = self.pos[None]
        compiling = torch.compiler.is_compiling()
        before = set_model_boundary(True) if compiling else False
        try:
            logits = self._forward(idx_t, positions, self.slots[None, :] <= positions[:, None])[:, -1]
        finally:
            if compiling:
                set_model_boundary(before)
        if compiling:
            check_output_finite("logits", logits)
        return logits

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
        """The prompt idx (B, T0) from position 0, `chunk` tokens at a time (each chunk one causal
        forward against the buffers up to its last position, which it fills: memory O(chunk x T0));
        the logits of its last token (B, V). Resets the decoder."""
        if idx.dim() != 2 or idx.shape[0] != self.batch_size or not 1 <= idx.shape[1] <= self.max_len:
            raise ValueError(f"idx must be (batch_size={self.batch_size}, T0) with 1 <= T0 <= max_len={self.max_len}, "
                             f"got shape {tuple(idx.shape)}")
        T = idx.shape[1]
        self._sync_qkv(force=True)
        for state in [*self.states.values(), *self.dots.values()]:
            state.reset()
        if any(self.windowed):
            return self._prefill_whole(idx)
        for a in range(0, T, chunk):
            positions = torch.arange(a, min(T, a + chunk), device=idx.device)  # reading slots up to the chunk's end
            logits = self._forward(idx[:, a : a + chunk], positions, self.slots[None, : a + len(positions)]
                                   <= positions[:, None])[:, -1]
        self.pos.fill_(T)
        self.length = T
        return logits

    def _prefill_whole(self, idx: torch.Tensor) -> torch.Tensor:
        """The prompt through the model's own forward in one pass (a windowed layer's readout is its
        windowed op, what its decode reads), every layer's entries written into the buffers; then the
        windowed layers' codes are sorted (or, under a budget, the keys its evictions left marked). The
        logits of the last token (B, V)."""
        if self.window is not None:  # the layers' forward through the decode window (models.decode.decode_window)
            with decode_window(self.model, self.window, self.budget):
                return self._prefill_layers(idx)
        return self._prefill_layers(idx)

    def _prefill_layers(self, idx: torch.Tensor) -> torch.Tensor:
        m, T = self.model, idx.shape[1]
        positions = self.slots[:T]
        x = m.tok_emb(idx)
        if m.pos_emb is not None:
            x = x + m.pos_emb(positions)[None]
        for i, blk in enumerate(m.blocks):
            a, h = blk.attn, blk.norm1(x)
            p = a.project(h, 0, qkv=self._qkv(i))
            if str(i) in self.states:
                x = x + a.finish(self.states[str(i)].fill(a, p, T), h)
                x = x + blk.mlp(blk.norm2(x))
                continue
            if str(i) in self.dots:
                m_ = min(T, self.dots[str(i)].kpos.shape[0])
                self.dots[str(i)].write({"k": p.k[:, :, T - m_ :], "v": p.v[:, :, T - m_ :]}, positions[T - m_ :])
            if a.mechanism != "scalar":
                getattr(self, f"k{i}")[:, :, :T] = p.k
            getattr(self, f"v{i}")[:, :, :T] = a.scalar_values(p)
            if a.mechanism in SCALAR:
                getattr(self, f"ks{i}")[:, :, :T] = p.ks.float() + 0.0
            if self.windowed[i] and self.budget is not None:
                self._budget_prompt(i, a, p, T)
            x = x + a.finish(a.attend(p)[0], h)
            x = x + blk.mlp(blk.norm2(x))
        self.pos.fill_(T)
        self.length = T
        self._merge(T, force=True)
        return m.head(m.norm_f(x[:, -1:]))[:, -1]

    def _budget_prompt(self, i: int, a, p, T: int) -> None:
        """Layer i's budget state after a prompt of T tokens, as T steps leave it: the older keys its
        evictions kept (`budget_evictions`, the rule `budget_keep` applies step by step; the sink,
        outside these buffers, is never evicted) and its last QUERY_HISTORY scalar queries."""
        evicted = budget_evictions(p.qs, p.ks, self.budget, history=QUERY_HISTORY, local=a.config.local_window)
        alive = getattr(self, f"alive{i}")
        alive.fill_(True)
        alive[:, :, :T] = evicted == NEVER  # (B, H, T): every key not evicted by the prompt's last step
        first = max(0, T - QUERY_HISTORY)
        getattr(self, f"qh{i}").index_copy_(2, self.slots[first:T] % QUERY_HISTORY, p.qs[..., first:T].float())

    @torch.no_grad()
    def step(self, idx_t: torch.Tensor) -> torch.Tensor:
        """One new token idx_t (B, 1) -> logits (B, V); then the position advances."""
        if not self.length:
            raise ValueError("step before prefill: give the prompt to prefill first")
        if self.length >= self.max_len:
            raise ValueError(f"the buffers are full: max_len={self.max_len} positions")
        if idx_t.shape != (self.batch_size, 1):
            raise ValueError(f"idx_t must be (batch_size={self.batch_size}, 1), got shape {tuple(idx_t.shape)}")
        self._sync_qkv()
        self._merge(self.length)
        with async_value_checks():  # the ops' value checks as device-side asserts: no host sync (on the CPU: read)
            logits = self._step(idx_t)
        if logits.device.type == "cuda":
            logits = logits.clone()  # a CUDA graph's output is overwritten by its next replay
        self.pos += 1
        self.length += 1
        return logits

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy: extend idx (B, T0) by max_new_tokens, as `LM.generate(idx, max_new_tokens)`."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if idx.dim() == 2 and idx.shape[1] + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"prompt {idx.shape[1]} + max_new_tokens {max_new_tokens} needs "
                             f"{idx.shape[1] + max_new_tokens - 1} positions, max_len={self.max_len}")
        was = self.model.training
        self.model.eval()
        out, logits = idx, self.prefill(idx)
        for i in range(max_new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            out = torch.cat([out, nxt], dim=1)
            if i + 1 < max_new_tokens:
                logits = self.step(nxt)
        self.model.train(was)
        return out
