"""What a run measures on its validation split at every evaluation: the mean token loss over every
rank's batches, its perplexity, and for MQAR the accuracy at the query positions."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from attnlab.models.lm import token_loss

from . import ddp
from .setup import autocast


@torch.no_grad()
def validation_metrics(model, batches: Iterable, device: torch.device, dtype: str, env: ddp.DistEnv,
                       accuracy: bool = False) -> dict:
    """{"val_loss", "val_ppl", "val_tokens"} (and "val_accuracy" with `accuracy`) of `model` over
    `batches` (`attnlab.data.packing.Batch`es, under autocast to `dtype`), summed over the ranks of
    `env`; the model is left in training mode."""
    model.eval()
    loss_sum = count = correct = 0.0
    for batch in batches:
        x, y = batch.x.to(device), batch.y.to(device)
        doc_ids = None if batch.cross_doc else batch.doc_ids.to(device)
        with autocast(device, dtype):
            logits, _ = model(x, doc_ids=doc_ids)
        mask = y != -100
        loss_sum += float(token_loss(logits, y, reduction="sum"))
        count += float(mask.sum())
        correct += float((logits.argmax(-1)[mask] == y[mask]).sum())
    model.train()
    loss_sum, count, correct = (v * env.world_size for v in ddp.mean_over_ranks([loss_sum, count, correct], env))
    loss = loss_sum / max(count, 1.0)
    out = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0)), "val_tokens": int(count)}
    if accuracy:
        out["val_accuracy"] = correct / max(count, 1.0)
    return out
