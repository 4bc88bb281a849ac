"""One HNSW graph per prefill and layer, shared by every budget (`attnlab.search.patch.PrefillGraphs`):
each (method, K) of an item starts from a copy of the graph built over the prefill's search keys, and
gets bit for bit what building its own graph gives; on a tiny random Llama."""

import gc
import weakref

import pytest
import torch

from attnlab.index.projections import SearchProjections
from attnlab.index.ivf import IVFIndex
from attnlab.index.retrieval import HNSWIndex
from attnlab.search.decode_items import combos, combo_name, run_item, selector_context
from attnlab.search.lm import tiny_lm
from attnlab.search.patch import PrefillGraphs, SelectorConfig, substitute
from attnlab.search.prefill import prefilled_logits

faiss = pytest.importorskip("faiss")
pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS, G = [0, 3, 6], 2
BUDGETS = [4, 8, 16, 32]
HNSW = ["learned-hnsw", "native-hnsw"]
# a sparse graph and a narrow search: which keys a query finds depends on the graph
KNOBS = dict(hnsw_m=4, hnsw_ef_construction=8, hnsw_ef_search=4, hnsw_pin=2)


@pytest.fixture(scope="module", autouse=True)
def one_faiss_thread():
    """FAISS builds a graph in parallel, and threads racing to link their vertices may link them in
    another order: one thread makes each build repeatable, so that the per-budget reference is one graph."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def projections(seed=0):
    torch.manual_seed(seed)
    return SearchProjections(LAYERS, 64, 8, groups=G, meta={"model": "tiny"})


def item(kind, seed, T=300, split=280, **extra):
    ids = torch.randint(3, 259, (T,), generator=torch.Generator().manual_seed(seed))
    if kind == "repeated":  # a short phrase over and over, then one token: equal keys at layer 0
        ids = torch.cat([torch.tensor([5, 17, 17, 40, 9, 5, 33]).repeat(T // 7), torch.full((T % 7,), 17)])
        kind = "task"
    it = {"kind": kind, "id": f"{kind}/{seed}", "ids": ids, "split": split, **extra}
    if kind == "task":
        it["labels"] = ids[-4:]
    elif kind == "ppl":
        it["labels"] = ids[split:]
    return it


ITEMS = {"task": item("task", 1), "ppl": item("ppl", 2, T=320, split=288), "repeated": item("repeated", 3)}


@pytest.fixture
def builds(monkeypatch):
    """Counts the graphs FAISS is asked to build: one per (row, group) each time an HNSW index is
    filled from scratch (decode steps add to the graphs they have)."""
    count = [0]
    new = HNSWIndex._new

    def counted(self):
        count[0] += 1
        return new(self)

    monkeypatch.setattr(HNSWIndex, "_new", counted)
    return count


def run(lm, it, share, methods=("full", *HNSW), proj=None, knobs=KNOBS):
    proj = proj or projections()
    return run_item(lm.model, LAYERS, it, list(methods), BUDGETS, G, {"learned-hnsw": proj}, knobs, share_graphs=share)


def strip_seconds(res):
    return {name: {k: v for k, v in r.items() if k != "s"} for name, r in res["results"].items()}


def logits(lm, it, share, proj, knobs=KNOBS):
    todo = [(combo_name(m, K), selector_context(lm.model, LAYERS, m, K, G, {"learned-hnsw": proj}, knobs))
            for m, K in combos(HNSW, BUDGETS)]
    ids = torch.as_tensor(it["ids"]).long()[None]
    got, _ = prefilled_logits(lm.model, LAYERS, ids, it["split"], 4, todo, share)
    return {name: lg for name, (lg, _) in got.items()}


@pytest.mark.parametrize("name", list(ITEMS))
def test_every_budget_reads_one_graph_per_layer_and_gets_what_its_own_build_gives(lm, builds, name):
    it = ITEMS[name]
    shared = run(lm, it, True)
    assert builds[0] == len(HNSW) * len(LAYERS) * G  # once per method, layer and group, not per budget
    builds[0] = 0
    fresh = run(lm, it, False)
    assert builds[0] == len(HNSW) * len(LAYERS) * len(BUDGETS) * G
    assert strip_seconds(shared) == strip_seconds(fresh)
    assert set(shared["results"]) == {"full", *(combo_name(m, K) for m in HNSW for K in BUDGETS)}
    proj = projections()
    a, b = logits(lm, it, True, proj), logits(lm, it, False, proj)
    for combo in a:  # bit for bit, not only the same argmax
        assert torch.equal(a[combo], b[combo]), combo
    assert not torch.equal(a["learned-hnsw@4"], a["learned-hnsw@32"])  # each budget selects its own keys


def test_the_comparison_sees_the_graph(lm):
    """The settings above make the selection depend on the graph: another graph (M = 8) changes the
    perplexity at some budget, so the equalities above would catch a wrong graph."""
    it = ITEMS["ppl"]
    a = strip_seconds(run(lm, it, True, methods=["learned-hnsw"]))
    b = strip_seconds(run(lm, it, True, methods=["learned-hnsw"], knobs={**KNOBS, "hnsw_m": 8}))
    assert any(a[k]["nll"] != b[k]["nll"] for k in a)


def test_items_do_not_share_graphs_and_none_outlives_its_item(lm, builds, monkeypatch):
    made = []
    init = PrefillGraphs.__init__

    def tracked(self):
        init(self)
        made.append(weakref.ref(self))

    monkeypatch.setattr(PrefillGraphs, "__init__", tracked)
    per_item = len(HNSW) * len(LAYERS) * G
    first = run(lm, ITEMS["task"], True)
    second = run(lm, ITEMS["repeated"], True)
    assert builds[0] == 2 * per_item and len(made) == 2
    gc.collect()
    assert all(ref() is None for ref in made)  # the graphs went with their prefill
    assert strip_seconds(first) == strip_seconds(run(lm, ITEMS["task"], False))
    assert strip_seconds(second) == strip_seconds(run(lm, ITEMS["repeated"], False))


def test_other_projections_or_build_settings_build_their_own_graph(lm, builds):
    """One prefill primed through two checkpoints, two graph settings and two search widths: a graph
    serves only the same keys under the same build settings; efSearch, read at search time, shares."""
    it, p0, p1 = ITEMS["task"], projections(0), projections(1)
    ids = torch.as_tensor(it["ids"]).long()[None]
    cfgs = [("p0", p0, SelectorConfig("learned-hnsw", 8, G, **KNOBS)),
            ("p1", p1, SelectorConfig("learned-hnsw", 8, G, **KNOBS)),
            ("m8", p0, SelectorConfig("learned-hnsw", 8, G, **{**KNOBS, "hnsw_m": 8})),
            ("fp16", p0, SelectorConfig("learned-hnsw", 8, G, **{**KNOBS, "hnsw_dtype": "float16"})),
            ("pin0", p0, SelectorConfig("learned-hnsw", 8, G, **{**KNOBS, "hnsw_pin": 0})),
            ("ef16", p0, SelectorConfig("learned-hnsw", 8, G, **{**KNOBS, "hnsw_ef_search": 16})),
            ("p0 again", p0, SelectorConfig("learned-hnsw", 16, G, **KNOBS))]
    todo = [(name, lambda p=p, c=c: substitute(lm.model, LAYERS, c, p)) for name, p, c in cfgs]
    shared, _ = prefilled_logits(lm.model, LAYERS, ids, it["split"], 4, todo)
    assert builds[0] == 5 * len(LAYERS) * G  # p0, p1, m8, fp16, pin0; ef16 and the second p0 copy p0's
    fresh, _ = prefilled_logits(lm.model, LAYERS, ids, it["split"], 4, todo, share_graphs=False)
    for name, _, _ in cfgs:
        assert torch.equal(shared[name][0], fresh[name][0]), name


def test_a_graph_serves_only_the_same_keys_bit_for_bit(builds):
    ks = torch.randn(1, G, 200, 8)
    graphs = PrefillGraphs()
    make = lambda: HNSWIndex(8, 4, 8, 4, 2)  # noqa: E731
    first = graphs.fill(0, make(), ks)
    assert builds[0] == G
    nudged = ks.clone()
    nudged.view(torch.int32)[0, 1, 50, 3] ^= 1  # one bit of one key
    graphs.fill(0, make(), nudged)
    graphs.fill(1, make(), ks)  # another layer keeps its own
    assert builds[0] == 3 * G
    again = graphs.fill(0, make(), ks.clone())
    assert builds[0] == 3 * G and again is not first
    new, q = torch.randn(1, G, 30, 8), torch.randn(1, G, 1, 8)
    allowed = torch.ones(1, 1, 1, 230, dtype=torch.bool)
    for t in range(30):  # decode steps add to one copy; the kept graph and the other copy stay as they are
        again.add(new[:, :, t:t + 1])
    assert again.ntotal == 230 and first.ntotal == 200
    assert graphs.fill(0, make(), ks).ntotal == 200
    for t in range(30):
        first.add(new[:, :, t:t + 1])
    assert torch.equal(first.search(q, allowed, 8)[0], again.search(q, allowed, 8)[0])


def test_a_copy_of_a_graph_grows_as_the_graph_itself_would():
    """What sharing rests on: adding keys one at a time to a copy links them as the original would
    (clone_index keeps the generator that draws each new vertex's level), in float32 and float16."""
    x, new = torch.randn(1, 1, 400, 8), torch.randn(1, 1, 60, 8)
    for dtype in (torch.float32, torch.float16):
        a, b = HNSWIndex(8, 4, 8, 4, 2, dtype), HNSWIndex(8, 4, 8, 4, 2, dtype)
        a.add(x)
        b.add(x)
        c = a.copy()
        for t in range(60):
            b.add(new[:, :, t:t + 1])
            c.add(new[:, :, t:t + 1])
        assert a.ntotal == 400 and a.rows[0][0].ntotal == 400
        hb, hc = b.rows[0][0].hnsw, c.rows[0][0].hnsw
        for field in ("levels", "neighbors", "offsets"):
            assert (faiss.vector_to_array(getattr(hb, field)) == faiss.vector_to_array(getattr(hc, field))).all(), field
        assert hb.entry_point == hc.entry_point
    with pytest.raises(TypeError, match="IVFIndex has no copy"):  # its blocks are no HNSW graphs (IVF is not shared)
        IVFIndex(8, 4, 4, 64).copy()


def test_a_timed_item_primes_every_round_from_one_graph(lm, builds):
    it = item("time", 4, T=290, split=280, steps=4, rounds=2)
    shared = run(lm, it, True, methods=["learned-hnsw"])
    assert builds[0] == len(LAYERS) * G  # not once per budget and round
    builds[0] = 0
    fresh = run(lm, it, False, methods=["learned-hnsw"])
    assert builds[0] == len(LAYERS) * G * len(BUDGETS) * 2
    for name, res in shared["results"].items():  # the same graph searched: the same distance computations
        assert res["hnsw_ndis"] == fresh["results"][name]["hnsw_ndis"] and len(res["ms"]) == 2 * 4, name
    assert any(sum(r["hnsw_ndis"]) for r in shared["results"].values())
