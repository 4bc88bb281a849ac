"""`python -m attnlab.harness ...`: lm-evaluation-harness's command line with attnlab's models registered.

It imports `attnlab.hf` (which registers model_type "attnlab" with transformers' Auto classes) and
hands the arguments to lm-eval's own CLI, so every lm-eval option works as documented there:

    attnlab export runs/tiny hf
    python -m attnlab.harness run --model hf --model_args pretrained=hf --device cpu --batch_size 4 \\
        --include_path examples/lm_eval --tasks attnlab_python_mc,attnlab_python_gen

In Python the same is `lm_eval.simple_evaluate(model=HFLM(pretrained=model, tokenizer=tok), ...)`
after `import attnlab.hf`. Needs the `[eval]` extra (lm-eval) and the `[hf]` extra (transformers).
"""

from __future__ import annotations

import sys
from typing import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    """Run lm-eval's CLI on `argv` (default: this process's arguments) with attnlab registered."""
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError as e:
        if (e.name or "").split(".")[0] != "lm_eval":
            raise
        print("error: python -m attnlab.harness needs lm-evaluation-harness, not installed here; "
              "install the [eval] extra: pip install 'attnlab[eval]'", file=sys.stderr)
        raise SystemExit(2) from None
    import attnlab.hf  # noqa: F401  (registers the Auto classes)

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    sys.argv[0] = "python -m attnlab.harness"
    cli_evaluate()


if __name__ == "__main__":
    main()
