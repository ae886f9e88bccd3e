"""Test setup for kvarn-vllm: real vLLM 0.23 objects on the CPU platform.

Without a GPU, vLLM's CPU platform is forced and Triton runs in its interpreter; both must
happen before vLLM and triton are imported, so they happen here. The ``kvarn`` fixture applies
the plugin's patches for one test and undoes them afterwards, so the rest of the suite sees
an unpatched vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvarn_vllm.testing import (
    TINY_LLAMA,
    TINY_QWEN3,
    patched_vllm,
    prepare_cpu_test_env,
    write_model_dir,
)

ON_CPU = prepare_cpu_test_env()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not ON_CPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def kvarn() -> Iterator[None]:
    """The plugin's patches, applied for one test and reverted after it."""
    with patched_vllm():
        yield


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("qwen3"), TINY_QWEN3)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("llama"), TINY_LLAMA)
