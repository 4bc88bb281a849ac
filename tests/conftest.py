import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# a researcher's $ATTNLAB_RUNS (every sweep's run folders outside the checkout) would send the tests' sweeps
# there, and a copied experiment folder would then hold no run folders; tests that want it set it themselves
os.environ.pop("ATTNLAB_RUNS", None)
if not torch.cuda.is_available():  # Triton kernels run in its interpreter (set before Triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skipped here, run by benchmarks/gpu.py on one."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run by benchmarks/gpu.py on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_and_nan_fill():
    """Deterministic seeds; uninitialised memory (torch.empty) is NaN-filled so reads of it show up."""
    torch.manual_seed(0)
    prev = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = prev


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny shapes: more threads only add a barrier per op
    (slow on a busy machine). Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["kernel", "fallback"])
def cpu_kernels(request, monkeypatch):
    """Run the test on attnlab's compiled CPU kernels (ops/_ext.py; skipped where they cannot be built)
    and on the pure-PyTorch fast paths (ATTNLAB_NO_EXT=1). Returns "kernel" or "fallback"."""
    from attnlab.ops import _ext

    monkeypatch.delenv("ATTNLAB_NO_EXT", raising=False)
    if request.param == "kernel":
        if _ext.library() is None:
            pytest.skip("compiled kernels unavailable on this machine (no C++ compiler or build failed)")
    else:
        monkeypatch.setenv("ATTNLAB_NO_EXT", "1")
    return request.param


CODE = "def add(a, b):\n    '''Sum.'''\n    return a + b\n\nclass Box:\n    def __init__(self, x):\n        self.x = x\n"


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory) -> str:
    """A folder of six small Python files (the search tests' training and evaluation text)."""
    d = tmp_path_factory.mktemp("corpus")
    for i in range(6):
        (d / f"m{i}.py").write_text(CODE.replace("add", f"add{i}") * (i + 1))
    return str(d)


@pytest.fixture(scope="module")
def argparse_corpus(tmp_path_factory) -> str:
    """One real text file, the stdlib's argparse.py: the trainer tests' corpus."""
    import sysconfig
    from pathlib import Path

    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text(encoding="utf-8")
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    return str(path)


_XDIST_WORKER = False  # set in an xdist worker, whose controller writes the stream (each report once)


def pytest_configure(config):
    global _XDIST_WORKER
    _XDIST_WORKER = hasattr(config, "workerinput")  # not PYTEST_XDIST_WORKER: a pytest run inside a worker inherits it
    if os.environ.get("ATTNLAB_TRITON_FIRST_FIT"):  # the GPU check's tests: one working config, not the fastest
        from triton_first_fit import install

        install()


def failure_text(text: str, limit: int = 6000) -> str:
    """A failure's text within `limit` characters: its first error line onward (where the exception's
    message is) and its closing lines, the frames between cut."""
    if len(text) <= limit:
        return text
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("E ")), None)
    head = "\n".join(lines[first:])[: limit // 2] if first is not None else ""
    return head + "\n[...]\n" + text[-(limit - len(head)):]


def pytest_runtest_logreport(report):
    """With ATTNLAB_TEST_STREAM=PATH, one JSON line per test outcome (and per failed setup or teardown)
    is appended to PATH the moment pytest reports it, the failure's text included: a run killed at its
    time limit keeps every result and traceback it reached (the GPU check reads it; pytest itself prints
    tracebacks only in its closing summary). Under pytest-xdist the controller writes every worker's
    reports."""
    path = os.environ.get("ATTNLAB_TEST_STREAM")
    if not path or _XDIST_WORKER or not (report.when == "call" or report.failed or report.skipped):
        return
    import json

    row = {"test": report.nodeid, "when": report.when, "outcome": report.outcome.upper(),
           "seconds": round(report.duration, 2)}
    if report.failed:
        row["failure"] = failure_text(str(report.longrepr))
    elif report.skipped and isinstance(report.longrepr, tuple):
        row["reason"] = str(report.longrepr[-1])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
        fh.flush()
