"""Decoding with static shapes: buffers of a fixed length, the position a device tensor, and a step
that compiles into one graph (a CUDA graph on the GPU).

`LM.generate` decodes through per-layer caches whose buffers grow and whose steps check and branch
in Python: hundreds of small host-driven operations per token. A `StaticDecoder` makes every buffer
once (`max_len` positions), writes a token's entries at the position held in a device tensor and
reads under a mask of the positions written: the same shapes every step and no host sync, so
`torch.compile` makes one graph of it (on CUDA `mode="reduce-overhead"`, the gpt-fast recipe).

    dec = StaticDecoder(model, batch_size=1, max_len=4096, compile=True)
    out = dec.generate(prompt, 200)                # = model.generate(prompt, 200) (greedy)

Each layer's buffers and readout are its mechanism's: the layer's `static_state(opts)` makes a
`cache.static.StaticState` from one `cache.static.StaticOptions` (the decode modes below as
arguments), and the decoder loops over those states, naming no mechanism (docs/adding-a-mechanism.md).
Softmax, GOAT, goat_hybrid and principled keep a key store whose sliding window is a ring of w
slots, GLA, SSD and cosformer their fixed-size state, scalar and hybrid heads (Gaussian or Cauchy,
GQA, the gain, grouped values, the sink and its weight, dot-product heads beside them) buffers of
their own (`layers.mechanisms.scalar_static`). Exact reading costs O(max_len) per step; on CUDA,
from 4K positions, the softmax and scalar-family exact steps split the cache into chunks read in
parallel and combined by log-sum-exp (split-K, `cache.static.split`). A layer trained through a
window (`train_window`, `local_window`), or any scalar layer under `window=k`, reads its k + w keys
through sorted int64 codes merged every `tail` steps between steps (`cache.static.window`):
O(log max_len + k + w + tail), and an O(t) merge every `tail` steps at position t, the prompt
through the model's own forward in one pass; `budget=M` adds the sorted cache's evictions (the
prompt's in one pass too, `ops.scalar.budget_evictions`). A `selector` (`DecodeSelector`, index
"exact") reads the K keys the search projections score highest: one matmul over a static buffer and
a top-K per step, the prompt in one pass per chunk. A step reads no value back to the host and makes
no shape from data (its value checks are device-side asserts), so it is captured whole as a CUDA graph.
"""
from __future__ import annotations

import types

import torch
from torch import nn

from ..cache.options import selectable_layers
from ..cache.static import StaticOptions, padded, split_chunk
from ..checks import async_value_checks, check_output_finite, set_model_boundary

__all__ = ["StaticDecoder", "own_code", "supported"]


def supported(layer) -> str | None:
    """None when a `StaticDecoder` decodes `layer` (an `attnlab.layers.Attention`): its class makes a
    static state (`static_state(opts)`, docs/adding-a-mechanism.md); else why not."""
    if getattr(layer, "static_state", None) is not None:
        return None
    return f"mechanism {layer.mechanism!r} (its class {type(layer).__name__} makes no static state: no static_state(opts))"


