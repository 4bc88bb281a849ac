"""The route of `gla_attention` / `ssd_attention` through flash-linear-attention's chunked Triton kernels
(``fla.ops.gla.chunk_gla``, ``fla.ops.simple_gla.chunk_simple_gla``; the `fla` package, an optional
dependency imported only here, on first use): whether a call can take it (`fla_missing`, `use_fla`)
and the conversion (`fla_attention`), which is layout only: fla's gate g is the same log-space decay,
applied before k_t v_t^T is added, with the same (B, H, Dk, Dv) float32 states. fla picks its own chunk
size (chunk_size is not used there)."""

from __future__ import annotations

import torch

__all__ = ["FLA", "fla_attention", "fla_kernels", "fla_missing", "use_fla"]

FLA: dict = {}  # "kernels": {vector: fla's function} or why fla cannot be imported; "ssd_grad_refused": bool


def fla_kernels():
    """{True: fla's chunk_gla, False: its chunk_simple_gla}, or a string saying why fla cannot be
    imported. Imported on first use only: `import attnlab` never needs fla."""
    if "kernels" not in FLA:
        try:
            import fla.utils as fu
            from fla.ops.gla import chunk_gla
            from fla.ops.simple_gla import chunk_simple_gla

            FLA["kernels"] = {True: chunk_gla, False: chunk_simple_gla}
            # fla 0.6 raises in its scalar-decay backward on Hopper with Triton >= 3.4, < 3.7.1 (a miscompilation)
            FLA["ssd_grad_refused"] = bool(getattr(fu, "IS_NVIDIA_HOPPER", False)
                                            and getattr(fu, "TRITON_ABOVE_3_4_0", False)
                                            and not getattr(fu, "TRITON_ABOVE_3_7_1", True))
        except ModuleNotFoundError as e:
            FLA["kernels"] = f"flash-linear-attention is not installed (pip install flash-linear-attention; {e})"
        except Exception as e:  # noqa: BLE001 - an install that breaks on import is reported, not raised
            FLA["kernels"] = f"flash-linear-attention could not be imported ({type(e).__name__}: {e})"
    return FLA["kernels"]


def fla_missing(device: torch.device, dtype: torch.dtype, Dk: int, Dv: int, vector: bool, needs_grad: bool):
    """None when fla's kernel for this call can run, else why not. Cheap checks first; fla is
    imported only for a CUDA tensor."""
    if device.type != "cuda":
        return f"fla's Triton kernels run on CUDA tensors, got device {device}"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"fla's kernels take float32, bfloat16 or float16 inputs, got {dtype}"
    if min(Dk, Dv) < 16:
        return f"fla's kernels tile head dims by 16: Dk and Dv must be >= 16, got Dk={Dk}, Dv={Dv}"
    kernels = fla_kernels()
    if isinstance(kernels, str):
        return kernels
    if not vector and needs_grad:  # what fla 0.6's scalar-decay backward refuses (it raises there)
        if dtype != torch.float32 and (Dk % 2 or Dv % 2):
            return f"fla's ssd backward needs even Dk and Dv for 16-bit inputs, got Dk={Dk}, Dv={Dv}"
        if FLA.get("ssd_grad_refused"):
            return ("fla refuses its ssd backward on Hopper GPUs with Triton >= 3.4 and < 3.7.1 (a Triton "
                    "miscompilation); Triton >= 3.7.1 lifts this")
    return None


def use_fla(impl, q, k, v, log_decay, initial_state, vector) -> bool:
    """impl="fla" (checked: ValueError saying why it cannot run), or "auto" on CUDA where fla can run."""
    if impl not in ("fla", "auto") or (impl == "auto" and q.device.type != "cuda"):
        return False
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, log_decay, initial_state))
    reason = fla_missing(q.device, q.dtype, q.shape[-1], v.shape[-1], vector, needs_grad)
    if impl == "fla" and reason is not None:
        raise ValueError(f"impl='fla' cannot run: {reason}")
    return reason is None


def fla_attention(q, k, v, log_decay, scale: float, state, vector: bool, cu_seqlens=None):
    """The recurrence through fla's chunked kernel. fla runs the same recurrence,
    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T, o_t = scale * q_t^T S_t, with g = log_decay, in the
    layout (B, T, H, D) (g: (B, T, H, Dk) for chunk_gla, (B, T, H) for chunk_simple_gla), the scale
    applied inside, and initial / final states (B, H, Dk, Dv) in float32, as ours. q, k, v keep
    their dtype; the gate goes in float32, so its cumulative sums do not round to 16 bits. cu_seqlens
    (N + 1,) int64 offsets of packed documents (B = 1) go to fla's varlen kernels as they are: fla's
    convention is ours, with the final states per document (N, H, Dk, Dv)."""
    kernel = fla_kernels()[vector]
    qf, kf, vf = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, H, D)
    g = log_decay.float().transpose(1, 2)  # (B, T, H, Dk) or (B, T, H)
    extra = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
    o, state = kernel(qf, kf, vf, g, scale=scale, initial_state=state, output_final_state=True, **extra)
    return o.transpose(1, 2).to(q.dtype), state  # (B, H, T, Dv); a view of fla's (B, T, H, Dv)
