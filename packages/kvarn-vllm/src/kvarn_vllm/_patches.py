"""Every vLLM symbol kvarn-vllm patches, in one place.

vLLM 0.23 has no hook for a new KV-cache dtype, for routing a dtype to a backend, or for a
layer's KV spec (see docs/vllm-plugin.md and the integration notes). Each entry of
:data:`PATCHES` names the symbol it replaces, why, the vLLM version it was written against,
and how it is undone; :func:`apply_all` checks every precondition before touching anything
(fail closed: a symbol that does not look as expected raises :class:`PatchError`), and
:func:`revert_all` restores the originals (the test fixture uses it). Every wrapper carries
``_kvarn_wrapped = True`` so that applying twice is a no-op.

| id | patched symbol | why |
|----|----------------|-----|
| P1 | ``vllm.config.cache.CacheDType``, ``vllm.v1.attention.selector.CacheDType``, ``vllm.engine.arg_utils.CacheDType``, ``CacheConfig.cache_dtype`` (annotation, dataclass field, pydantic schema), ``VllmConfig`` schema, ``arg_utils._compute_kwargs`` cache, ``utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE`` | admit the ``kvarn_*`` strings in config, CLI, selector and dtype map |
| P2 | ``type(current_platform).get_attn_backend_cls``; ``AttentionBackendEnum.CUSTOM`` registration | route KVarN layers to our backend *by dtype*, so full-precision skip layers keep vLLM's default backend |
| P3 | ``Attention.get_kv_cache_spec`` | the layer's page size is a packed record, not the dtype formula |
| P4 | ``EngineArgs.create_engine_config`` | block size = tile size; fail closed on unsupported models; sliding-window layers stay full precision |
| P5 | ``vllm.v1.engine.core.get_kv_cache_configs`` | charge the side pools and workspaces in the KV budget; log the KVarN capacity |
| P6 | ``vllm.v1.worker.gpu_worker.Worker.execute_model`` | give the side-pool tracker the request lifecycle (new / finished / preempted) |
"""

from __future__ import annotations

import functools
import inspect
import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, cast

from kvarn_format import VALID_DTYPES, is_kvarn_dtype, parse_cache_dtype

__all__ = ["PATCHES", "Patch", "PatchError", "apply_all", "is_applied", "revert_all"]

logger = logging.getLogger("vllm.kvarn")

TARGET_VLLM = "0.23"


class PatchError(RuntimeError):
    """A vLLM symbol kvarn-vllm patches is missing or does not look as expected."""


@dataclass(frozen=True, slots=True)
class Patch:
    """One patched vLLM symbol (or one tightly coupled set of symbols)."""

    id: str
    target: str
    why: str
    undo: str
    check: Callable[[], None]
    apply: Callable[[], None]
    revert: Callable[[], None]
    vllm_version: str = TARGET_VLLM


def _fail(what: str) -> PatchError:
    return PatchError(
        f"kvarn-vllm requires vllm {TARGET_VLLM}.x: {what}. This vLLM does not look like the "
        f"one kvarn-vllm was written for; install vllm=={TARGET_VLLM}.0 or a kvarn-vllm "
        "release for your vLLM."
    )


def _wrapped(fn: Any) -> bool:
    return bool(getattr(fn, "_kvarn_wrapped", False))


def _params(fn: Any) -> list[str]:
    return list(inspect.signature(fn).parameters)


# Originals of everything patched, for revert_all().
_SAVED: dict[str, Any] = {}


# ---------------------------------------------------------------------------------------------
# P1: admit the dtype strings


