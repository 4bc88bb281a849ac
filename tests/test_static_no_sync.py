"""A static decode step can be captured as a CUDA graph: for every mechanism and option a
`StaticDecoder` takes, `step` reads no value back to the host (no `.item()`, `bool()`, `int()`,
`float()`, `.nonzero()` or `.tolist()` on a tensor, by package code or by torch underneath) and every
op it runs makes outputs whose shapes do not depend on the data: two steps at other positions, on
other tokens, run the same ops on the same shapes. The CPU stands in for an accelerator as in
tests/test_no_host_sync.py (value checks run the way they run on a GPU: device-side asserts inside
`async_value_checks`, which the step enters). Compiled, a step's graph holds one value assert, the
logits' (the model boundary)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from attnlab import checks
from attnlab.models.static_decode import StaticDecoder
from attnlab.ops.gla import args as gla_ops
from test_static_decode import SETTINGS, model

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("item", "__float__", "__int__", "__bool__", "nonzero", "tolist")
aten = torch.ops.aten
DATA_SHAPED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
               aten.unique_consecutive.default, aten.argwhere.default, aten.repeat_interleave.Tensor,
               aten._local_scalar_dense.default}  # outputs shaped by values, or a value read to the host

OPTIONS = {  # (attn, attention, StaticDecoder keywords) beside the exact decoding of SETTINGS
    "trained-window": ("hybrid", dict(train_window=3, local_window=2), {}),
    "decode-window": ("scalar", dict(kernel="cauchy", sink=True), dict(window=3)),
    "budget": ("hybrid", dict(train_window=3, local_window=2), dict(window=3, budget=4)),
    "learned": ("hybrid", dict(n_kv_heads=2), "learned"),
    "split-softmax": ("softmax", dict(n_kv_heads=2), dict(split=8)),
    "split-hybrid-sink": ("hybrid", dict(sink=True, sink_weight=0.5, n_kv_heads=2), dict(split=8)),
}
CASES = {**{name: (*SETTINGS[name][:2], {}, SETTINGS[name][2]) for name in SETTINGS},
         **{name: (*OPTIONS[name], {}) for name in OPTIONS}}


class Ops(TorchDispatchMode):
    """Every aten op run inside the block, with the shapes of its outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is aten.index.Tensor and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]):
            self.ops.append(("index by a bool mask", ()))
        shapes = tuple(tuple(o.shape) for o in tree_leaves(out) if isinstance(o, torch.Tensor))
        sized = func is aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size", None) is not None
        self.ops.append((str(func) + (" of a given size" if sized else ""), shapes))  # given: not shaped by data
        return out


@pytest.fixture
def reads(monkeypatch):
    """(method, module, line) of every value read by package code while on; value checks as on a GPU."""
    real_mode = checks.value_check_mode

    def as_on_a_gpu(x):
        if torch.compiler.is_compiling():
            return real_mode(x)
        return "assert" if getattr(checks._async, "depth", 0) > 0 else "eager"

    monkeypatch.setattr(checks, "value_check_mode", as_on_a_gpu)
    monkeypatch.setattr(gla_ops, "value_check_mode", as_on_a_gpu)  # imported there by name
    seen, on = [], [False]

    def spy(real, name):
        def read(self, *a, **k):
            frame = sys._getframe(1)
            module = frame.f_globals.get("__name__", "")
            if on[0] and module.split(".")[0] == "attnlab":
                seen.append((name, module, frame.f_lineno))
            return real(self, *a, **k)
        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, spy(getattr(torch.Tensor, name), name))
    return seen, on


def decoder(name):
    from attnlab.cache.selected import DecodeSelector
    from attnlab.index.projections import SearchProjections

    attn, attention, kw, extra = CASES[name]
    m = model(attn, attention, extra)
    if kw == "learned":
        kw = dict(selector=DecodeSelector(SearchProjections([0, 1], 64, d_search=8, groups=4, rope=True), K=5))
    return StaticDecoder(m, 2, 32, tail=64, **kw)


