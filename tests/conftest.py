import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _seed_and_nan_fill():
    """Deterministic seeds; uninitialised memory (torch.empty) is NaN-filled so reads of it show up."""
    torch.manual_seed(0)
    prev = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(False)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = prev