def _p1_check() -> None:
    import vllm.config.cache as cache_mod
    import vllm.engine.arg_utils as arg_utils
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.selector as selector
    from vllm.config import CacheConfig, VllmConfig

    for mod in (cache_mod, selector, arg_utils):
        if typing.get_origin(getattr(mod, "CacheDType", None)) is not Literal:
            raise _fail(f"{mod.__name__}.CacheDType is not a typing.Literal")
    if "cache_dtype" not in getattr(CacheConfig, "__dataclass_fields__", {}):
        raise _fail("CacheConfig has no dataclass field cache_dtype")
    if not hasattr(CacheConfig, "__pydantic_fields__") or not hasattr(
        VllmConfig, "__pydantic_fields__"
    ):
        raise _fail("CacheConfig/VllmConfig are not pydantic dataclasses")
    if not hasattr(arg_utils._compute_kwargs, "cache_clear"):
        raise _fail("engine.arg_utils._compute_kwargs is not lru_cached")
    if not isinstance(getattr(torch_utils, "STR_DTYPE_TO_TORCH_DTYPE", None), dict):
        raise _fail("utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE is not a dict")
    if "kv_cache_dtype" not in getattr(arg_utils.EngineArgs, "__dataclass_fields__", {}):
        raise _fail("EngineArgs has no field kv_cache_dtype")


def _rebuild_configs() -> None:
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.config import CacheConfig, VllmConfig
    from vllm.engine import arg_utils

    rebuild_dataclass(cast(Any, CacheConfig), force=True)
    rebuild_dataclass(cast(Any, VllmConfig), force=True)
    arg_utils._compute_kwargs.cache_clear()


def _p1_apply() -> None:
    import torch
    import vllm.config.cache as cache_mod
    import vllm.engine.arg_utils as arg_utils
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.selector as selector
    from pydantic import BeforeValidator
    from vllm.config import CacheConfig

    from kvarn_vllm.engine import validate_cache_dtype_string

    old = typing.get_args(cache_mod.CacheDType)
    if all(d in old for d in VALID_DTYPES):
        return
    _SAVED["P1"] = {
        "cache": cache_mod.CacheDType,
        "selector": getattr(selector, "CacheDType"),  # noqa: B009
        "arg_utils": getattr(arg_utils, "CacheDType"),  # noqa: B009
        "annotation": CacheConfig.__annotations__["cache_dtype"],
        "field": CacheConfig.__dataclass_fields__["cache_dtype"].type,
        "engine_field": arg_utils.EngineArgs.__dataclass_fields__["kv_cache_dtype"].type,
        "dtype_map": {d: torch_utils.STR_DTYPE_TO_TORCH_DTYPE.get(d) for d in VALID_DTYPES},
    }
    widened: Any = Literal[(*old, *(d for d in VALID_DTYPES if d not in old))]
    field_type = Annotated[widened, BeforeValidator(validate_cache_dtype_string)]
    for mod in (cache_mod, selector, arg_utils):
        setattr(mod, "CacheDType", widened)  # noqa: B010
    arg_utils.EngineArgs.__dataclass_fields__["kv_cache_dtype"].type = widened
    CacheConfig.__annotations__["cache_dtype"] = field_type
    CacheConfig.__dataclass_fields__["cache_dtype"].type = field_type
    for d in VALID_DTYPES:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE[d] = torch.uint8
    _rebuild_configs()


def _p1_revert() -> None:
    import vllm.config.cache as cache_mod
    import vllm.engine.arg_utils as arg_utils
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.attention.selector as selector
    from vllm.config import CacheConfig

    saved = _SAVED.pop("P1", None)
    if saved is None:
        return
    setattr(cache_mod, "CacheDType", saved["cache"])  # noqa: B010
    setattr(selector, "CacheDType", saved["selector"])  # noqa: B010
    setattr(arg_utils, "CacheDType", saved["arg_utils"])  # noqa: B010
    arg_utils.EngineArgs.__dataclass_fields__["kv_cache_dtype"].type = saved["engine_field"]
    CacheConfig.__annotations__["cache_dtype"] = saved["annotation"]
    CacheConfig.__dataclass_fields__["cache_dtype"].type = saved["field"]
    for d, value in saved["dtype_map"].items():
        if value is None:
            torch_utils.STR_DTYPE_TO_TORCH_DTYPE.pop(d, None)
        else:
            torch_utils.STR_DTYPE_TO_TORCH_DTYPE[d] = value
    _rebuild_configs()