@pytest.mark.parametrize("name", list(CASES))
def test_a_static_step_reads_nothing_back_and_keeps_its_shapes(name, reads):
    seen, on = reads
    dec = decoder(name)
    g = torch.Generator().manual_seed(4)
    idx = torch.randint(0, 50, (2, 14), generator=g)
    dec.prefill(idx[:, :9])
    traces = []
    for t in (9, 12):  # two steps at other positions and tokens (no merge of sorted codes between)
        dec.pos.fill_(t)
        dec.length = t
        ops = Ops()
        on[0] = True
        with ops:
            dec.step(idx[:, t : t + 1])
        on[0] = False
        traces.append(ops.ops)
    assert seen == [], f"{name}: values read back inside a step: {sorted(set(seen))}"
    bad = sorted({op for op, _ in traces[0] + traces[1] if op in map(str, DATA_SHAPED) or op.startswith("index by")})
    assert bad == [], f"{name}: data-dependent ops in a step: {bad}"
    assert traces[0] == traces[1], f"{name}: a step's ops or shapes changed with the position or the tokens"


def test_a_merge_of_sorted_codes_between_steps_reads_nothing_back(reads):
    """The merge a windowed decoder makes every `tail` steps (here every step: tail 1) runs inside
    `step` too: no value read back, no op shaped by data (the new codes' places counted by a
    scatter-add and a running sum into the decoder's scratch buffer)."""
    seen, on = reads
    attn, attention, _ = OPTIONS["trained-window"]
    dec = StaticDecoder(model(attn, attention, {}), 2, 32, tail=1)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(5))
    dec.prefill(idx[:, :9])
    ops = Ops()
    on[0] = True
    with ops:
        for t in range(9, 15):
            dec.step(idx[:, t : t + 1])
    on[0] = False
    assert seen == [], f"values read back in a step that merges: {sorted(set(seen))}"
    names = {op for op, _ in ops.ops}
    assert {"aten.scatter_add_.default", "aten.cumsum_.default"} <= names  # the merge ran (the spy sees it)
    assert sorted(n for n in names if n in map(str, DATA_SHAPED) or n.startswith("index by")) == []
    assert dec.merged[0] > 9 - attention["local_window"] + 1  # past the prompt's merge


def test_the_spies_see_a_read_and_a_data_shaped_op(reads):
    """The spies themselves: a package read and a data-shaped op are caught."""
    seen, on = reads
    ops = Ops()
    on[0] = True
    with ops:
        checks.check_finite("x", torch.ones(3))  # outside async_value_checks: read, as on a GPU
        torch.ones(3).sum().item()  # a read by torch underneath shows as aten._local_scalar_dense
        torch.arange(4).nonzero()
    on[0] = False
    assert seen and seen[0][1] == "attnlab.checks"
    assert {"aten._local_scalar_dense.default", "aten.nonzero.default"} <= {op for op, _ in ops.ops}


@pytest.mark.parametrize("name", ["goat-hybrid-gqa", "ssd"])
def test_a_compiled_step_holds_one_value_assert(name):
    """The graph dynamo captures of a step (fullgraph) holds one value assert, the logits' (the model
    boundary), not the per-op checks (tau > 0, log_decay <= 0, finite inputs and states: one assert
    per checked tensor of every layer before). The kinds whose CUDA-graph test failed or never
    reported on the H100 (goat-hybrid-gqa, ssd, gla) were those carrying comparison asserts in their
    captured step; principled (finiteness asserts only) and the kinds without any passed."""
    from attnlab.models.static_decode import own_code

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    dec, ref = decoder(name), decoder(name)  # a step moves a recurrent state on: one decoder each
    idx = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        dec.prefill(idx[:, :9])
        ref.prefill(idx[:, :9])
        got = torch.compile(own_code(dec.step_logits), fullgraph=True, backend=record)(idx[:, 9:])
        assert torch.allclose(got, ref.step_logits(idx[:, 9:]), atol=1e-6)
    asserts = [n for g in graphs for n in g.graph.nodes if n.target in (torch._assert_async, aten._assert_async.msg)]
    assert len(graphs) == 1 and len(asserts) == 1, [n.format_node() for n in asserts]
