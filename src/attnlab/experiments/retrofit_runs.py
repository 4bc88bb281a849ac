"""What a retrofit trial's runs are and what each leaves behind: the settings of one (variant, seed),
the fingerprint its result.json carries, and which results count as finished (for these settings)
and current (under today's perplexity rule). Shared by the trial runner
(`attnlab.experiments.retrofit_trial`) and its report (`attnlab.experiments.retrofit_report`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..data.cache import atomic_write_text
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
    """A run's settings, as its result.json and the trial's results.json record them: every option
    but the transfer's held-out contexts, which it only measures on (the error it reports there)."""
    d = {"eval": asdict(ev)}
    if run is not None:
        transfer = asdict(run.transfer)
        transfer.pop("heldout_contexts")
        d.update(retrofit=asdict(run.retrofit), transfer=transfer, finetune=asdict(run.finetune))
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


def _effective(fp: dict) -> dict | None:
    """The settings that decide a run's outcome: the filled fingerprint, with the transfer options
    of a run that takes no transfer step set to their defaults (nothing reads them)."""
    fp = _filled(fp)
    if fp is not None and isinstance(fp.get("transfer"), dict) and fp["transfer"].get("steps") == 0:
        fp["transfer"] = json.loads(json.dumps(asdict(TransferConfig()), default=str))
    return fp


def same_settings(have: dict, want: dict) -> bool:
    """Whether a run recorded with fingerprint `have` is a run for the settings `want`: equal once
    filled (`_filled`) and with unread options dropped (`_effective`)."""
    have = _effective(have)
    return have is not None and have == _effective(want)


def finished(folder: Path, want: dict) -> dict | None:
    """The run's result.json when it was written for these settings (`same_settings`), else None."""
    try:
        res = json.loads((folder / RESULT).read_text())
    except (OSError, ValueError):
        return None
    return res if same_settings(res.get("fingerprint") or {}, want) else None


def _current(folder: Path, want: dict) -> bool:
    """Whether the run's result.json was written for these settings under today's perplexity rule (a
    result scored under the earlier rule still counts in reports, and a run of the trial redoes it)."""
    res = finished(folder, want)
    return res is not None and res.get("perplexity_rule") == PERPLEXITY_RULE


def borrow(folder: Path, want: dict, seed: int | None, trials: Path) -> dict | None:
    """A run another trial under `trials` already finished for the same settings and seed under
    today's perplexity rule (the same fingerprint once unread options are dropped: the same
    computation), copied into `folder` with `reused_from` naming its folder; None when there is none.
    seed None: the original model (a `runs/original` folder)."""
    own = folder.resolve()
    pattern = f"*/runs/{ORIGINAL}/{RESULT}" if seed is None else f"*/runs/*/seed{seed}/{RESULT}"
    for path in sorted(trials.glob(pattern)):
        src = path.parent
        if src.resolve() == own:
            continue
        res = finished(src, want)
        if res is None or res.get("perplexity_rule") != PERPLEXITY_RULE or res.get("seed") != seed:
            continue
        variant = folder.name if seed is None else folder.parent.name
        res = {**res, "variant": variant, "fingerprint": want, "reused_from": src.relative_to(trials).as_posix()}
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "fingerprint.json", json.dumps(want) + "\n")
        atomic_write_text(folder / RESULT, json.dumps(res, indent=1, default=str) + "\n")
        return res
    return None


def metric_names(ev: EvalConfig) -> list[str]:
    """Every per-run scalar a `[[verdict]]` rule may name."""
    return [*SCALARS, *ev.decode_names(), *("gap:" + n for n in ev.decode_names() if not n.startswith("exact@"))]