class StaticDecoder(nn.Module):
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
            on CUDA from `cache.static.SPLIT_MIN` positions into chunks of `cache.static.CHUNK` keys
            (split-K), None never splits, an int splits into chunks of that many keys (the buffers
            padded to whole chunks).
        window_impl: how a window step chooses its keys (`cache.static.window_keys`' impl): "auto"
            one Triton kernel on CUDA, "triton" the kernel (the CPU under TRITON_INTERPRET=1),
            "torch" PyTorch's ops.

    Raises:
        ValueError: batch_size or max_len not a positive int, max_len past the learned position
            embedding's length, a split that is not "auto", None or an int >= 1, a window_impl not
            named above, or a layer this decoder does not take (naming it and why).
    """

    def __init__(self, model, batch_size: int, max_len: int, *, compile: bool = False, exact: bool = False,
                 tail: int = 256, selector=None, window: int | None = None, budget: int | None = None,
                 split="auto", window_impl: str = "auto"):
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
            selector.check(selectable_layers(model))
        if window is not None or budget is not None:
            from ..cache.options import DecodeOptions

            if exact or selector is not None:
                given = f"window={window}" + ("" if budget is None else f" with budget={budget}")
                raise ValueError(f"{given} reads a window of nearest keys: give it without exact=True or a selector")
            DecodeOptions(window=window, budget=budget).check(model)  # the checks LM.generate(window=...) makes
        self.model, self.batch_size, self.max_len, self.tail = model, batch_size, max_len, tail
        self.selector, self.window, self.budget = selector, window, budget
        p = next(model.parameters())
        self.chunk = split_chunk(split, max_len, p.device)  # keys per chunk of a split exact step, or None
        B, N = batch_size, padded(max_len, self.chunk)  # the buffers hold whole chunks (the rest never visible)
        self.states = nn.ModuleDict()  # each layer's static state, made by its mechanism
        for i, blk in enumerate(model.blocks):
            opts = StaticOptions(batch_size=B, max_len=N, device=p.device, dtype=p.dtype, layer=i, chunk=self.chunk,
                                 exact=exact, window=window, budget=budget, tail=tail, selector=selector,
                                 window_impl=window_impl)
            self.states[str(i)] = blk.attn.static_state(opts)
        size = max(state.scratch_size for state in self.states.values())
        if size:  # the merges' temporaries, one buffer shared by the layers (they merge one after another)
            self.register_buffer("merge_scratch", torch.empty(size, dtype=torch.int64, device=p.device),
                                 persistent=False)
        self.fused = [blk.attn.fusable() and not self.states[str(i)].stack_qkv_off
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

    @property
    def merged(self) -> list[int]:
        """Each layer's merge point of its sorted codes (host copies; 0 where it keeps none)."""
        return [state.merged for state in self.states.values()]

    def _attend(self, i: int, blk, h: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """Layer i's readout for the tokens h (B, T, C) at `positions` (T,), their entries written into
        its state first; each token reads the state's first n slots (where its position allows)."""
        B, T = h.shape[:2]
        p = blk.attn.project(h, positions.expand(B, T), qkv=self._qkv(i))
        return self.states[str(i)].attend(p, positions, n, h)

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
            seen = tuple((t._version, t.data_ptr()) for lin in (a.wq, a.wk, a.wv) for t in (lin.weight, lin.bias) if t is not None)
            if force or seen != self._qkv_seen[i]:
                w, b = a.fused_qkv()
                getattr(self, f"qkvw{i}").copy_(w)
                if b is not None:
                    getattr(self, f"qkvb{i}").copy_(b)
                self._qkv_seen[i] = seen

    def _merge(self, t: int, force: bool = False) -> None:
        """Before the step at position t: each state brings its sorted codes up to date (only windowed
        scalar layers keep any; force: every key sorted again, after a prompt), between steps, not in
        the compiled graph."""
        scratch = getattr(self, "merge_scratch", None)
        for state in self.states.values():
            state.merge(t, force, scratch)

    def _forward(self, idx: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        m = self.model
        x = m.tok_emb(idx)
        if m.pos_emb is not None:
            x = x + m.pos_emb(positions)[None]
        for i, blk in enumerate(m.blocks):
            h = blk.norm1(x)
            x = x + blk.attn.finish(self._attend(i, blk, h, positions, n), h)
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
            logits = self._forward(idx_t, positions, self.slots.shape[0])[:, -1]
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
        for state in self.states.values():
            state.reset()
        if any(state.whole_prompt for state in self.states.values()):
            return self._prefill_whole(idx)
        for a in range(0, T, chunk):
            positions = torch.arange(a, min(T, a + chunk), device=idx.device)  # reading slots up to the chunk's end
            logits = self._forward(idx[:, a : a + chunk], positions, a + len(positions))[:, -1]
        self.pos.fill_(T)
        self.length = T
        return logits

    def _prefill_whole(self, idx: torch.Tensor) -> torch.Tensor:
        """The prompt through the model's own forward in one pass (a windowed layer's readout is its
        windowed op, what its decode reads), every layer's entries written into its state (`fill`);
        then the windowed layers' codes are sorted (or, under a budget, the keys its evictions left
        marked). The logits of the last token (B, V)."""
        m, T = self.model, idx.shape[1]
        positions = self.slots[:T]
        x = m.tok_emb(idx)
        if m.pos_emb is not None:
            x = x + m.pos_emb(positions)[None]
        for i, blk in enumerate(m.blocks):
            a, h = blk.attn, blk.norm1(x)
            p = a.project(h, 0, qkv=self._qkv(i))
            x = x + a.finish(self.states[str(i)].fill(p, T), h)
            x = x + blk.mlp(blk.norm2(x))
        self.pos.fill_(T)
        self.length = T
        self._merge(T, force=True)
        return m.head(m.norm_f(x[:, -1:]))[:, -1]

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


def own_code(method):
    """`method` (bound) as a function with a code object of its own. Dynamo keeps its compiled graphs,
    and counts recompiles toward `torch._dynamo.config.recompile_limit` (8), per code object: every
    decoder compiling one shared method would share that count, and a process that built more than
    8 different decoders would fail under fullgraph=True. Each decoder's own copy starts at 0, and
    its graphs go with it."""
    f = method.__func__
    code = f.__code__.replace(co_name=f"{f.__name__}_{id(method.__self__):x}")
    fn = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    fn.__kwdefaults__, fn.__doc__, fn.__qualname__ = f.__kwdefaults__, f.__doc__, f"{f.__qualname__}_{id(method.__self__):x}"
    return types.MethodType(fn, method.__self__)
