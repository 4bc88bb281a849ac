"""What a log row says about the machine: model FLOPs utilisation (MFU) and peak memory.

MFU is the fraction of the device's peak throughput that the model's own arithmetic would use
at the measured tokens/s (PaLM, appendix B; nanoGPT's `estimate_mfu`). It counts the FLOPs the
model needs, not the ones the run spends: recomputed activations (train.checkpoint_activations)
and padding are not in it. On the CPU there is no peak figure to divide by, so MFU is None there
(null in log.jsonl, empty in train.csv, left out of TensorBoard, W&B and MLflow).
"""

from __future__ import annotations

import sys

import torch

try:
    import resource
except ImportError:  # not on Windows: no peak RSS there
    resource = None

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, FLOP/s per GPU. The first
# entry whose words all appear in torch.cuda.get_device_name() wins, so variants come before the
# plain name: "NVIDIA H100 80GB HBM3" is the SXM part, "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" not.
PEAK_BF16_FLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200", "NVL"), 835.5e12),
    (("H200",), 989.5e12),
    (("H100", "NVL"), 835.5e12),
    (("H100", "PCIe"), 756.5e12),
    (("H100",), 989.5e12),
    (("A100",), 312e12),
)


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token of `model` (an attnlab LM) at sequence length `seq_len`:

        6 N + 12 * sum over layers of (n_heads * head_dim) * T

    N counts the parameters that multiply activations: every parameter except the position table
    and the token embedding, which is a lookup; a head tied to the embedding is counted once, as
    the head's matmul (nanoGPT's count). 6 N is the forward (2 N) and backward (4 N) of those
    matmuls; the second term is the q·k scores and the weighted sum of v, 2 * 2 * H * D * T per
    layer forward, times 3 with the backward, counted over the full T as PaLM and nanoGPT count
    it (not T / 2 for the causal mask). It is the dense softmax count for every mechanism, so the
    MFU of runs with different attention is comparable; for linear, windowed or sorted-scalar
    layers it is more work than those layers do."""
    cfg = model.cfg
    n = model.num_params()
    if cfg.pos_embedding == "learned":
        n -= cfg.max_seq_len * cfg.d_model
    if not cfg.tie_embeddings:  # the embedding is only a lookup; the head is its own matmul
        n -= cfg.vocab_size * cfg.d_model
    attn = sum(a.n_heads * a.head_dim for a in cfg.attention_configs())
    return 6.0 * n + 12.0 * attn * seq_len


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, from PEAK_BF16_FLOPS by device name; None on the CPU
    and on a GPU not in the table. The bf16 figure whatever train.dtype is: a float32 run (TF32 at
    best, half that peak) reads as a lower MFU, which it is."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for words, flops in PEAK_BF16_FLOPS:
        if all(w in name for w in words):
            return flops
    return None


def peak_memory_gib(device: torch.device) -> float | None:
    """The run's peak memory in GiB so far: on CUDA the most tensor memory the caching allocator has
    held (torch.cuda.max_memory_allocated); on the CPU the process's maximum resident set size
    (weights, activations, the data and the Python process itself). None where neither is known."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if device.type != "cpu" or resource is None:
        return None
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**30 * (1 if sys.platform == "darwin" else 1024)  # macOS reports bytes, Linux KiB


class Throughput:
    """The speed figures of one run's log rows. `add(seconds, tokens)` after each step; `row()` at a log
    row gives {"tokens_per_s", "mfu", "peak_mem_gib"} over the steps since the previous row and starts
    the next window; `seconds` and `tokens` are the totals so far.

    Tokens are global (every data-parallel rank's), so the peak is that of all `world_size` devices.
    Reads host-side counters only: no device sync."""

    def __init__(self, model: torch.nn.Module, seq_len: int, device: torch.device, world_size: int = 1):
        self.device = device
        self.flops_per_token = flops_per_token(model, seq_len)
        peak = peak_flops(device)
        self.peak = None if peak is None else peak * world_size
        self.seconds, self.tokens = 0.0, 0
        self._window = [0.0, 0]

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds += seconds
        self.tokens += tokens
        self._window[0] += seconds
        self._window[1] += tokens

    def row(self) -> dict:
        seconds, tokens = self._window
        self._window = [0.0, 0]
        tokens_per_s = tokens / max(seconds, 1e-9)
        mfu = None if self.peak is None else self.flops_per_token * tokens_per_s / self.peak
        return {"tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_gib": peak_memory_gib(self.device)}
