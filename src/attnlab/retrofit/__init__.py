"""Retrofit a pretrained Hugging Face Llama / Qwen2 model with any attnlab mechanism (needs the [hf] extra).

    from attnlab.retrofit import retrofit, save
    model = retrofit("smollm2", layers="middle6", attn="hybrid")        # an AttnlabForCausalLM
    model = retrofit(hf_model, layers=[1, 2], attn="softmax", settings={"output_gate": "elementwise"})
    save(model, "runs/retrofit/hybrid", tokenizer=tok)                    # from_pretrained after `import attnlab.hf`

The chosen layers get attnlab's layer for the mechanism, built from the registry through
`AttentionConfig` and holding the model's q/k/v/o weights, GQA layout and RoPE; every other
layer becomes attnlab's softmax layer, equal to the model's own. Exact starts (docs/retrofit.md)
make the retrofitted model compute the original's logits where the math allows. `convert.py`
holds the config plan and the weight copy; `io.py` loading by spec and the atomic folder write;
`transfer.py` attention transfer (new layers trained to reproduce the original attention outputs);
`finetune.py` end-to-end fine-tuning of the new parameters (next-token loss, optional KL to the original);
`loop.py` the resumable training loop both of those run; `evaluate.py` held-out perplexity and the
per-layer statistics; `pipeline.py` the four stages in order (`run_pipeline`), as `attnlab retrofit`
and each run of a retrofit trial run them.
"""

from __future__ import annotations

from .convert import (
    FAMILIES, PRINCIPLED_START, Plan, RetrofitError, convert, logit_error, new_parameters, plan,
    principled_logit_bound, start_overrides,
)
from .finetune import FinetuneConfig, finetune
from .io import check_out, load_source, parse_settings, plan_source, retrofit, save
from .evaluate import EvalConfig, evaluate_retrofit
from .pipeline import Retrofitted, run_pipeline
from .transfer import TransferConfig, transfer_attention

__all__ = [
    "FAMILIES", "FinetuneConfig", "PRINCIPLED_START", "Plan", "RetrofitError", "check_out", "convert", "finetune", "load_source", "logit_error",
    "new_parameters", "parse_settings", "plan", "plan_source", "principled_logit_bound", "retrofit", "save",
    "start_overrides", "TransferConfig", "transfer_attention", "EvalConfig", "evaluate_retrofit", "Retrofitted",
    "run_pipeline",
]
