"""The ``vllm.general_plugins`` entry point: ``kvarn = "kvarn_vllm.plugin:register"``.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers,
the model-registry probe). Importing this module does nothing; ``register()`` checks the vLLM
version and every symbol it patches, then applies :mod:`kvarn_vllm._patches`. It is idempotent.

Failing closed matters here: vLLM logs and ignores an entry point that fails to *import*, but
an exception raised *inside* ``register()`` aborts the engine, so every check runs in here.
"""

from __future__ import annotations

import logging

__all__ = ["SUPPORTED_VLLM", "ensure_registered", "register"]

#: The vLLM minor version this plugin patches.
SUPPORTED_VLLM = "0.23"

logger = logging.getLogger("vllm.kvarn")


def _check_version(version: str) -> None:
    parts = version.split(".")
    if parts[:2] != SUPPORTED_VLLM.split("."):
        raise RuntimeError(
            f"kvarn-vllm requires vllm {SUPPORTED_VLLM}.x, found vllm {version}. Install "
            f"vllm=={SUPPORTED_VLLM}.0, or uninstall kvarn-vllm (or set VLLM_PLUGINS to "
            "exclude 'kvarn') to run this vLLM without KVarN."
        )


def register() -> None:
    """Apply every KVarN patch to this process's vLLM (idempotent, fail closed)."""
    import vllm

    from kvarn_vllm import _patches

    if _patches.is_applied():
        return
    _check_version(str(getattr(vllm, "__version__", "unknown")))
    _patches.apply_all()
    _register_checkpoint_loader()
    logger.debug("kvarn: registered (%d patches)", len(_patches.PATCHES))


def _register_checkpoint_loader() -> None:
    """Register kvarn-ckpt's ``exl3`` quantization method when kvarn-ckpt is installed.

    kvarn-ckpt loads KVarN-quantized checkpoints into vLLM through this plugin (it has no
    entry point of its own). Without it nothing changes; its own errors propagate (fail
    closed) because a half-registered loader would fail later and less clearly.
    """
    try:
        from kvarn_ckpt import vllm_quant
    except ImportError:
        return
    vllm_quant.register()


def ensure_registered() -> None:
    """The same as :func:`register`, for scripts and tests that never build ``EngineArgs``."""
    register()
