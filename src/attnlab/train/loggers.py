"""Where log rows go besides log.jsonl and the CSVs: TensorBoard, Weights & Biases, MLflow.

`run.logger` names them ('tensorboard', 'wandb', 'mlflow', several as a list or comma-separated,
or 'none'). Each backend gets every row as scalars named `<kind>/<column>` ("train/loss",
"eval/val_loss", "train/layers.1.tau_mean") against the row's step; None values (MFU on the CPU)
are left out. Where each one writes:

- tensorboard: `<run>/tensorboard/` (torch.utils.tensorboard; extra `attnlab[tensorboard]`).
- wandb: `wandb.init(dir=<run>)`, so its files go to `<run>/wandb/`; project, entity and mode come
  from W&B's own settings (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline to log without a
  network, then `wandb sync <run>/wandb/offline-run-*`). Extra `attnlab[wandb]`.
- mlflow: the tracking server of $MLFLOW_TRACKING_URI, else a SQLite store in the run folder,
  `sqlite:///<run>/mlflow/mlflow.db` (`mlflow ui --backend-store-uri` that URI reads it). The run's
  config goes in as params. Extra `attnlab[mlflow]`.

A resumed run continues the same W&B and MLflow run (their ids are kept in `<run>/loggers.json`)
and TensorBoard drops the events past the checkpoint (SummaryWriter's purge_step), as log.jsonl
does; W&B and MLflow keep what they were sent, so the steps a killed run logged after its last
checkpoint appear there twice, with the same losses (resume is exact).
"""

from __future__ import annotations

import json
import os
import secrets
import string
import time
from pathlib import Path

from attnlab.data.cache import atomic_write_text
from attnlab.models.config import ConfigError

LOGGERS = ("tensorboard", "wandb", "mlflow")
STATE_FILE = "loggers.json"
PATHS = ("tensorboard", "wandb", "mlflow", STATE_FILE)  # what they leave in a run folder


class LoggerUnavailable(ConfigError):
    """A backend named by run.logger does not import (raised before a run writes anything), or cannot
    start its run (raised before the first step)."""


def _import(name: str):
    """The backend's entry point; raises whatever its import raises."""
    if name == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter
    if name == "wandb":
        import wandb

        return wandb
    from mlflow.tracking import MlflowClient

    if not os.environ.get("MLFLOW_TRACKING_URI"):  # the local SQLite store needs these too
        import alembic  # noqa: F401
        import sqlalchemy  # noqa: F401
    return MlflowClient


def check_loggers(names, key: str = "run.logger") -> None:
    """Import every backend in `names` now, so a missing one stops a run before it starts."""
    for name in names:
        try:
            _import(name)
        except Exception as e:  # ImportError, or a broken install failing in its own import
            raise LoggerUnavailable(
                f"{key} names {name!r} but it does not import ({type(e).__name__}: {e}); install it with "
                f"pip install 'attnlab[{name}]', or take {name!r} out of {key}") from None


def open_backends(names, run_dir: Path, *, resumed_at: int, title: str, project: str, config: dict) -> list:
    """One backend per name, started; `resumed_at` is the step a resumed run continues from (0: fresh).
    Ids that let a resumed run continue the same W&B / MLflow run are read from and written to
    run_dir/loggers.json."""
    path = run_dir / STATE_FILE
    state = json.loads(path.read_text()) if resumed_at and path.is_file() else {}
    out = []
    try:
        for name in names:
            cls = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}[name]
            try:
                out.append(cls(run_dir, state, resumed_at=resumed_at, title=title, project=project, config=config))
            except Exception as e:  # no W&B login, an MLflow server out of reach, ...
                raise LoggerUnavailable(f"run.logger names {name!r} but it could not start its run "
                                        f"({type(e).__name__}: {e})") from e
    except BaseException:
        for backend in out:
            backend.close("failed")
        raise
    if state:
        atomic_write_text(path, json.dumps(state, indent=2) + "\n")
    return out


class TensorBoard:
    def __init__(self, run_dir: Path, state: dict, *, resumed_at: int, **_):
        writer = _import("tensorboard")
        # a resumed run drops the events a killed run wrote after its checkpoint
        self.writer = writer(log_dir=str(run_dir / "tensorboard"), purge_step=resumed_at + 1 if resumed_at else None)

    def log(self, kind: str, scalars: dict, step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(f"{kind}/{name}", value, step)
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class WandB:
    def __init__(self, run_dir: Path, state: dict, *, title: str, project: str, config: dict, **_):
        wandb = _import("wandb")
        run_id = state.get("wandb") or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        self.run = wandb.init(dir=str(run_dir), project=project or os.environ.get("WANDB_PROJECT") or "attnlab",
                              name=title, id=run_id, resume="allow", reinit="create_new", config=config,
                              settings=wandb.Settings(console="off"))
        state["wandb"] = run_id
        self.kinds: set[str] = set()

    def log(self, kind: str, scalars: dict, step: int) -> None:
        if kind not in self.kinds:  # each kind plotted against its own step (W&B's _step counts calls)
            self.run.define_metric(f"{kind}/step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self.kinds.add(kind)
        self.run.log({f"{kind}/step": step, **{f"{kind}/{k}": v for k, v in scalars.items()}})

    def close(self, status: str) -> None:
        if status == "killed":  # stopped by a signal with a checkpoint: to be resumed
            self.run.mark_preempting()
        self.run.finish(exit_code=0 if status == "finished" else 1)


class MLflow:
    MAX_BATCH = 1000  # metrics per log_batch call (MLflow's limit)

    def __init__(self, run_dir: Path, state: dict, *, title: str, project: str, config: dict, **_):
        client_cls = _import("mlflow")
        from mlflow.entities import Param

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        local = not uri
        if local:
            (run_dir / "mlflow").mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(run_dir / 'mlflow' / 'mlflow.db').resolve()}"
        self.client = client = client_cls(tracking_uri=uri)
        saved = state.get("mlflow") or {}
        if saved.get("tracking_uri") == uri:
            self.run_id = saved["run_id"]
            client.update_run(self.run_id, status="RUNNING")
        else:
            name = project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "attnlab"
            found = client.get_experiment_by_name(name)
            where = (run_dir / "mlflow" / "artifacts").resolve().as_uri() if local else None
            exp = found.experiment_id if found else client.create_experiment(name, artifact_location=where)
            self.run_id = client.create_run(exp, run_name=title).info.run_id
        state["mlflow"] = {"tracking_uri": uri, "run_id": self.run_id}
        have = client.get_run(self.run_id).data.params  # MLflow refuses to change a logged param: a resumed
        params = [Param(k, v[:6000]) for k, v in _params(config).items() if k not in have]  # run adds new keys only
        for i in range(0, len(params), 100):
            client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, kind: str, scalars: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"{kind}/{k}", float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), self.MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + self.MAX_BATCH])

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status={"finished": "FINISHED", "killed": "KILLED"}.get(status, "FAILED"))


def _params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as MLflow params: dotted keys, values as text (JSON for anything but strings)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out
