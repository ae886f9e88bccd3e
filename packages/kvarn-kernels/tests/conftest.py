"""Test setup for kvarn-kernels.

Without a GPU the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET=1`` must be set
before ``triton`` decorates any kernel, so it is set here, before the package is imported.
Tests marked ``gpu`` (the real-size cases) are skipped when CUDA is unavailable.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """CUDA when present, else the CPU (kernels then run in the Triton interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture(autouse=True)
def _quiet_poison() -> None:
    # Poisoned memory (NaN pool rows, random record bytes) is read and discarded on purpose;
    # NumPy warns about the NaN arithmetic inside the interpreter.
    warnings.filterwarnings("ignore", category=RuntimeWarning)
    # The interpreter converts 1-element arrays to Python ints (a NumPy deprecation).
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="triton")
