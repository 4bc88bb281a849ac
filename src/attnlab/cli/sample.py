"""`attnlab sample RUN`: text from a trained run (nanoGPT's sample.py): a prompt, greedy or sampled with a
temperature, top-k and top-p, a seed, a token budget and the decode window."""

from __future__ import annotations

import math
from pathlib import Path

from ._common import UsageError


def add_sample(sub, formatter) -> None:
    p = sub.add_parser(
        "sample", help="generate text from a trained run", formatter_class=formatter,
        description="Generate text from the newest checkpoint of a run folder: the prompt goes through the model in\n"
                    "one prefill pass, then one decode step per new token (LM.generate), through the decode caches\n"
                    "(a model trained through a window decodes through it).\n\n"
                    "  attnlab sample runs/quickstart/runs/hybrid/seed0 --prompt 'def main(' --max-tokens 200\n"
                    "  attnlab sample RUN --prompt 'import ' --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1 -n 3",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run folder (holds config.toml and checkpoints)")
    p.add_argument("--prompt", default="", help="the text to continue (default: the start of a document)")
    p.add_argument("--max-tokens", type=int, default=200, metavar="N", help="new tokens per sample (default 200)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token at every step")
    p.add_argument("--temperature", type=float, default=1.0, help="softmax temperature when sampling (default 1)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample among the most likely tokens whose probability reaches P (nucleus)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0): the same seed, the same text")
    p.add_argument("-n", "--num-samples", type=int, default=1, metavar="N", help="samples, decoded as one batch")
    p.add_argument("--window", type=int, default=None, metavar="K",
                   help="decode scalar/hybrid layers through the sorted cache's K nearest keys")
    p.add_argument("--checkpoint", metavar="PATH", help="sample from this checkpoint instead of the newest")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.set_defaults(func=cmd_sample)


def _check(ns) -> None:
    if not (Path(ns.run) / "config.toml").is_file():
        raise UsageError(f"RUN_DIR {ns.run!r} is not a run folder (it has no config.toml); train one with attnlab train")
    if ns.max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
    if ns.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {ns.num_samples}")
    if ns.window is not None and ns.window < 1:
        raise UsageError(f"--window must be >= 1, got {ns.window}")
    if ns.greedy and (ns.top_k is not None or ns.top_p is not None or ns.temperature != 1.0):
        raise UsageError("--greedy takes the most likely token: drop --temperature, --top-k and --top-p, or --greedy")
    from attnlab.models.sampling import check_sampling

    try:
        check_sampling(ns.greedy, ns.temperature, ns.top_k, ns.top_p)
    except ValueError as e:
        raise UsageError("--" + str(e).replace("_", "-", 1)) from None
    if ns.checkpoint and not Path(ns.checkpoint).exists():
        raise UsageError(f"--checkpoint {ns.checkpoint!r} does not exist")


def sample_run(run: str | Path, prompt: str = "", max_tokens: int = 200, *, greedy: bool = False, temperature: float = 1.0,
               top_k: int | None = None, top_p: float | None = None, seed: int = 0, num_samples: int = 1,
               window: int | None = None, checkpoint: str | None = None, device: str = "auto") -> list[str]:
    """The `num_samples` continuations of `prompt` (text only, the prompt left out) by the run's model."""
    import torch

    from attnlab.train.data import data_tokenizer
    from attnlab.train.evaluate import load_run
    from attnlab.train.setup import resolve_device

    cfg, model, _ = load_run(Path(run), None, checkpoint)
    dev = resolve_device(device if device != "auto" else cfg.run.device)
    model.to(dev)
    tok = data_tokenizer(cfg.data)
    ids = [tok.eos_id] + list(tok.encode(prompt))  # documents start after a separator in training
    limit = cfg.model.max_seq_len if cfg.model.pos_embedding == "learned" else math.inf
    if len(ids) + max_tokens > limit:
        raise UsageError(f"the prompt ({len(ids)} tokens) and --max-tokens {max_tokens} pass model.max_seq_len={limit} "
                         f"of the run's learned position embedding")
    idx = torch.tensor([ids] * num_samples, device=dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        out = model.generate(idx, max_tokens, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                             window=window, generator=g)
    return [tok.decode(row[len(ids):].tolist()) for row in out]


def cmd_sample(ns) -> int:
    _check(ns)
    texts = sample_run(ns.run, ns.prompt, ns.max_tokens, greedy=ns.greedy, temperature=ns.temperature, top_k=ns.top_k,
                       top_p=ns.top_p, seed=ns.seed, num_samples=ns.num_samples, window=ns.window,
                       checkpoint=ns.checkpoint, device=ns.device)
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1} (seed {ns.seed}) ---")
        print(ns.prompt + text)
    return 0

