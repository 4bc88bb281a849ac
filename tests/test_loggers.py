"""run.logger: TensorBoard, W&B and MLflow beside log.jsonl and the CSVs, offline and without a network.

What each backend wrote is read back from its own files (W&B's offline .wandb record log, MLflow's
SQLite store, TensorBoard's event files) and compared with log.jsonl, value for value; the rows carry
loss, lr, grad norm, tokens/s, MFU (null on the CPU) and peak memory; a resumed run continues the
same W&B and MLflow run and widens a train.csv written without the new columns; a backend that is
not installed stops the run before anything is written, naming run.logger and the extra."""

from __future__ import annotations

import csv
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.models import LM
from attnlab.models.config import ConfigError, ModelConfig
from attnlab.train import load_config, read_log, save_config, train
from attnlab.train import throughput
from attnlab.train.loggers import LoggerUnavailable
from attnlab.train.logging import RunLogger
from attnlab.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
STEADY = ("loss", "lr", "grad_norm")  # the same at a step whichever run logged it (resume is exact)


def cfg_for(tmp_path, corpus, *overrides):
    return load_config(TINY, [f"run.out_dir={tmp_path}", f"data.source={corpus}", "run.threads=1",
                              "run.progress=false", *overrides])


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("value, names", [
    ("wandb", ["wandb"]), ("wandb,mlflow", ["wandb", "mlflow"]), (" mlflow , tensorboard ", ["mlflow", "tensorboard"]),
    (["tensorboard", "wandb"], ["tensorboard", "wandb"]), ("none", []), ([], []), ("wandb,wandb", ["wandb"]),
], ids=["one", "comma", "spaces", "list", "none", "empty-list", "repeated"])
def test_logger_forms(value, names):
    cfg = load_config(TINY, [f"run.logger={json.dumps(value)}"])
    assert cfg.run.loggers == names
    assert cfg.run.tensorboard_if_installed is False  # a set run.logger is the whole list


def test_unset_logger_follows_run_tensorboard():
    assert load_config(TINY).run.loggers == [] and load_config(TINY).run.tensorboard_if_installed is True
    assert load_config(TINY, ["run.tensorboard=false"]).run.tensorboard_if_installed is False


@pytest.mark.parametrize("overrides, words", [
    (["run.logger=wandbb"], ["run.logger", "'wandbb'", "did you mean 'wandb'"]),
    (["run.logger=none,wandb"], ["run.logger", "'none' stands alone"]),
    (["run.logger=wandb,"], ["run.logger", "'wandb,'"]),
    (["run.logger=3"], ["run.logger", "3"]),
    (["run.logger=tensorboard", "run.tensorboard=false"], ["run.logger", "run.tensorboard"]),
], ids=["typo", "none-and-more", "empty-item", "not-a-name", "contradiction"])
def test_bad_logger_names_the_key(overrides, words):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    for word in words:
        assert word in str(e.value)


def test_logger_list_round_trips_through_config_toml(tmp_path):
    cfg = load_config(TINY, ["run.logger=[mlflow,wandb]", "run.project=team"])
    toml_path, json_path = save_config(cfg, tmp_path)
    again = load_config(toml_path)
    assert again.run.loggers == ["mlflow", "wandb"] and again.run.project == "team"
    assert json.loads(json_path.read_text())["run"]["loggers"] == ["mlflow", "wandb"]


# --------------------------------------------------------------------------- MFU and peak memory


