"""What a retrofit trial's runs are and what each leaves behind: the settings of one (variant, seed),
the fingerprint its result.json carries, and which results count as finished (for these settings)
and current (under today's perplexity rule). Shared by the trial runner
(`attnlab.experiments.retrofit_trial`) and its report (`attnlab.experiments.retrofit_report`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..retrofit.evaluate import PER_LAYER, EvalConfig
from ..retrofit.finetune import FinetuneConfig
from ..retrofit.transfer import TransferConfig
from ..search.metrics import PERPLEXITY_RULE

ORIGINAL = "original"
RESULT = "result.json"
PARTIAL = "decode.partial.json"  # the decode losses of an evaluation not yet finished
SCALARS = ("ppl", "nll", "ppl_gap", *PER_LAYER, "first_token_share_before", "first_token_share_all",
           "new_change_rms", "trainable_params", "wall_s")


@dataclass
class RetrofitSpec:
    """What is converted: `attnlab retrofit --model/--layers/--attn/--set`."""

    model: str = "smollm2"
    layers: str = "middle6"
    attn: str = "softmax"
    settings: dict = field(default_factory=dict)


@dataclass
class TrialRun:
    variant: str
    seed: int
    folder: Path
    retrofit: RetrofitSpec
    transfer: TransferConfig
    finetune: FinetuneConfig
    eval: EvalConfig


def _fingerprint(run: TrialRun | None, ev: EvalConfig) -> dict:
    d = {"eval": asdict(ev)}
    if run is not None:
        d.update(retrofit=asdict(run.retrofit), transfer=asdict(run.transfer), finetune=asdict(run.finetune))
    return json.loads(json.dumps(d, default=str))


def _filled(fp: dict) -> dict | None:
    """A fingerprint with every section's fields present (fields added since it was written take
    their defaults, which is what such a run used); None if it names a field that no longer exists."""
    classes = {"eval": EvalConfig, "transfer": TransferConfig, "finetune": FinetuneConfig, "retrofit": RetrofitSpec}
    try:
        return json.loads(json.dumps({k: asdict(classes[k](**v)) if k in classes else v for k, v in fp.items()},
                                     default=str))
    except TypeError:
        return None


def finished(folder: Path, want: dict) -> dict | None:
    """The run's result.json when it was written for exactly these settings, else None."""
    try:
        res = json.loads((folder / RESULT).read_text())
    except (OSError, ValueError):
        return None
    have = _filled(res.get("fingerprint") or {})
    return res if have is not None and have == _filled(want) else None


def _current(folder: Path, want: dict) -> bool:
    """Whether the run's result.json was written for these settings under today's perplexity rule (a
    result scored under the earlier rule still counts in reports, and a run of the trial redoes it)."""
    res = finished(folder, want)
    return res is not None and res.get("perplexity_rule") == PERPLEXITY_RULE


def metric_names(ev: EvalConfig) -> list[str]:
    """Every per-run scalar a `[[verdict]]` rule may name."""
    return [*SCALARS, *ev.decode_names(), *("gap:" + n for n in ev.decode_names() if not n.startswith("exact@"))]
