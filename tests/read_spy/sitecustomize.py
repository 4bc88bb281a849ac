"""Read by Python at start-up when tests/read_spy is on PYTHONPATH (tests/test_ddp.py). In a torchrun
worker (RANK set) with ATTNLAB_READ_SPY naming a folder, the value-read spy (read_spy.py) watches
`Trainer.train_step` on every step but the first (which may set things up) and the log rows (where
the loop reads the step's scalars by design); what it saw goes to ATTNLAB_READ_SPY/rank<R>.json at exit."""

import os

if os.environ.get("ATTNLAB_READ_SPY") and "RANK" in os.environ:
    import atexit
    import json
    from pathlib import Path

    from read_spy import install

    from attnlab.train.trainer import Trainer

    seen, on = install(setattr)
    steps = []
    real_step = Trainer.train_step

    def train_step(self):
        watch = self.step > 0 and not self._is_log_row(self.step)
        steps.append(self.step) if watch else None
        on[0] = watch
        try:
            return real_step(self)
        finally:
            on[0] = False

    Trainer.train_step = train_step
    out = Path(os.environ["ATTNLAB_READ_SPY"]) / f"rank{os.environ['RANK']}.json"
    atexit.register(lambda: out.write_text(json.dumps({"watched_steps": steps, "reads": sorted(set(seen))})))
