"""Engine-level checks and defaults for KVarN dtypes (patch P4, ``EngineArgs.create_engine_config``).

Before vLLM builds its config: the dtype string must be an admitted KVarN format (else the
error lists the valid ones), and the block size is set to the format's tile size ``G`` (one
vLLM block = one tile); a different user block size is an error that says what to pass.

After: fail closed on everything this plugin does not serve (MLA models, Mamba/linear
hybrids, encoder-decoder and attention-free models, unsupported head sizes, pipeline or
context parallelism, KV connectors), and keep sliding-window layers in full precision by
adding ``"sliding_window"`` to ``kv_cache_dtype_skip_layers``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvarn_format import DENSE_DTYPES, DenseFormat, MLAFormat, is_kvarn_dtype, parse_cache_dtype
from kvarn_format.registry import check_dense_head_dim

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["check_engine_config", "prepare_engine_args", "validate_cache_dtype_string"]

logger = logging.getLogger("vllm.kvarn")


def validate_cache_dtype_string(value: Any) -> Any:
    """Reject strings that look like KVarN dtypes but are not admitted, with our message.

    Used as a pydantic before-validator on ``CacheConfig.cache_dtype`` (patch P1) so that a
    typo such as ``kvarn_k4v2_g32`` names every valid KVarN string instead of pydantic's list
    of literals. Other values pass through to vLLM's own validation.
    """
    if isinstance(value, str) and value.startswith("kvarn") and not is_kvarn_dtype(value):
        parse_cache_dtype(value)  # raises CacheDTypeError listing the valid strings
    return value


def _checkpoint_cache_dtype(args: Any) -> None:
    """Adopt a checkpoint's declared KV format when the user chose none (kvarn-ckpt).

    kvarn-ckpt is optional: without it nothing changes. With it, ``resolve_for_vllm`` returns
    the user's choice when one was given, the checkpoint's ``kv_cache_quant`` declaration
    otherwise (logging that it did), and raises when the two conflict in a way the model's
    geometry cannot take, so a wrong cache format fails at start-up instead of serving.
    """
    try:
        from kvarn_ckpt import resolve_for_vllm
    except ImportError:
        return
    model = getattr(args, "model", None)
    if not model:
        return
    user = getattr(args, "kv_cache_dtype", None)
    resolved = resolve_for_vllm(
        model,
        user,
        tensor_parallel_size=int(getattr(args, "tensor_parallel_size", 1) or 1),
        revision=getattr(args, "revision", None),
    )
    if resolved is not None and resolved != user:
        logger.info(
            "kvarn: using the KV cache format %s declared by checkpoint %s "
            "(no --kv-cache-dtype given)",
            resolved,
            model,
        )
        args.kv_cache_dtype = resolved


def prepare_engine_args(args: Any) -> None:
    """Validate the dtype and pin the block size to the tile size, before vLLM's config."""
    _checkpoint_cache_dtype(args)
    dtype = getattr(args, "kv_cache_dtype", None)
    if not (isinstance(dtype, str) and dtype.startswith("kvarn")):
        return
    fmt = parse_cache_dtype(dtype)
    group = fmt.group
    if args.block_size is not None and int(args.block_size) != group:
        raise ValueError(
            f"--kv-cache-dtype {dtype} stores {group}-token tiles and needs --block-size "
            f"{group} (one vLLM block = one tile); got --block-size {args.block_size}. Pass "
            f"--block-size {group} or leave it unset."
        )
    args.block_size = group


def check_engine_config(config: VllmConfig) -> None:
    """Fail closed on configurations the KVarN backend does not serve; set safe defaults."""
    cache = config.cache_config
    dtype = cache.cache_dtype
    if not is_kvarn_dtype(dtype):
        return
    fmt = parse_cache_dtype(dtype)
    model = config.model_config
    parallel = config.parallel_config
    what = f"--kv-cache-dtype {dtype}"
    name = getattr(model, "model", "this model")

    if getattr(model, "use_mla", False):
        raise ValueError(
            f"{what}: {name} uses multi-head latent attention (MLA); KVarN MLA formats are "
            "not yet supported by kvarn-vllm (a later release adds them). Use "
            "--kv-cache-dtype auto or fp8 for this model."
        )
    if isinstance(fmt, MLAFormat):
        raise ValueError(
            f"{what} is an MLA format but {name} is not an MLA model; use a dense KVarN "
            f"format: {', '.join(DENSE_DTYPES)}"
        )
    assert isinstance(fmt, DenseFormat)
    if getattr(model, "is_hybrid", False):
        raise ValueError(
            f"{what}: {name} mixes attention with Mamba/linear-attention layers; such hybrid "
            "models are not yet supported by kvarn-vllm"
        )
    if getattr(model, "is_encoder_decoder", False):
        raise ValueError(f"{what}: encoder-decoder models (cross-attention) are not supported")
    if getattr(model, "is_attention_free", False):
        raise ValueError(f"{what}: {name} has no attention layers, nothing to quantize")
    check_dense_head_dim(fmt, int(model.get_head_size()))

    if parallel.pipeline_parallel_size > 1:
        raise ValueError(f"{what}: pipeline parallelism is not yet supported (use --tp)")
    dcp = getattr(parallel, "decode_context_parallel_size", 1)
    pcp = getattr(parallel, "prefill_context_parallel_size", 1)
    if dcp > 1 or pcp > 1:
        raise ValueError(f"{what}: decode/prefill context parallelism is not supported")
    if config.kv_transfer_config is not None:
        raise ValueError(
            f"{what}: KV connectors (--kv-transfer-config) are not supported: they would move "
            "packed blocks without their fp16 side-pool tiles"
        )
    if cache.block_size % fmt.group:
        raise ValueError(
            f"{what} needs --block-size {fmt.group}; the platform chose {cache.block_size}"
        )

    skip = list(cache.kv_cache_dtype_skip_layers or [])
    if "sliding_window" not in skip:
        # The kernels attend to whole contexts; vLLM also frees out-of-window blocks while a
        # request runs, which would break the sink rule. Sliding-window layers stay in the
        # model dtype (a no-op for models without them).
        cache.kv_cache_dtype_skip_layers = [*skip, "sliding_window"]
    logger.info(
        "kvarn: %s (%d-bit K, %d-bit V, %d-token tiles): block size %d, full-precision layers: %s",
        fmt.name,
        fmt.key_bits,
        fmt.value_bits,
        fmt.group,
        cache.block_size,
        ", ".join(cache.kv_cache_dtype_skip_layers),
    )
