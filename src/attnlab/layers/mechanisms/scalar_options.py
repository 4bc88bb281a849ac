"""The options of the scalar family (`attnlab.layers.options`): the temperature that goat_hybrid shares,
the scalar keys' options of scalar and hybrid, and what each of the two adds.

    TemperatureOptions ─> ScalarKeyOptions ─> ScalarOptions   (mechanism "scalar")
                                          └─> HybridOptions   (mechanism "hybrid")
    TemperatureOptions ─> goat_hybrid's options (layers/mechanisms/goat_hybrid.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...ops.scalar import KERNELS
from ..options import MechanismOptions
from ..params import TAU_PARAMS

TAU_MODES = ("global", "head", "token")


@dataclass
class TemperatureOptions(MechanismOptions):
    """The scalar heads' temperature τ.

    Args:
        tau: the temperature form, "global" (one τ), "head" (one per head) or "token" (one per head
            and token, from the input). Kept positive.
        tau_init: τ at initialisation (> 1e-6).
        tau_param: "softplus" (τ = 1e-6 + softplus(raw)) or "log" (τ = 1e-6 + exp(raw)): the
            parameter the optimizer moves; in log space a step changes τ relatively.
        tau_max: optional upper cap: τ = 1e-6 + (tau_max − 1e-6)·sigmoid(raw), smooth, ≤ tau_max
            (> tau_init).
    """

    tau: str = "head"
    tau_init: float = 0.1
    tau_param: str = "softplus"
    tau_max: float | None = None

    def check(self, config) -> None:
        if self.tau not in TAU_MODES:
            raise config.error("tau", self.tau, f"one of {TAU_MODES}")
        if not self.tau_init > 1e-6:
            raise config.error("tau_init", self.tau_init, "a number > 1e-6 (the floor that keeps τ positive)")
        if self.tau_param not in TAU_PARAMS:
            raise config.error("tau_param", self.tau_param, f"one of {TAU_PARAMS}")
        if self.tau_max is not None:
            config.require_positive("tau_max")
            if not self.tau_init < self.tau_max:
                raise config.error("tau_max", self.tau_max, f"a value > tau_init={self.tau_init}")


@dataclass
class ScalarKeyOptions(TemperatureOptions):
    """The scalar keys of scalar and hybrid heads: their kernel, sink and trained window.

    Args:
        sink: add a learned sink: one extra key, visible to every query, with fixed scalar key
            `sink_key` (and a zero vector key for hybrid heads) and a learned value per value group.
        sink_key: the sink's scalar key.
        sink_weight: with sink: None (default; the sink's term in the normaliser is e^score like
            any key's), or a learned per-head weight w on that term, w·e^score, starting at this
            value (>= 0; the layer uses |w|). 0.0 starts with no sink mass and a nonzero gradient
            on w (docs/retrofit.md#the-sink).
        train_window: None (default: exact attention), or k: every scalar/hybrid head reads only
            each query's k nearest keys in scalar space (newest first among equal distances), the
            sink, and the local window: what the sorted cache decodes with, in training too
            (ops.windowed_attention, O(T·k) memory). Decoding then defaults to the sorted cache
            with window k. Not with impl "approx" nor with sliding_window.
        local_window: with train_window: the last w keys are always read (a ring buffer in
            decoding) and the k nearest are taken among the older keys (default 0).
        kernel: the scalar term's kernel, "gaussian" (default, −(qs − ks)²/τ) or "cauchy"
            (−log(1 + (qs − ks)²/τ), weights 1/(1 + (qs − ks)²/τ), heavier-tailed as in ZETA).
            Both select the same nearest keys, so the sorted cache and train_window carry over;
            "cauchy" has no fused path (query chunks; docs/mechanisms.md). Not with impl "approx".
    """

    sink: bool = False
    sink_key: float = 0.0
    sink_weight: float | None = None
    train_window: int | None = None
    local_window: int = 0
    kernel: str = "gaussian"

    def check(self, config) -> None:
        super().check(config)
        if self.sink_weight is not None:
            if not 0 <= self.sink_weight < math.inf:
                raise config.error("sink_weight", self.sink_weight,
                                   "a finite number >= 0 (the sink's weight in the normaliser) or None")
            if not self.sink:
                raise config.error("sink_weight", self.sink_weight, "None unless sink is true (it weighs the sink's term)")
        if self.train_window is not None:
            config.require_int("train_window")
            if config.impl == "approx":
                raise config.error("train_window", self.train_window, "None with impl='approx' (the window is its own selection)")
            if config.sliding_window is not None:
                raise config.error("sliding_window", config.sliding_window,
                                   f"None with train_window={self.train_window} (the window's local part is local_window)")
        config.require_int("local_window", 0)
        if self.kernel not in KERNELS:
            raise config.error("kernel", self.kernel, f"one of {KERNELS}")
        if self.kernel != "gaussian" and config.impl == "approx":
            raise config.error("kernel", self.kernel, "'gaussian' with impl='approx' (the approximation is the Gaussian's)")
        if self.local_window and self.train_window is None:
            raise config.error("local_window", self.local_window, "0 unless train_window is set (the ring beside the window)")


@dataclass
class ScalarOptions(ScalarKeyOptions):
    """Mechanism "scalar"'s options: the scalar keys' (`ScalarKeyOptions`) and its head layout.

    Args:
        n_scalar_heads: how many of the H heads are scalar heads (derived: all). The other
            H - n_scalar_heads heads are standard softmax dot-product heads, and the head outputs are
            concatenated: the proposal's hybrid architecture.
        n_value_groups: G, value groups read by the scalar heads (grouped value attention; head h
            reads group h // (H_s / G)); must divide n_scalar_heads (derived: one group per scalar
            head). For "hybrid", use n_kv_heads instead.
    """

    n_scalar_heads: int | None = None
    n_value_groups: int | None = None


@dataclass
class HybridOptions(ScalarKeyOptions):
    """Mechanism "hybrid"'s options: the scalar keys' (`ScalarKeyOptions`) and the scalar term's gain.

    Args:
        scalar_gain: None (default), or a learned per-head scale λ on the scalar term,
            q·k/√d − λ(qs − ks)²/τ, starting at this value. 0.0 starts exactly at standard attention
            with a nonzero gradient on λ (docs/retrofit.md).
    """

    scalar_gain: float | None = None


__all__ = ["HybridOptions", "ScalarKeyOptions", "ScalarOptions", "TAU_MODES", "TemperatureOptions"]