# ---------------------------------------------------------------------------------------------
# P2: route KVarN layers to our backend by dtype


def _platform_cls() -> type[Any]:
    from vllm.platforms import current_platform

    return type(current_platform)


def _p2_check() -> None:
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    if not hasattr(AttentionBackendEnum, "CUSTOM"):
        raise _fail("AttentionBackendEnum has no CUSTOM member")
    current = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    if current is not None and not current.startswith("kvarn_vllm."):
        raise PatchError(
            f"kvarn-vllm needs vLLM's CUSTOM attention backend slot, but another plugin "
            f"registered {current} there; load only one of them (VLLM_PLUGINS=kvarn)"
        )
    method = getattr(_platform_cls(), "get_attn_backend_cls", None)
    if method is None:
        raise _fail(f"{_platform_cls().__name__} has no get_attn_backend_cls")
    if not _wrapped(method):
        params = _params(method)
        if params[:2] != ["selected_backend", "attn_selector_config"]:
            raise _fail(f"get_attn_backend_cls takes {params}")
    from vllm.v1.attention.selector import AttentionSelectorConfig

    for name in ("kv_cache_dtype", "use_mla", "attn_type", "head_size", "block_size"):
        if name not in AttentionSelectorConfig._fields:
            raise _fail(f"AttentionSelectorConfig has no field {name}")


def _route(
    original: Callable[..., str],
    klass: type[Any],
    selected_backend: Any,
    attn_selector_config: Any,
    num_heads: int | None = None,
) -> str:
    dtype = attn_selector_config.kv_cache_dtype
    if not (isinstance(dtype, str) and is_kvarn_dtype(dtype)):
        return original(selected_backend, attn_selector_config, num_heads)
    from kvarn_vllm.backend import backend_for

    if attn_selector_config.use_mla or not parse_cache_dtype(dtype).kind == "dense":
        raise ValueError(
            f"--kv-cache-dtype {dtype}: MLA attention with KVarN is not yet supported by "
            "kvarn-vllm; use --kv-cache-dtype auto or fp8 for MLA models"
        )
    backend = backend_for(dtype)
    reasons = backend.validate_configuration(
        device_capability=klass.get_device_capability(), **attn_selector_config._asdict()
    )
    if reasons:
        raise ValueError(
            f"--kv-cache-dtype {dtype} cannot serve an attention layer with "
            f"{attn_selector_config!r}: {'; '.join(reasons)}. Add the layer to "
            "--kv-cache-dtype-skip-layers or use --kv-cache-dtype auto/fp8."
        )
    if selected_backend is not None:
        logger.info(
            "kvarn: --attention-backend %s applies to full-precision layers only; KVarN "
            "layers use %s",
            selected_backend,
            backend.__name__,
        )
    return f"{backend.__module__}.{backend.__qualname__}"


