"""The scalar selection read from a sorted array (`attnlab.search.sorted`) and its one-dimensional
distance projections (`SearchProjections(score="distance")`): the whole-matrix rule and the sorted
array choose the keys the query-by-query reference chooses, ties included; the distance space's
augmented vectors rank and weigh keys as -(q - k)^2 / tau; and the method runs inside a Hugging Face
model, where reading every key is full attention."""

import pytest
import torch

from attnlab.index.projections import SearchProjections, search_losses
from attnlab.search.lm import tiny_lm
from attnlab.search.patch import SelectorConfig, substitute
from attnlab.search.prefill import prefilled_logits
from attnlab.search.sorted import SortedScalarIndex, sorted_select, sorted_select_naive, split_budget
from attnlab.testing import rel_rms


def causal(T, Tq=None):
    Tq = T if Tq is None else Tq
    return (torch.arange(T) <= torch.arange(T - Tq, T)[:, None])[None, None]


def chosen(idx, valid):
    B, G, Tq, _ = idx.shape
    return [[[set(idx[b, g, t][valid[b, g, t]].tolist()) for t in range(Tq)] for g in range(G)] for b in range(B)]


def keys(kind, B, G, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    if kind == "distinct":
        return torch.randn(B, G, T, generator=g), torch.randn(B, G, T, generator=g)
    # few distinct values: most distances tie, and a query can sit halfway between two keys
    return (torch.randint(0, 4, (B, G, T), generator=g).float() + 0.5 * torch.randint(0, 2, (B, G, T), generator=g),
            torch.randint(0, 4, (B, G, T), generator=g).float())


@pytest.mark.parametrize("kind", ["distinct", "ties"])
@pytest.mark.parametrize("K,n_sink,ring", [(8, 2, None), (12, 0, 3), (16, 4, 0), (40, 4, None)],
                         ids=["8-sink2", "12-nosink", "16-noring", "40-every-key"])
def test_whole_matrix_rule_is_the_reference(kind, K, n_sink, ring):
    qs, ks = keys(kind, 2, 3, 37)
    ref = chosen(*sorted_select_naive(qs, ks, causal(37), K, n_sink, ring))
    got_idx, got_valid = sorted_select(qs, ks, causal(37), K, n_sink, ring)
    assert chosen(got_idx, got_valid) == ref
    assert all(len(s) == min(t + 1, K) for row in ref for sets in row for t, s in enumerate(sets))


def test_whole_matrix_rule_follows_document_blocks():
    seg = torch.tensor([0] * 20 + [1] * 17)
    allowed = (causal(37)[0, 0] & (seg[None, :] == seg[:, None]))[None, None]
    qs, ks = keys("ties", 1, 2, 37, seed=3)
    ref = sorted_select_naive(qs, ks, allowed, 8, 2)
    assert chosen(*sorted_select(qs, ks, allowed, 8, 2)) == chosen(*ref)
    assert min(min(s) for s in chosen(*ref)[0][0][20:]) >= 20  # the second document reads only itself


@pytest.mark.parametrize("kind", ["distinct", "ties"])
@pytest.mark.parametrize("K,n_sink,ring", [(8, 2, None), (16, 4, 4), (24, 0, 0)])
def test_sorted_array_steps_choose_the_reference_keys(kind, K, n_sink, ring):
    """A prefill of 300 keys into the array, then 80 decode steps one key at a time (the array's
    buffer flushes and levels merge on the way): each step's keys are the reference's."""
    T, P = 380, 300
    qs, ks = keys(kind, 1, 3, T, seed=1)
    ref = chosen(*sorted_select_naive(qs, ks, causal(T), K, n_sink, ring))
    index = SortedScalarIndex(n_sink, ring)
    index.add(ks[..., :P])
    idx, valid = index.grow_and_search(qs[..., P:], ks[..., P:], causal(T, T - P), K)
    assert chosen(idx, valid) == [[sets[P:] for sets in row] for row in ref]
    assert index.ntotal == T and index.reads > 0


def test_a_step_reads_a_few_hundred_entries_of_thousands():
    """O(log N + K) per step plus the unsorted insertion buffer (at most 256 entries), not N."""
    T, P = 6000, 5980
    qs, ks = keys("distinct", 1, 3, T, seed=2)
    index = SortedScalarIndex(4)
    index.add(ks[..., :P])
    idx, valid = index.grow_and_search(qs[..., P:], ks[..., P:], causal(T, T - P), 32)
    ref = sorted_select_naive(qs[..., P:], ks, causal(T, T - P), 32)
    assert chosen(idx, valid) == chosen(*ref)
    assert index.reads / (T - P) < 400


def test_a_fresh_sequence_or_another_mask_goes_through_the_whole_matrix():
    qs, ks = keys("distinct", 1, 2, 50)
    index = SortedScalarIndex(2)
    got = index.grow_and_search(qs, ks, causal(50), 10)
    assert chosen(*got) == chosen(*sorted_select_naive(qs, ks, causal(50), 10, 2))


def test_budget_split():
    assert split_budget(64, 4, None) == (4, 16, 44)
    assert split_budget(64, 4, 10) == (4, 10, 50)
    with pytest.raises(ValueError, match="no key to choose by distance"):
        split_budget(8, 4, 4)
    with pytest.raises(ValueError, match="no key to choose by distance"):
        SelectorConfig("sorted", K=4)


def test_distance_projections_rank_and_weigh_keys_by_the_squared_distance():
    torch.manual_seed(0)
    proj = SearchProjections([0, 2], 16, d_search=1, tau=0.5, groups=2, score="distance")
    h = torch.randn(2, 9, 16)
    qa, ka = proj(0, h)  # (B, G, T, 2): [2q, -1], [k, k^2]
    q, k = proj.raw(0, h)  # (B, G, T, 1)
    assert qa.shape == (2, 2, 9, 2) and q.shape == (2, 2, 9, 1)
    want = torch.softmax(-(q - k.transpose(-1, -2)).square() / 0.5, -1)  # (B, G, T, T)
    got = torch.softmax(qa @ ka.transpose(-1, -2) / 0.5, -1)
    assert rel_rms(got, want) < 1e-5
    # the training losses see exactly the Gaussian kernel's softmax: against it as teacher, L_KL is 0
    allowed = torch.ones(4, 9, 9, dtype=torch.bool)
    nce, kl = search_losses(qa.flatten(0, 1), ka.flatten(0, 1), want.flatten(0, 1), allowed, 0.5, k_pos=3)
    assert abs(float(kl.detach())) < 1e-4
    ref = search_losses(qa.flatten(0, 1), ka.flatten(0, 1), want.flatten(0, 1), allowed, 0.5, 3, impl="naive")
    assert torch.allclose(torch.stack([nce, kl]), torch.stack(list(ref)), atol=1e-4)


def test_distance_projections_save_and_load_with_their_score(tmp_path):
    proj = SearchProjections([1], 8, d_search=1, groups=3, score="distance")
    proj.save(tmp_path / "p.safetensors")
    back, meta, _ = SearchProjections.load(tmp_path / "p.safetensors")
    assert (back.score, back.d_search, back.groups, meta["score"]) == ("distance", 1, 3, "distance")
    h = torch.randn(1, 5, 8)
    assert all(torch.equal(a, b) for a, b in zip(back(1, h), proj(1, h)))
    with pytest.raises(ValueError, match="takes no rope"):
        SearchProjections([1], 8, d_search=2, score="distance", rope=True)
    with pytest.raises(ValueError, match="score must be one of"):
        SearchProjections([1], 8, score="cosine")


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama", n_layers=4)


def test_sorted_needs_a_one_dimensional_distance_space(lm):
    dot = SearchProjections([1, 2], lm.dims.d_model, 8, groups=lm.dims.n_kv_heads)
    with pytest.raises(ValueError, match="one-dimensional distance space"):
        substitute(lm.model, [1, 2], SelectorConfig("sorted", K=16, groups=lm.dims.n_kv_heads), dot)
    with pytest.raises(ValueError, match="needs trained search projections"):
        substitute(lm.model, [1, 2], SelectorConfig("sorted", K=16, groups=lm.dims.n_kv_heads))


def test_sorted_in_a_model_after_an_exact_prefill(lm):
    """Every key read (K at least the context) is full attention; a small budget changes the logits,
    and the sorted array serves every step of the continuation."""
    G = lm.dims.n_kv_heads
    torch.manual_seed(0)
    proj = SearchProjections([1, 2], lm.dims.d_model, 1, groups=G, score="distance")
    ids = torch.randint(3, 250, (1, 120))
    contexts = [("full", lambda: __import__("contextlib").nullcontext())]
    for K in (16, 256):
        cfg = SelectorConfig("sorted", K=K, groups=G, n_sink=2)
        contexts.append((K, lambda cfg=cfg: substitute(lm.model, [1, 2], cfg, proj)))
    got, _ = prefilled_logits(lm.model, [1, 2], ids, 100, 20, contexts)
    assert rel_rms(got[256][0], got["full"][0]) < 1e-5
    assert rel_rms(got[16][0], got["full"][0]) > 1e-4


def test_search_tasks_run_the_sorted_selection_from_its_checkpoint(lm, tmp_path):
    """`attnlab search tasks --methods full,sorted --checkpoint ONE_D.safetensors --prefill full`: at a
    budget covering the whole prompt every answer is full attention's; a dot-product checkpoint, or
    the learned methods beside sorted in one run, are refused before any weights load."""
    from attnlab.search.tasks import TaskConfig, plan_tasks, run_tasks

    G = lm.dims.n_kv_heads
    torch.manual_seed(0)
    SearchProjections([1, 2], lm.dims.d_model, 1, groups=G, score="distance", meta={"model": "tiny"}).save(
        tmp_path / "sorted.safetensors")
    SearchProjections([1, 2], lm.dims.d_model, 8, groups=G, meta={"model": "tiny"}).save(tmp_path / "dot.safetensors")
    common = dict(model="tiny", tasks=["passkey"], lengths=[256], depths=[0.5], n_examples=1, layer_set="1,2",
                  groups="kv", prefill="full")
    res = run_tasks(TaskConfig(**common, checkpoint=str(tmp_path / "sorted.safetensors"), methods=["full", "sorted"],
                               ks=[16, 256], out=str(tmp_path / "out")), lm, progress=False)
    rows = {(r["method"], r["K"]): r for r in res["rows"]}
    assert rows["sorted", 256]["token_accuracy"] == rows["full", None]["token_accuracy"]
    with pytest.raises(ValueError, match="sorted method needs d_search=1"):
        plan_tasks(TaskConfig(**common, checkpoint=str(tmp_path / "dot.safetensors"), methods=["sorted"], ks=[16],
                              out=str(tmp_path / "o2")), lm)
    with pytest.raises(ValueError, match="read different projections"):
        TaskConfig(**common, checkpoint=str(tmp_path / "sorted.safetensors"), methods=["learned", "sorted"], ks=[16],
                   out=str(tmp_path / "o3"))
