"""Evaluation: metrics on tensors (`metrics`), windowed decoding measured without decoding (`window`),
key selectors compared on one model (`selectors`, `selector_training`) and task accuracy (`tasks`).

The package exports nothing itself; import from its modules, e.g.
`from attnlab.eval.window import decode_window`.
"""
