"""attnlab.hf's model, config and tokenizers: save_pretrained / from_pretrained through the Auto
classes reproduce attnlab's logits for every registered mechanism and a per-layer list; the
tokenizers give attnlab's ids; padded forwards (left: as each row alone; right: exact) and the
loss follow transformers' conventions; bad configs are named errors."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import attnlab.hf as H  # noqa: E402
from attnlab.data.tokenizer import ByteTokenizer, train_bpe  # noqa: E402
from attnlab.models import LM, MECHANISMS, ModelConfig  # noqa: E402
from attnlab.testing import rel_rms  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V = 257


def tiny(attn="softmax", **kw) -> LM:
    kw.setdefault("max_seq_len", 32)
    names = attn if isinstance(attn, list) else [attn]
    if any(a.startswith("goat") for a in names):
        kw.setdefault("attention", {"goat_rank": 2})
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=V, d_model=32, n_layers=len(names) if len(names) > 1 else 2, n_heads=4,
                          attn=attn, **kw)).eval()


def exported(lm, tmp_path, tokenizer=None, **kw):
    H.export.save_folder(lm, tmp_path, tokenizer or ByteTokenizer(), **kw)
    return AutoModelForCausalLM.from_pretrained(tmp_path).eval()


@pytest.mark.parametrize("attn", [*MECHANISMS, ["softmax", "hybrid", "gla", "goat"]], ids=[*MECHANISMS, "per-layer"])
def test_round_trip_reproduces_attnlab_logits(attn, tmp_path):
    lm = tiny(attn)
    if "hybrid" in attn:  # learned parameters away from their init, as after training
        with torch.no_grad():
            for p in lm.parameters():
                p.add_(0.01 * torch.randn_like(p))
    hf = exported(lm, tmp_path)
    assert type(hf) is H.AttnlabForCausalLM and hf.config.attn == attn
    idx = torch.randint(V, (2, 13))
    with torch.no_grad():
        assert rel_rms(hf(idx).logits, lm(idx)[0]) <= 1e-6
    assert {k: v for k, v in hf.model.state_dict().items()}.keys() == lm.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(hf.model.state_dict().values(), lm.state_dict().values()))
    assert AutoConfig.from_pretrained(tmp_path).model_config() == lm.cfg


def test_untied_head_and_learned_positions_round_trip(tmp_path):
    lm = tiny("scalar", tie_embeddings=False, pos_embedding="learned", max_seq_len=16)
    hf = exported(lm, tmp_path)
    assert hf.model.head.weight is not hf.model.tok_emb.weight and not hf.config.tie_word_embeddings
    idx = torch.randint(V, (1, 16))
    with torch.no_grad():
        assert rel_rms(hf(idx).logits, lm(idx)[0]) <= 1e-6
    tied = exported(tiny(), tmp_path / "tied")
    assert tied.model.head.weight is tied.model.tok_emb.weight


def test_byte_tokenizer_loads_with_auto_tokenizer(tmp_path):
    exported(tiny(), tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "déf f(x):\n\treturn x ≠ 0  # ok\r\n"
    ids = tok(text)["input_ids"]
    assert ids == ByteTokenizer().encode(text) and tok.decode(ids) == text
    assert tok.eos_token_id == tok.pad_token_id == ByteTokenizer.eos_id and tok.padding_side == "left"
    assert tok.convert_ids_to_tokens(256) == "<|endoftext|>"
    batch = tok(["ab", "abcd"], padding=True, return_tensors="pt")
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_bpe_tokenizer_loads_with_auto_tokenizer(tmp_path):
    bpe = train_bpe(["def add(a, b):\n    return a + b\n"] * 20 + ["class Box: pass\n"] * 5, 300)
    lm = tiny()
    exported(lm, tmp_path, tokenizer=bpe)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "def add(x, y):\n    return Box()"
    assert tok(text)["input_ids"] == bpe.encode(text) and tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token_id == tok.pad_token_id == bpe.eos_id == 0


def test_padded_forward_without_cache(tmp_path):
    """Left padding: each row's real tokens get the logits of the row alone (zeros at pads).
    Right padding: the real positions are exact (causal). Pads between real tokens: an error."""
    lm = tiny(["hybrid", "gla"])
    hf = exported(lm, tmp_path)
    a, b = torch.randint(V, (3,)), torch.randint(V, (5,))
    left = torch.stack([torch.cat([torch.full((2,), 256), a]), b])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = hf(left, attention_mask=mask).logits
        assert rel_rms(logits[0, 2:], lm(a[None])[0][0]) < 1e-5 and bool((logits[0, :2] == 0).all())
        assert rel_rms(logits[1], lm(b[None])[0][0]) < 1e-5
        right = torch.stack([torch.cat([a, torch.full((2,), 256)]), b])
        logits = hf(right, attention_mask=mask.flip(1)).logits
        assert rel_rms(logits[0, :3], lm(a[None])[0][0]) < 1e-6
        with pytest.raises(ValueError, match=r"row 0 has a pad \(0\) between real tokens"):
            hf(right, attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]]))


def test_labels_loss_and_logits_to_keep(tmp_path):
    lm = tiny()
    hf = exported(lm, tmp_path)
    idx = torch.randint(V, (2, 9))
    labels = idx.clone()
    labels[0, :3] = -100
    with torch.no_grad():
        out = hf(idx, labels=labels)
        targets = labels[:, 1:]
        ref = torch.nn.functional.cross_entropy(lm(idx)[0][:, :-1].reshape(-1, V), targets.reshape(-1), ignore_index=-100)
        assert float(out.loss) == pytest.approx(float(ref), rel=1e-6)
        assert torch.equal(out.loss, lm(idx, torch.nn.functional.pad(targets, (0, 1), value=-100))[1])  # LM's own loss
        assert rel_rms(hf(idx, logits_to_keep=1).logits, out.logits[:, -1:]) < 1e-6
        cached = hf(idx, use_cache=True)
        assert isinstance(cached.past_key_values, H.AttnlabCache) and cached.past_key_values.get_seq_length() == 9
        assert rel_rms(cached.logits, out.logits) < 1e-5
        nxt = hf(idx[:, :1], past_key_values=cached.past_key_values).logits  # one more step
        assert rel_rms(nxt[:, 0], lm(torch.cat([idx, idx[:, :1]], 1))[0][:, -1]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_loss_is_the_lms_and_takes_num_items_in_batch(dtype):
    """The loss of a forward with labels is, bit for bit, the LM's loss of the shifted labels (in >= float32,
    float64 kept), with a cache too; given num_items_in_batch (transformers' Trainer, gradient
    accumulation) it is the summed token loss over that count, so micro-batches add up to the batch's mean."""
    from attnlab.models.lm import token_loss

    lm = tiny("hybrid").to(dtype)
    hf = H.AttnlabForCausalLM(H.AttnlabConfig.from_model_config(lm.cfg)).to(dtype).eval()
    hf.model.load_state_dict(lm.state_dict())
    idx = torch.randint(V, (4, 11))
    labels = idx.clone()
    labels[0, :4] = -100
    targets = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with torch.no_grad():
        loss = hf(idx, labels=labels).loss
        assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert torch.equal(loss, lm(idx, targets)[1]) and torch.equal(loss, token_loss(lm(idx)[0], targets))
        assert torch.equal(hf(idx, labels=labels, use_cache=True).loss, token_loss(hf(idx, use_cache=True).logits, targets))
        n = int((targets != -100).sum())
        parts = [hf(idx[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=torch.tensor(n)).loss for i in (0, 2)]
        summed = token_loss(lm(idx)[0], targets, num_items_in_batch=1)
        assert float(sum(parts)) == pytest.approx(float(loss), rel=1e-5 if dtype != torch.float64 else 1e-12)
        assert float(summed) == pytest.approx(float(loss) * n, rel=1e-5 if dtype != torch.float64 else 1e-12)


def test_config_fields_come_from_model_config(tmp_path):
    """AttnlabConfig's fields are ModelConfig's, with its defaults (no arguments: ModelConfig()'s);
    they survive save_pretrained / from_pretrained, and the diff dict keeps what differs."""
    import dataclasses

    plain = H.AttnlabConfig()
    for f in dataclasses.fields(ModelConfig):
        if f.init:
            assert getattr(plain, f.name) == getattr(ModelConfig(), f.name), f.name
    assert plain.window is None and plain.hidden_size == 64 and plain.model_config() == ModelConfig()
    cfg = H.AttnlabConfig(vocab_size=V, attn=("softmax", "hybrid"), attention={"sink": True}, layer_attention=None,
                          window=8, hidden_size=48)
    assert cfg.attn == ["softmax", "hybrid"] and cfg.layer_attention == [] and cfg.d_model == 48
    cfg.save_pretrained(tmp_path)
    back = AutoConfig.from_pretrained(tmp_path)
    mine = {k: v for k, v in cfg.to_dict().items() if k != "_name_or_path"}
    assert {k: v for k, v in back.to_dict().items() if k != "_name_or_path"} == mine
    assert back.model_config() == cfg.model_config() and back.window == 8
    diff = cfg.to_diff_dict()
    assert diff["vocab_size"] == V and diff["window"] == 8 and diff["attn"] == ["softmax", "hybrid"]
    shared = {"sink": True}
    made = H.AttnlabConfig(vocab_size=V, attn="hybrid", attention=shared)
    made.attention["sink"] = False
    assert shared == {"sink": True}  # the config holds its own copy
    with pytest.raises(TypeError):
        H.AttnlabConfig(V)  # keywords only


def test_bad_configs_and_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match=r"model.attn\[1\] must be one of"):
        H.AttnlabConfig(vocab_size=V, attn=["softmax", "nope"])
    with pytest.raises(ValueError, match="model.n_heads"):
        H.AttnlabConfig(vocab_size=V, n_heads=0)
    with pytest.raises(ValueError, match="window"):
        H.AttnlabConfig(vocab_size=V, window=0)
    hf = exported(tiny(), tmp_path)
    with pytest.raises(ValueError, match="inputs_embeds"):
        hf(inputs_embeds=torch.zeros(1, 2, 32))
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        hf(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.ones(1, 2))


