"""kvarn-vllm: serve a KVarN-quantized KV cache with vLLM 0.23, unchanged.

``pip install kvarn-vllm`` registers the ``vllm.general_plugins`` entry point
``kvarn = "kvarn_vllm.plugin:register"``; then ``vllm serve MODEL --kv-cache-dtype
kvarn_k4v2_g128`` just works. Importing this package imports nothing from vLLM: all the work
happens in :func:`kvarn_vllm.plugin.register`, which vLLM calls in each of its processes.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "ensure_registered", "register"]


def register() -> None:
    """Apply the plugin's patches (what vLLM's entry point calls)."""
    from kvarn_vllm.plugin import register as _register

    _register()


def ensure_registered() -> None:
    """Apply the plugin's patches if they are not applied yet (idempotent)."""
    from kvarn_vllm.plugin import ensure_registered as _ensure

    _ensure()


def __getattr__(name: str) -> Any:
    raise AttributeError(f"module 'kvarn_vllm' has no attribute {name!r}")