def _p2_apply() -> None:
    from vllm.v1.attention.backends.registry import (
        _ATTN_OVERRIDES,
        AttentionBackendEnum,
        register_backend,
    )
    from vllm.v1.attention.selector import _cached_get_attn_backend

    if AttentionBackendEnum.CUSTOM not in _ATTN_OVERRIDES:
        register_backend(AttentionBackendEnum.CUSTOM, "kvarn_vllm.backend.KvarnAttentionBackend")
        _SAVED["P2.custom"] = True
    klass = _platform_cls()
    current = getattr(klass, "get_attn_backend_cls")  # noqa: B009
    if _wrapped(current):
        return
    own = klass.__dict__.get("get_attn_backend_cls")
    _SAVED["P2"] = (klass, own)
    original = current  # bound classmethod of the platform class

    def get_attn_backend_cls(
        cls: type[Any],
        selected_backend: Any,
        attn_selector_config: Any,
        num_heads: int | None = None,
    ) -> str:
        return _route(original, cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._kvarn_wrapped = True  # type: ignore[attr-defined]
    klass.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    _cached_get_attn_backend.cache_clear()


def _p2_revert() -> None:
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum
    from vllm.v1.attention.selector import _cached_get_attn_backend

    saved = _SAVED.pop("P2", None)
    if saved is not None:
        klass, own = saved
        if own is None:
            delattr(klass, "get_attn_backend_cls")
        else:
            klass.get_attn_backend_cls = own
    if _SAVED.pop("P2.custom", False):
        _ATTN_OVERRIDES.pop(AttentionBackendEnum.CUSTOM, None)
    _cached_get_attn_backend.cache_clear()


# ---------------------------------------------------------------------------------------------
# P3: the layer KV spec


def _p3_check() -> None:
    from vllm.model_executor.layers.attention import Attention

    method = getattr(Attention, "get_kv_cache_spec", None)
    if method is None:
        raise _fail("Attention has no get_kv_cache_spec")
    if not _wrapped(method) and _params(method) != ["self", "vllm_config"]:
        raise _fail(f"Attention.get_kv_cache_spec takes {_params(method)}")


def _other_pages(layer: Any, vllm_config: Any) -> list[int]:
    """Pages (bytes per block) of the layers that vLLM puts in other KV-cache groups."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        return []
    pages = []
    for other in get_layers_from_vllm_config(vllm_config, Attention).values():
        if other is layer or is_kvarn_dtype(other.kv_cache_dtype):
            continue
        if other.sliding_window is None or getattr(other, "kv_sharing_target_layer_name", None):
            continue
        spec = _SAVED["P3"](other, vllm_config)
        if spec is not None:
            pages.append(int(spec.page_size_bytes))
    return pages


def _kvarn_spec(layer: Any, vllm_config: Any) -> Any:
    from kvarn_format import record_layout
    from kvarn_vllm.specs import KvarnFullAttentionSpec, hybrid_tile_stride, record_tile_stride

    dtype = layer.kv_cache_dtype
    if layer.sliding_window is not None:
        raise ValueError(
            f"kvarn: layer {layer.layer_name} uses a sliding window; KVarN quantizes "
            "full-attention layers only. Keep 'sliding_window' in --kv-cache-dtype-skip-layers."
        )
    fmt = parse_cache_dtype(dtype)
    head = int(layer.head_size)
    hk = int(layer.num_kv_heads)
    align8 = record_layout(fmt, head).tile_bytes
    stride = align8
    others = _other_pages(layer, vllm_config)
    if others:
        pow2 = record_layout(fmt, head, slot_rounding="pow2").tile_bytes
        stride = hybrid_tile_stride(align8, hk, others)
        if stride != align8 and hybrid_tile_stride(pow2, hk, others) == pow2:
            stride = pow2  # prefer kvarn-format's own padded layout
    record_tile_stride(dtype, hk, head, stride)
    return KvarnFullAttentionSpec.for_layer(
        cache_dtype=dtype,
        block_size=int(vllm_config.cache_config.block_size),
        num_kv_heads=hk,
        head_size=head,
        tile_stride=stride,
    )


def _p3_apply() -> None:
    from vllm.model_executor.layers.attention import Attention

    if _wrapped(Attention.get_kv_cache_spec):
        return
    original = Attention.get_kv_cache_spec
    _SAVED["P3"] = original

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        if is_kvarn_dtype(getattr(self, "kv_cache_dtype", None)):
            return _kvarn_spec(self, vllm_config)
        return original(self, vllm_config)

    get_kv_cache_spec._kvarn_wrapped = True  # type: ignore[attr-defined]
    Attention.get_kv_cache_spec = get_kv_cache_spec  # type: ignore[method-assign]


def _p3_revert() -> None:
    from vllm.model_executor.layers.attention import Attention

    from kvarn_vllm.specs import clear_tile_strides

    original = _SAVED.pop("P3", None)
    if original is not None:
        Attention.get_kv_cache_spec = original  # type: ignore[method-assign]
    clear_tile_strides()


# ---------------------------------------------------------------------------------------------
# P4: engine config


def _p4_check() -> None:
    from vllm.engine.arg_utils import EngineArgs

    method = getattr(EngineArgs, "create_engine_config", None)
    if method is None:
        raise _fail("EngineArgs has no create_engine_config")
    if not _wrapped(method) and _params(method)[:1] != ["self"]:
        raise _fail(f"EngineArgs.create_engine_config takes {_params(method)}")
    if "block_size" not in EngineArgs.__dataclass_fields__:
        raise _fail("EngineArgs has no block_size field")


def _p4_apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from kvarn_vllm.engine import check_engine_config, prepare_engine_args

    if _wrapped(EngineArgs.create_engine_config):
        return
    original = EngineArgs.create_engine_config
    _SAVED["P4"] = original

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        prepare_engine_args(self)
        config = original(self, *args, **kwargs)
        check_engine_config(config)
        return config

    create_engine_config._kvarn_wrapped = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def _p4_revert() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = _SAVED.pop("P4", None)
    if original is not None:
        EngineArgs.create_engine_config = original  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------
# P5: KV budget


_CORE_FN = "get_kv_cache_configs"


def _p5_check() -> None:
    import vllm.v1.engine.core as core

    fn = getattr(core, _CORE_FN, None)
    if fn is None:
        raise _fail("vllm.v1.engine.core has no get_kv_cache_configs")
    if not _wrapped(fn) and _params(fn) != ["vllm_config", "kv_cache_specs", "available_memory"]:
        raise _fail(f"get_kv_cache_configs takes {_params(fn)}")


def kv_budget_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a ``get_kv_cache_configs`` so that KVarN's extra memory is charged first."""

    @functools.wraps(original)
    def get_kv_cache_configs(
        vllm_config: Any, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]
    ) -> Any:
        from kvarn_vllm.budget import log_capacity, shrink_available_memory

        shrunk, reservations = shrink_available_memory(
            vllm_config, kv_cache_specs, list(available_memory)
        )
        configs = original(vllm_config, kv_cache_specs, shrunk)
        if any(r is not None for r in reservations):
            log_capacity(vllm_config, configs, reservations, list(available_memory))
        return configs

    get_kv_cache_configs._kvarn_wrapped = True  # type: ignore[attr-defined]
    return get_kv_cache_configs