@pytest.mark.parametrize("overrides, embedding_counted", [
    ({}, True), ({"tie_embeddings": False}, False), ({"pos_embedding": "learned", "max_seq_len": 64}, True),
], ids=["tied", "untied", "learned-positions"])
def test_flops_per_token_is_6n_plus_the_attention_term(overrides, embedding_counted):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=3, n_heads=4, attn=["softmax", "hybrid", "gla"], **overrides)
    model = LM(cfg)
    matmul_params = sum(p.numel() for name, p in model.named_parameters()  # named_parameters: a tied weight once
                        if not name.startswith("pos_emb") and (embedding_counted or not name.startswith("tok_emb")))
    # 3 layers of 4 heads of width 8: 12 * L * H * D * T at T = 64
    assert throughput.flops_per_token(model, 64) == 6 * matmul_params + 12 * 3 * 4 * 8 * 64
    if overrides.get("tie_embeddings", True):
        assert matmul_params == model.num_params() - (64 * 32 if "pos_embedding" in overrides else 0)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA H100 NVL", 835.5e12),
    ("NVIDIA H200", 989.5e12), ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_by_device_name(monkeypatch, name, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert throughput.peak_flops(torch.device("cuda", 0)) == peak


def test_cpu_has_no_mfu_and_reports_max_rss():
    import resource

    assert throughput.peak_flops(torch.device("cpu")) is None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30
    assert rss <= throughput.peak_memory_gib(torch.device("cpu")) <= rss * 1.5


def test_throughput_rows_cover_the_steps_since_the_last_row(monkeypatch):
    model = LM(ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2))
    meter = throughput.Throughput(model, 32, torch.device("cpu"))
    meter.add(2.0, 100)
    meter.add(3.0, 400)
    row = meter.row()
    assert row["tokens_per_s"] == 100.0 and row["mfu"] is None and row["peak_mem_gib"] > 0
    meter.add(1.0, 50)
    assert meter.row()["tokens_per_s"] == 50.0
    assert (meter.seconds, meter.tokens) == (6.0, 550)
    meter.peak = 2e12  # two devices of 1 TFLOP/s
    meter.add(0.5, 1000)
    assert meter.row()["mfu"] == meter.flops_per_token * 2000 / 2e12


# --------------------------------------------------------------------------- the CSVs


def test_a_new_column_widens_the_csv(tmp_path):
    log = RunLogger(tmp_path, tensorboard=False)
    log.log("train", {"step": 1, "loss": 2.0})
    log.log("train", {"step": 2, "loss": 1.5, "mfu": 0.25})
    log.log("train", {"step": 3, "loss": 1.0})
    with open(tmp_path / "train.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "loss", "mfu"], ["1", "2.0", ""], ["2", "1.5", "0.25"], ["3", "1.0", ""]]
    RunLogger(tmp_path, tensorboard=False).truncate_after(2)  # a resume reads the widened header
    with open(tmp_path / "train.csv", newline="") as f:
        assert list(csv.reader(f))[-1] == ["2", "1.5", "0.25"]


# --------------------------------------------------------------------------- a backend that is not installed


@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard"])
def test_missing_backend_stops_the_run_before_it_writes(tmp_path, argparse_corpus, monkeypatch, name):
    module = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "torch.utils.tensorboard"}[name]
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it raises ImportError
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(LoggerUnavailable) as e:
        Trainer(cfg_for(tmp_path, argparse_corpus, f"run.logger={name}", "run.name=missing"))
    assert "run.logger" in str(e.value) and f"pip install 'attnlab[{name}]'" in str(e.value)
    assert not (tmp_path / "missing").exists()


