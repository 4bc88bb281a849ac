"""cosFormer's feature map phi(x_i) = [relu(x_i) cos theta_i, relu(x_i) sin theta_i], theta_i = pi i / (2 M)
(relu(x) alone without reweighting), by position (`features`) or by position inside packed documents
(`packed_features`), and the readout num / (den + eps) of the normalised form (`readout`)."""

from __future__ import annotations

import math

import torch


def features(x: torch.Tensor, offset, max_len: int | None) -> torch.Tensor:
    """(B, H, T, Dk) -> (B, H, T, F): relu(x), times [cos theta, sin theta] when max_len is set.
    offset: the first token's position, an int or a 0-d integer tensor (a static decoder's)."""
    x = torch.relu(x)
    if max_len is None:
        return x
    pos = torch.arange(x.shape[-2], dtype=torch.float64, device=x.device) + offset
    theta = (pos * (math.pi / (2 * max_len)))[:, None]  # (T, 1)
    return torch.cat([x * torch.cos(theta).to(x.dtype), x * torch.sin(theta).to(x.dtype)], dim=-1)  # (B, H, T, 2Dk)


def packed_features(x: torch.Tensor, pos: torch.Tensor, horizon) -> torch.Tensor:
    """`features` of packed documents: x (B, H, T, Dk), pos (B, T) each token's position in its
    document, horizon M an int or per token (B, T) (its document's length)."""
    x = torch.relu(x)
    M = horizon.double() if isinstance(horizon, torch.Tensor) else float(horizon)
    theta = (pos.double() * (math.pi / 2) / M)[:, None, :, None]  # (B, 1, T, 1)
    return torch.cat([x * torch.cos(theta).to(x.dtype), x * torch.sin(theta).to(x.dtype)], dim=-1)


def readout(num: torch.Tensor, den: torch.Tensor, normalize: bool, eps: float) -> torch.Tensor:
    return num / (den + eps)[..., None] if normalize else num