def _p5_apply() -> None:
    import vllm.v1.engine.core as core

    current = getattr(core, _CORE_FN)
    if _wrapped(current):
        return
    _SAVED["P5"] = current
    setattr(core, _CORE_FN, kv_budget_wrapper(current))


def _p5_revert() -> None:
    import vllm.v1.engine.core as core

    original = _SAVED.pop("P5", None)
    if original is not None:
        setattr(core, _CORE_FN, original)


# ---------------------------------------------------------------------------------------------
# P6: request lifecycle for the side-pool tracker


def _p6_check() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    method = getattr(Worker, "execute_model", None)
    if method is None:
        raise _fail("gpu_worker.Worker has no execute_model")
    if not _wrapped(method) and _params(method) != ["self", "scheduler_output"]:
        raise _fail(f"Worker.execute_model takes {_params(method)}")
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    needed = {
        SchedulerOutput: (
            "scheduled_new_reqs",
            "scheduled_cached_reqs",
            "num_scheduled_tokens",
            "scheduled_spec_decode_tokens",
            "finished_req_ids",
            "preempted_req_ids",
        ),
        NewRequestData: ("req_id", "block_ids", "num_computed_tokens"),
        CachedRequestData: ("req_ids", "resumed_req_ids", "new_block_ids", "num_computed_tokens"),
    }
    for cls, names in needed.items():
        have = getattr(cls, "__dataclass_fields__", {})
        missing = [n for n in names if n not in have]
        if missing:
            raise _fail(f"{cls.__name__} lacks {missing}")


def _p6_apply() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    from kvarn_vllm.runtime import observe_scheduler_output

    if _wrapped(Worker.execute_model):
        return
    original = Worker.execute_model
    _SAVED["P6"] = original

    @functools.wraps(original)
    def execute_model(self: Any, scheduler_output: Any) -> Any:
        observe_scheduler_output(self, scheduler_output)
        return original(self, scheduler_output)

    execute_model._kvarn_wrapped = True  # type: ignore[attr-defined]
    Worker.execute_model = execute_model  # type: ignore[method-assign]