def test_missing_backend_is_a_one_line_cli_error(tmp_path, argparse_corpus, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["train", str(TINY), f"run.out_dir={tmp_path}", f"data.source={argparse_corpus}",
                 "run.logger=wandb", "run.name=cli"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "run.logger names 'wandb'" in err and "attnlab[wandb]" in err
    assert list(tmp_path.iterdir()) == []


def test_backend_that_cannot_start_stops_the_run_before_its_first_step(tmp_path, argparse_corpus, monkeypatch):
    from attnlab.train import loggers

    closed = []

    class Started:  # stands in for a backend that started
        def __init__(self, *a, **k):
            pass

        def close(self, status):
            closed.append(status)

    class NoLogin:
        def __init__(self, *a, **k):
            raise RuntimeError("api_key not configured")

    monkeypatch.setattr(loggers, "MLflow", Started)
    monkeypatch.setattr(loggers, "WandB", NoLogin)
    monkeypatch.setattr("attnlab.train.trainer.check_loggers", lambda names: None)  # installed or not
    with pytest.raises(LoggerUnavailable, match=r"run.logger names 'wandb' but it could not start its run "
                                                r"\(RuntimeError: api_key not configured\)"):
        train(cfg_for(tmp_path, argparse_corpus, "run.logger=mlflow,wandb", "run.name=nologin"))
    assert closed == ["failed"]  # the one that started is closed
    assert not (tmp_path / "nologin" / "log.jsonl").exists() and not (tmp_path / "nologin" / "checkpoints").exists()


# --------------------------------------------------------------------------- W&B and MLflow, offline


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file: a 7-byte ':W&B' header, then LevelDB-style
    records (32 KiB blocks; each fragment a 7-byte header: CRC, length, type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk  # full / first, or middle / last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture(scope="module")
def logged(tmp_path_factory, argparse_corpus):
    """A run logged to W&B (offline) and MLflow (SQLite in the run folder) with a faked 1 TFLOP/s peak
    so MFU is a number; then "killed" after step 8 with its last checkpoint at step 2 (the newer
    ones deleted), its train.csv stripped of the columns an older attnlab did not write, and resumed:
    steps 3 to 8 again. Returns (run folder, log.jsonl rows of the first run, summary of the resumed run)."""
    tmp = tmp_path_factory.mktemp("loggers")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(tmp / "wandb-home"))
        mp.setenv("WANDB_MODE", "offline")
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setattr(throughput, "peak_flops", lambda device: 1e12)
        common = ["run.logger=wandb,mlflow", "run.name=run", "train.steps=8", "train.ckpt_every=2",
                  "train.keep_checkpoints=4", "train.eval_every=4"]
        first = train(cfg_for(tmp, argparse_corpus, *common))
        run = tmp / "run"
        first_rows = read_log(run, "train")
        assert [r["step"] for r in first_rows] == list(range(1, 9)) and first["steps"] == 8
        for name in ("step_000004", "step_000006", "step_000008", "latest"):
            path = run / "checkpoints" / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        with open(run / "train.csv", newline="") as f:
            old = [{k: v for k, v in r.items() if k not in ("mfu", "peak_mem_gib")} for r in csv.DictReader(f)]
        with open(run / "train.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(old[0]))
            writer.writeheader()
            writer.writerows(old)
        resumed = train(cfg_for(tmp, argparse_corpus, *common, "run.resume=true"))
    return run, first_rows, resumed


@pytest.mark.heavy
def test_rows_carry_speed_mfu_and_memory(logged):
    run, first_rows, summary = logged
    rows = read_log(run, "train")
    assert [r["step"] for r in rows] == list(range(1, 9)) and summary["resumed_from"].endswith("step_000002")
    fpt = throughput.flops_per_token(LM(load_config(run / "config.toml").model), 32)
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["peak_mem_gib"] > 0.01
        assert row["mfu"] == pytest.approx(fpt * row["tokens_per_s"] / 1e12, rel=1e-12)
    assert list(rows[0])[:10] == ["kind", "step", "loss", "ppl", "lr", "grad_norm", "tokens_per_s", "mfu",
                                  "peak_mem_gib", "tokens"]
    for a, b in zip(first_rows, rows):  # the resumed steps repeat the killed run's, bit for bit
        assert all(a[k] == b[k] for k in STEADY)


@pytest.mark.heavy
def test_resumed_run_widens_an_older_train_csv(logged):
    run, _, _ = logged
    rows = {r["step"]: r for r in read_log(run, "train")}
    with open(run / "train.csv", newline="") as f:
        csv_rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in csv_rows] == list(range(1, 9))
    assert [r["peak_mem_gib"] == "" for r in csv_rows] == [True, True] + [False] * 6  # kept rows: written before
    for r in csv_rows[2:]:
        step = int(r["step"])
        assert float(r["peak_mem_gib"]) == rows[step]["peak_mem_gib"] and float(r["mfu"]) == rows[step]["mfu"]
        assert float(r["loss"]) == rows[step]["loss"]


@pytest.mark.heavy
def test_wandb_offline_run_holds_the_logged_rows(logged):
    run, first_rows, _ = logged
    files = sorted(run.glob("wandb/offline-run-*/run-*.wandb"))
    state = json.loads((run / "loggers.json").read_text())
    assert len(files) == 2 and all(f.name == f"run-{state['wandb']}.wandb" for f in files)  # one run, resumed
    first, second = ([r for r in wandb_history(f) if "train/step" in r] for f in files)
    assert [r["train/step"] for r in first] == list(range(1, 9))
    assert [r["train/step"] for r in second] == list(range(3, 9))
    rows = {r["step"]: r for r in read_log(run, "train")}
    for logged_rows, wb in ((first_rows, first), ([rows[s] for s in range(3, 9)], second)):
        for row, got in zip(logged_rows, wb):
            for key in ("loss", "ppl", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "tokens"):
                assert got[f"train/{key}"] == row[key], key
            assert got["train/layers.1.tau_mean"] == row["layers"][1]["tau_mean"]
    evals = [r for f in files for r in wandb_history(f) if "eval/step" in r]
    assert [(r["eval/step"], r["eval/val_loss"]) for r in evals][-2:] == [
        (r["step"], r["val_loss"]) for r in read_log(run, "eval")]


@pytest.mark.heavy
def test_mlflow_store_holds_the_logged_rows(logged):
    from mlflow.tracking import MlflowClient

    run, first_rows, _ = logged
    state = json.loads((run / "loggers.json").read_text())["mlflow"]
    assert state["tracking_uri"] == f"sqlite:///{(run / 'mlflow' / 'mlflow.db').resolve()}"
    client = MlflowClient(tracking_uri=state["tracking_uri"])
    mlrun = client.get_run(state["run_id"])
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["train.lr"] == "0.003"
    assert json.loads(mlrun.data.params["model.attn"]) == ["softmax", "hybrid"]
    assert mlrun.data.params["run.resume"] == "false"  # a param keeps its first value
    rows = read_log(run, "train")
    for key in ("loss", "ppl", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "tokens"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(mlrun.info.run_id, f"train/{key}"))
        # steps 3..6 twice: sent by the killed run and again after the resume
        want = sorted([(r["step"], r[key]) for r in first_rows] + [(r["step"], r[key]) for r in rows[2:]])
        if key in STEADY:
            assert got == want, key
        else:
            assert [s for s, _ in got] == [s for s, _ in want] and set(want) <= set(got), key
    evals = client.get_metric_history(mlrun.info.run_id, "eval/val_loss")
    assert sorted((m.step, m.value) for m in evals)[-1] == (8, read_log(run, "eval")[-1]["val_loss"])


# --------------------------------------------------------------------------- TensorBoard


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_logged_rows_and_drops_the_killed_steps(tmp_path, argparse_corpus):
    pytest.importorskip("tensorboard")
    common = ["run.logger=tensorboard", "run.name=tb", "train.steps=6", "train.ckpt_every=2", "train.eval_every=3"]
    train(cfg_for(tmp_path, argparse_corpus, *common))
    run = tmp_path / "tb"
    shutil.rmtree(run / "checkpoints" / "step_000006")
    (run / "checkpoints" / "latest").unlink()
    train(cfg_for(tmp_path, argparse_corpus, *common, "run.resume=true"))
    scalars = tensorboard_scalars(run / "tensorboard")
    rows = read_log(run, "train")
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gib"):
        got = scalars[f"train/{key}"]
        assert [s for s, _ in got] == list(range(1, 7)), key  # steps 5 and 6 once: the killed run's purged
        assert [v for _, v in got] == pytest.approx([r[key] for r in rows], rel=1e-6), key  # float32 events
    assert "train/mfu" not in scalars  # None on the CPU: not logged
    assert [s for s, _ in scalars["eval/val_loss"]] == [3, 6]


@pytest.mark.parametrize("logger", ["none", ""], ids=["none", "unset"])
def test_none_turns_off_tensorboard_and_unset_keeps_it_when_installed(tmp_path, argparse_corpus, logger):
    import importlib.util

    installed = importlib.util.find_spec("tensorboard") is not None
    train(cfg_for(tmp_path, argparse_corpus, f"run.logger={logger!r}", "run.name=quiet", "train.steps=2",
                  "train.eval_every=0", "train.ckpt_every=0"))
    run = tmp_path / "quiet"
    assert (run / "tensorboard").is_dir() == (installed and logger == "")
    assert not (run / "loggers.json").exists() and [r["step"] for r in read_log(run, "train")] == [1, 2]
