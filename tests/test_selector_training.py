"""Search projections for the "learned" key selector, trained on an attnlab model's own attention
(eval.selector_training): they learn a teacher worth learning, are reproducible from a seed and
reject bad input before any work."""

import pytest
import torch

from attnlab.eval.selector_training import train_selector_projections
from attnlab.eval.selectors import SelectionTally, select_keys
from attnlab.eval.window import decode_window
from attnlab.models import LM, ModelConfig
from test_window import _model  # the same tiny LMs as the selector tests

pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(T=28, B=2, seed=1):
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))


def _sharp_model():
    """A one-layer hybrid model with a sink and sharp attention: a teacher worth learning."""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, attn="hybrid", max_seq_len=64,
                      attention={"sink": True}, pos_embedding="learned")
    torch.manual_seed(0)
    model = LM(cfg).eval()
    with torch.no_grad():
        model.blocks[0].attn.wq.weight.mul_(4)
        model.blocks[0].attn.wk.weight.mul_(4)
    return model


def test_learned_projections_learn_the_model_attention():
    model = _sharp_model()
    g = torch.Generator().manual_seed(1)
    train = [torch.randint(0, 50, (8, 32), generator=g) for _ in range(4)]
    held_out = torch.randint(0, 50, (8, 32), generator=g)

    def mass(proj):
        tally = SelectionTally()
        with torch.no_grad(), select_keys(model, "learned", 4, projections=proj, tally=tally):
            model(held_out)
        return tally.mass

    start = train_selector_projections(model, train, 0, d_search=16)
    trained = train_selector_projections(model, train, 60, d_search=16)
    losses = trained.meta["losses"]
    assert len(losses) == 60 and losses[-1] < 0.7 * losses[0]
    assert mass(trained) > mass(start) + 0.1
    assert trained.groups == 2 and trained.layers == [0]


def test_learned_projections_are_reproducible_from_a_seed():
    model = _sharp_model()
    batches = [_tokens(T=24, B=4, seed=s) for s in (5, 6)]
    rng = torch.random.get_rng_state()
    a = train_selector_projections(model, batches, 6, d_search=8, seed=3)
    b = train_selector_projections(model, batches, 6, d_search=8, seed=3)
    c = train_selector_projections(model, batches, 6, d_search=8, seed=4)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the global RNG is left alone
    assert a.meta["losses"] == b.meta["losses"]
    for name, t in a.state_dict().items():
        assert torch.equal(t, b.state_dict()[name])
    assert not torch.equal(a.state_dict()["wq.0.weight"], c.state_dict()["wq.0.weight"])


def test_train_projections_bad_input():
    model = _sharp_model()
    x = _tokens(T=16, B=2)
    with pytest.raises(ValueError, match="steps"):
        train_selector_projections(model, [x], -1)
    with pytest.raises(ValueError, match=r"batches\[0\]"):
        train_selector_projections(model, [x.float()], 2)
    with pytest.raises(ValueError, match="batches"):
        train_selector_projections(model, [], 2)
    with pytest.raises(ValueError, match="model"):
        train_selector_projections(_model("softmax"), [x], 2)
    with decode_window(model, 4), pytest.raises(ValueError, match="model"):
        train_selector_projections(model, [x], 2)
