"""Helpers for testing kvarn-vllm with real vLLM objects on a machine without a GPU.

The vLLM 0.23 CUDA wheel imports on a CPU-only machine, but its platform resolves to
``UnspecifiedPlatform`` and no config can be built. Forcing ``CpuPlatform`` *before* any
other vLLM module is imported (several capture ``current_platform`` at import time) makes
``EngineArgs``, config parsing, KV specs and ``get_kv_cache_configs`` work; the KVarN Triton
kernels then run in Triton's interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is
imported). :func:`prepare_cpu_test_env` does both and is a no-op on a CUDA machine.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TINY_LLAMA",
    "TINY_QWEN3",
    "ScheduledRequest",
    "patched_vllm",
    "prepare_cpu_test_env",
    "scheduler_output",
    "write_model_dir",
]

TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_LLAMA: dict[str, Any] = {
    **{k: v for k, v in TINY_QWEN3.items() if k != "attention_bias"},
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "head_dim": 64,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def prepare_cpu_test_env() -> bool:
    """Force vLLM's CPU platform and Triton's interpreter when there is no CUDA device.

    Returns True when the CPU platform is in use. Call it before importing vLLM modules.
    """
    import torch

    if torch.cuda.is_available():
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if not isinstance(platforms._current_platform, CpuPlatform):
        platforms._current_platform = CpuPlatform()  # type: ignore[assignment]
    return True


def write_model_dir(path: Path, config: dict[str, Any]) -> Path:
    """A model directory holding only ``config.json`` (for ``load_format="dummy"``)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


@contextlib.contextmanager
def patched_vllm() -> Iterator[None]:
    """Apply kvarn-vllm's patches for the duration of the block, then undo them."""
    from kvarn_vllm import _patches
    from kvarn_vllm.plugin import register

    was_applied = _patches.is_applied()
    register()
    try:
        yield
    finally:
        if not was_applied:
            _patches.revert_all()


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of an engine step, as vLLM's scheduler reports it."""

    req_id: str
    #: tokens scheduled this step
    num_tokens: int
    num_computed_tokens: int
    #: all the request's block ids (sent for new and resumed requests)
    block_ids: Sequence[int]
    new: bool = False
    prompt_token_ids: Sequence[int] = ()
    resumed: bool = False
    #: blocks allocated this step (a running request's additions)
    new_block_ids: Sequence[int] = ()
    num_output_tokens: int = 0


def scheduler_output(
    requests: Sequence[ScheduledRequest],
    finished: Iterable[str] = (),
    preempted: Iterable[str] = (),
) -> Any:
    """A vLLM 0.23 ``SchedulerOutput`` for one step of single-group (one KV-cache group)
    requests, without drafts or encoder inputs."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = []
    cached = CachedRequestData.make_empty()
    for r in requests:
        if r.new:
            new.append(
                NewRequestData(
                    req_id=r.req_id,
                    prompt_token_ids=list(r.prompt_token_ids),
                    mm_features=[],
                    sampling_params=None,
                    pooling_params=None,
                    block_ids=(list(r.block_ids),),
                    num_computed_tokens=r.num_computed_tokens,
                    lora_request=None,
                )
            )
            continue
        cached.req_ids.append(r.req_id)
        cached.num_computed_tokens.append(r.num_computed_tokens)
        cached.num_output_tokens.append(r.num_output_tokens)
        cached.new_token_ids.append([])
        if r.resumed:
            cached.resumed_req_ids.add(r.req_id)
            cached.new_block_ids.append((list(r.block_ids),))
        else:
            cached.new_block_ids.append((list(r.new_block_ids),) if r.new_block_ids else None)
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={r.req_id: r.num_tokens for r in requests},
        total_num_scheduled_tokens=sum(r.num_tokens for r in requests),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        num_common_prefix_blocks=[0],
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
        preempted_req_ids=set(preempted),
    )
