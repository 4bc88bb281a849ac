"""attnlab.testing: rel_rms and compare_fwd_bwd see every output of a tuple (forward values and the
gradients that flow through each), fields of a state dataclass, exact integer outputs and shapes."""

from dataclasses import dataclass

import pytest
import torch

from attnlab.testing import compare_fwd_bwd, output_tensors, rel_rms


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64).requires_grad_()
    y = torch.randn(3, 4, generator=g, dtype=torch.float64).requires_grad_()
    return [x, y]


def test_rel_rms_hand_values():
    b = torch.tensor([3.0, 4.0])
    assert rel_rms(b * 1.5, b) == pytest.approx(0.5)
    assert rel_rms(torch.tensor([0.0, 1.0]), torch.zeros(2)) == pytest.approx(0.5 ** 0.5)  # absolute when b = 0
    assert rel_rms(torch.zeros(2), torch.zeros(2)) == 0.0


def test_single_tensor_keys_and_values():
    x, y = _inputs()
    errs = compare_fwd_bwd(lambda x, y: x.sum(1) * y.sum(1), lambda x, y: x.sum(1) * y.sum(1), [x, y])
    assert errs == {"out": 0.0, "grad0": 0.0, "grad1": 0.0}
    errs = compare_fwd_bwd(lambda x, y: 1.1 * x.sum(1) * y.sum(1), lambda x, y: x.sum(1) * y.sum(1), [x, y])
    assert [errs[k] for k in ("out", "grad0", "grad1")] == pytest.approx([0.1] * 3)
    # an input without requires_grad (or a non-tensor) gets no key
    errs = compare_fwd_bwd(lambda x, y, s: s * x.sum(1) * y.sum(1), lambda x, y, s: s * x.sum(1) * y.sum(1),
                           [x, y.detach(), 2.0])
    assert set(errs) == {"out", "grad0"}


def _pair(scale_fwd=3.0, scale_bwd=3.0):
    """(x -> 2x, y -> 3y) where the second element's value is scale_fwd * y and its gradient scale_bwd."""
    def fn(x, y):
        second = scale_bwd * y + (scale_fwd - scale_bwd) * y.detach()
        return 2.0 * x, second
    return fn


def test_tuple_outputs_are_all_compared():
    inputs = _inputs()
    errs = compare_fwd_bwd(_pair(), _pair(), inputs)
    assert set(errs) == {"out", "out1", "grad0", "grad1"} and max(errs.values()) < 1e-15


def test_catches_a_forward_difference_in_the_second_element():
    """The second element's value is off by 10 % while every gradient agrees."""
    errs = compare_fwd_bwd(_pair(scale_fwd=3.3), _pair(), _inputs())
    assert errs["out1"] == pytest.approx(0.1)
    assert errs["out"] == errs["grad0"] == 0.0 and errs["grad1"] < 1e-15


def test_catches_a_gradient_that_flows_only_through_the_second_element():
    """Same values everywhere; y reaches the loss only through the second element, whose
    backward is 4 instead of 3: only grad1 can show it."""
    errs = compare_fwd_bwd(_pair(scale_bwd=4.0), _pair(), _inputs())
    assert errs["out"] == 0.0 and errs["out1"] < 1e-15 and errs["grad0"] == 0.0
    assert errs["grad1"] == pytest.approx(1 / 3)


def test_gradients_sum_the_cotangents_of_every_element():
    """x feeds both elements: its gradient is the sum over both, so a change in the second
    element's backward shows in grad0 too."""
    def fn(k):
        return lambda x: (x.sum(1), k * x + (1.0 - k) * x.detach())
    x = _inputs()[0]
    errs = compare_fwd_bwd(fn(1.0), fn(1.0), [x])
    assert set(errs) == {"out", "out1", "grad0"} and max(errs.values()) < 1e-15
    assert compare_fwd_bwd(fn(2.0), fn(1.0), [x])["grad0"] > 0.1


@dataclass
class State:
    kv: torch.Tensor
    steps: int
    mask: torch.Tensor | None = None


def test_state_dataclass_fields_are_compared():
    def fn(kv_scale, mask_shift=0):
        def run(x, y):
            o = x * 2.0
            kv = kv_scale * y + (1.0 - kv_scale) * y.detach()  # value y, gradient kv_scale
            return o, State(kv, steps=7, mask=(torch.arange(4) + mask_shift) % 4 == 0)
        return run

    errs = compare_fwd_bwd(fn(1.0), fn(1.0), _inputs())
    assert set(errs) == {"out", "out1.kv", "out1.mask", "grad0", "grad1"}  # the int field is not a tensor
    assert max(errs.values()) < 1e-15
    bwd = compare_fwd_bwd(fn(2.0), fn(1.0), _inputs())  # the state's backward differs
    assert bwd["grad1"] == pytest.approx(1.0) and bwd["out1.kv"] < 1e-15 and bwd["grad0"] == 0.0
    assert compare_fwd_bwd(fn(1.0, mask_shift=1), fn(1.0), _inputs())["out1.mask"] == float("inf")


def test_integer_outputs_must_match_exactly_and_shapes_must_agree():
    x = _inputs()[0]
    same = compare_fwd_bwd(lambda x: (x.exp(), x.argmax(1)), lambda x: (x.exp(), x.argmax(1)), [x])
    assert same["out1"] == 0.0
    diff = compare_fwd_bwd(lambda x: (x.exp(), x.argmin(1)), lambda x: (x.exp(), x.argmax(1)), [x])
    assert diff["out1"] == float("inf") and diff["out"] == 0.0
    # a (3, 1) output against (3,) would broadcast to a plausible number: it is a mismatch
    assert compare_fwd_bwd(lambda x: x.sum(1, keepdim=True), lambda x: x.sum(1), [x])["out"] == float("inf")
    # an element only one side returns
    missing = compare_fwd_bwd(lambda x: (x.exp(), x.sin()), lambda x: x.exp(), [x])
    assert missing["out"] == 0.0 and missing["out1"] == float("inf")


def test_output_names():
    t = torch.zeros(1)
    assert list(output_tensors(t)) == ["out"]
    names = output_tensors((t, None, [t, t], State(t, 1), {"a": t}, 3.0))
    assert list(names) == ["out", "out2[0]", "out2[1]", "out3.kv", "out4[a]"]
