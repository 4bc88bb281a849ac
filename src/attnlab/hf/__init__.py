"""attnlab models in the Hugging Face ecosystem (needs the `[hf]` extra: transformers).

Importing this package registers model_type "attnlab" with `AutoConfig` and
`AutoModelForCausalLM`, so after `import attnlab.hf` a folder written by `attnlab export`
(or `export_run`) loads with `AutoModelForCausalLM.from_pretrained(folder)` and
`AutoTokenizer.from_pretrained(folder)`, without trust_remote_code.

- `AttnlabConfig`, `AttnlabForCausalLM`: the config and the PreTrainedModel + GenerationMixin
  around `attnlab.models.LM` (every registered mechanism, per-layer lists).
- `AttnlabCache`: the transformers Cache holding attnlab's decode state, used by `generate`
  (`UnsupportedCacheOperation` for what it cannot do: beam search, assisted decoding, contrastive search).
- `export_run(run_dir, out_dir)`: a trained run as a model folder; `hf_tokenizer(tok)`.
- lm-evaluation-harness: `python -m attnlab.harness run --model hf --model_args pretrained=FOLDER ...`
  or `lm_eval.models.huggingface.HFLM(pretrained=model, tokenizer=tok)` in Python.

Tested with transformers 4.56.2 and 5.23.0 (TESTED_TRANSFORMERS; lm-eval 0.4.13 with 5.23.0);
pyproject's `[hf]` extra asks for transformers >= 4.56.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM

from .cache import AttnlabCache, UnsupportedCacheOperation
from .configuration import MODEL_TYPE, AttnlabConfig
from .export import ExportError, export_run
from .modeling import AttnlabForCausalLM, AttnlabPreTrainedModel
from .tokenizer import hf_tokenizer

TESTED_TRANSFORMERS = ("4.56.2", "5.23.0")


def register() -> None:
    """Register the attnlab classes with transformers' Auto classes (idempotent; done on import)."""
    try:
        AutoConfig.register(MODEL_TYPE, AttnlabConfig)
    except ValueError:  # already registered (a re-import, e.g. after importlib.reload)
        pass
    try:
        AutoModelForCausalLM.register(AttnlabConfig, AttnlabForCausalLM)
    except ValueError:
        pass


register()

__all__ = [
    "AttnlabCache", "AttnlabConfig", "AttnlabForCausalLM", "AttnlabPreTrainedModel", "ExportError",
    "MODEL_TYPE", "TESTED_TRANSFORMERS", "UnsupportedCacheOperation", "export_run", "hf_tokenizer", "register",
]