@pytest.mark.heavy
def test_import_attnlab_needs_no_transformers():
    import subprocess
    import sys

    code = ("import sys; sys.modules['transformers'] = None\n"
            "import attnlab, attnlab.models, attnlab.layers, attnlab.cache, attnlab.cli\n"
            "assert 'attnlab.hf' not in sys.modules\n"
            "try:\n    import attnlab.hf\nexcept ImportError as e:\n    print('needs', e.name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "needs transformers" in out.stdout


@pytest.mark.heavy
def test_exported_model_compiles_fullgraph(tmp_path):
    """torch.compile(fullgraph=True) of an exported model with a softmax, a scalar and a hybrid layer
    (a graph break raises): the training forward with labels gives the eager logits, loss and gradients."""
    hf = exported(tiny(["softmax", "scalar", "hybrid"]), tmp_path)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(hf, fullgraph=True, backend="aot_eager")
        got = compiled(input_ids=idx, labels=idx, use_cache=False)
        got.loss.backward()
        grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
        hf.zero_grad(set_to_none=True)
        want = hf(input_ids=idx, labels=idx, use_cache=False)
        want.loss.backward()
    finally:
        torch._dynamo.reset()
    assert rel_rms(got.logits, want.logits) < 1e-6 and abs(float(got.loss.detach() - want.loss.detach())) < 1e-6
    assert all(rel_rms(grads[n], p.grad) < 1e-5 for n, p in hf.named_parameters())