def _p6_revert() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    original = _SAVED.pop("P6", None)
    if original is not None:
        Worker.execute_model = original  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------

PATCHES: tuple[Patch, ...] = (
    Patch(
        "P1",
        "vllm.config.cache.CacheDType (+ selector/arg_utils copies), CacheConfig.cache_dtype "
        "schema, VllmConfig schema, arg_utils._compute_kwargs cache, "
        "utils.torch_utils.STR_DTYPE_TO_TORCH_DTYPE",
        "vLLM validates cache_dtype against a closed Literal (config, selector, CLI choices) "
        "and maps dtype strings to torch dtypes; KVarN strings must pass all four (uint8 "
        "storage). Bad kvarn_* strings get kvarn-format's message listing the valid ones.",
        "restore the saved Literal/annotations, rebuild both pydantic schemas, clear the "
        "CLI kwargs cache, remove the dtype-map keys",
        _p1_check,
        _p1_apply,
        _p1_revert,
    ),
    Patch(
        "P2",
        "type(current_platform).get_attn_backend_cls; AttentionBackendEnum.CUSTOM",
        "the CUDA platform picks backends from a fixed priority list and --attention-backend "
        "would apply to the full-precision skip layers too; routing by the layer's dtype "
        "sends only KVarN layers to KvarnAttentionBackend (validated, fail closed).",
        "restore (or delete) the platform class attribute, unregister CUSTOM if we "
        "registered it, clear the selector's cache",
        _p2_check,
        _p2_apply,
        _p2_revert,
    ),
    Patch(
        "P3",
        "vllm.model_executor.layers.attention.Attention.get_kv_cache_spec",
        "vLLM sizes pages as 2*block*Hk*D*itemsize; a KVarN page is Hk packed records whose "
        "size comes from kvarn-format (KvarnFullAttentionSpec).",
        "restore the original method, forget recorded tile strides",
        _p3_check,
        _p3_apply,
        _p3_revert,
    ),
    Patch(
        "P4",
        "vllm.engine.arg_utils.EngineArgs.create_engine_config",
        "one block must be one tile (block size = G, a conflicting --block-size is an error); "
        "unsupported models fail closed at start-up; sliding-window layers stay full precision.",
        "restore the original method",
        _p4_check,
        _p4_apply,
        _p4_revert,
    ),
    Patch(
        "P5",
        "vllm.v1.engine.core.get_kv_cache_configs",
        "the fp16 side pools and the decode workspace are allocated with the KV cache, after "
        "memory profiling; they are subtracted from each worker's KV memory so vLLM never "
        "over-commits, and the resulting capacity is logged in tokens.",
        "restore the original function in vllm.v1.engine.core",
        _p5_check,
        _p5_apply,
        _p5_revert,
    ),
    Patch(
        "P6",
        "vllm.v1.worker.gpu_worker.Worker.execute_model",
        "attention metadata carries no request ids; the side-pool tracker needs the "
        "scheduler's new/finished/preempted requests and their block ids to reclaim slots "
        "and keep prefix-cached blocks valid (both model runners, every worker process).",
        "restore the original method",
        _p6_check,
        _p6_apply,
        _p6_revert,
    ),
)

_APPLIED = False


def is_applied() -> bool:
    return _APPLIED


def apply_all() -> None:
    """Check every precondition, then apply every patch (idempotent)."""
    global _APPLIED
    for patch in PATCHES:
        try:
            patch.check()
        except PatchError:
            raise
        except Exception as exc:  # an import or attribute error means a different vLLM
            raise _fail(f"patch {patch.id} ({patch.target}) cannot be checked: {exc!r}") from exc
    for patch in PATCHES:
        patch.apply()
    _APPLIED = True


def revert_all() -> None:
    """Undo every patch, newest first (tests)."""
    global _APPLIED
    for patch in reversed(PATCHES):
        patch.revert()
    _APPLIED = False
