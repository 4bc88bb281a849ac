"""A decoding comparison on one pretrained model at equal budgets: attnlab's selectors (learned search,
Quest, StreamingLLM, the sorted scalar selection) beside kvpress's presses, on passkey and needle
accuracy, the perplexity of continuations, step time and bytes read (`attnlab search compare`)."""

from .report import write_report
from .runner import SIDES, merge, run
from .spec import Spec, load_spec

__all__ = ["SIDES", "Spec", "load_spec", "merge", "run", "write_report"]
