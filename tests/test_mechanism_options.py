"""Each mechanism's own options dataclass (`attnlab.layers.options`): one name per option, taken by
`AttentionConfig(...)`, TOML and the command line alike; errors name the key; the shared fields stay in
AttentionConfig."""

from __future__ import annotations

import dataclasses

import pytest

from attnlab.layers import (
    MECHANISMS, AttentionConfig, GoatHybridOptions, GoatOptions, HybridOptions, ScalarOptions, mechanism_class,
)
from attnlab.layers.config import SHARED_FIELDS, option_keys
from attnlab.models import ModelConfig
from attnlab.models.config import ConfigError, build_dataclass


def test_every_key_has_one_type_and_one_default_and_no_option_shadows_a_shared_field():
    shared = {f.name for f in dataclasses.fields(AttentionConfig)}
    seen: dict[str, tuple] = {}
    for m in MECHANISMS:
        opts = mechanism_class(m).Options
        if opts is None:
            continue
        for key, hint in opts.hints().items():
            assert key not in shared, (m, key)
            got = (hint, opts.defaults()[key])
            assert seen.setdefault(key, got) == got, (m, key, seen[key], got)
    keys = option_keys()
    assert set(seen) <= set(keys) and set(SHARED_FIELDS) <= set(keys) and "options" not in keys


def test_mechanisms_without_options_hold_none_and_the_rest_their_class():
    for m in MECHANISMS:
        cls = mechanism_class(m)
        c = AttentionConfig(128, 4, m)  # head_dim 32: room for GOAT's default prior (2R + 1 = 17)
        assert (c.options is None) == (cls.Options is None) and (c.options is None or type(c.options) is cls.Options)
        assert cls.options == (*cls.uses, *(cls.Options.keys() if cls.Options else ()))


@pytest.mark.parametrize("mechanism, flat, options", [
    ("scalar", {"tau": "global", "n_scalar_heads": 2, "kernel": "cauchy"},
     ScalarOptions(tau="global", n_scalar_heads=2, kernel="cauchy")),
    ("hybrid", {"sink": True, "sink_weight": 0.0, "scalar_gain": 0.5}, HybridOptions(sink=True, sink_weight=0.0, scalar_gain=0.5)),
    ("goat", {"goat_rank": 4, "goat_width": "extra", "goat_rope": True}, GoatOptions(goat_rank=4, goat_width="extra", goat_rope=True)),
    ("goat_hybrid", {"goat_rank": 3, "tau_init": 0.5}, GoatHybridOptions(goat_rank=3, tau_init=0.5)),
])
def test_flat_keys_build_the_config_the_options_object_builds(mechanism, flat, options):
    by_keys = AttentionConfig(64, 4, mechanism, **flat)
    by_object = AttentionConfig(64, 4, mechanism, options=options)
    assert by_keys == by_object
    assert {k: by_keys.flat()[k] for k in flat} == flat
    assert dataclasses.replace(by_keys, impl="naive").options == by_keys.options  # replace keeps the options


def test_keys_on_top_of_an_options_object_and_the_object_left_as_it_was():
    given = ScalarOptions(tau="global")
    c = AttentionConfig(64, 4, "scalar", options=given, tau_init=0.3)
    assert c.options.tau == "global" and c.options.tau_init == 0.3 and c.options.n_scalar_heads == 4
    assert given == ScalarOptions(tau="global")  # configure filled the config's copy, not the caller's


@pytest.mark.parametrize("kw, match", [
    ({"mechanism": "goat", "goat_rank": True}, r"^AttentionConfig\.goat_rank: got True, need an int"),
    ({"mechanism": "goat", "goat_width": "wide"}, r"^AttentionConfig\.goat_width: got 'wide', need one of"),
    ({"mechanism": "gla", "gla_normalizer": 0}, r"^AttentionConfig\.gla_normalizer: got 0, need a number > 0"),
    ({"mechanism": "cosformer", "cosformer_max_len": 0}, r"^AttentionConfig\.cosformer_max_len: got 0, need an int >= 1"),
    ({"mechanism": "principled", "v0": "one"}, r"^AttentionConfig\.v0: got 'one', need one of"),
    ({"mechanism": "hybrid", "tau_max": 0.05}, r"^AttentionConfig\.tau_max: got 0\.05, need a value > tau_init=0\.1"),
    ({"mechanism": "goat_hybrid", "sink": True}, r"^AttentionConfig\.sink: got True, need no value: mechanism 'goat_hybrid'"),
    ({"mechanism": "softmax", "goat_rank": 4}, r"^AttentionConfig\.goat_rank: got 4, need no value: mechanism 'softmax'"),
    ({"mechanism": "hybrid", "n_scalar_heads": 2}, r"^AttentionConfig\.n_scalar_heads: got 2, need no value"),
    ({"mechanism": "goat", "options": ScalarOptions()}, r"^AttentionConfig\.options: got ScalarOptions\(.*need a GoatOptions"),
    ({"mechanism": "softmax", "options": ScalarOptions()}, r"^AttentionConfig\.options: .*need None: mechanism 'softmax' has no"),
])
def test_a_bad_option_is_a_value_error_naming_its_key(kw, match):
    with pytest.raises(ValueError, match=match):
        AttentionConfig(64, 4, **kw)


def test_an_unknown_keyword_is_a_type_error_and_a_default_of_another_mechanism_is_no_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'goat_ranks'"):
        AttentionConfig(64, 4, "goat", goat_ranks=4)
    assert AttentionConfig(64, 4, "softmax", tau="head", goat_rank=8) == AttentionConfig(64, 4, "softmax")


def test_toml_tables_keep_their_flat_keys_and_errors_name_them():
    raw = {"d_model": 64, "n_heads": 4, "n_layers": 2, "attn": ["goat", "hybrid"],
           "layer_attention": [{"goat_rank": 4}, {"sink": True, "tau": "global"}]}
    goat, hyb = build_dataclass(ModelConfig, raw, "model.").attention_configs()
    assert goat.options.goat_rank == 4 and hyb.options.sink and hyb.options.tau == "global"
    raw["layer_attention"][0]["goat_rank"] = 40  # 2R + 1 past head_dim 16
    with pytest.raises(ConfigError, match=r"model\.layer_attention\[0\]\.goat_rank"):
        build_dataclass(ModelConfig, raw, "model.")


def test_the_signature_gives_every_shared_field_its_fields_default():
    import inspect

    params = inspect.signature(AttentionConfig).parameters
    for f in dataclasses.fields(AttentionConfig):
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert params[f.name].default == want, f.name
