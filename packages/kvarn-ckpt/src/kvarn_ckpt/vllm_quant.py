"""An out-of-tree vLLM quantization method ``exl3`` that runs EXL3 linears by reference dequant.

vLLM 0.23.0 has no EXL3 support. :func:`register` adds a ``QuantizationConfig`` named
``exl3`` through vLLM's public ``register_quantization_config``; kvarn-vllm's plugin calls it
from its own ``register()`` (docs/checkpoints.md §vLLM). It is picked up for:

* stock exllamav3 checkpoints (``quantization_config.quant_method == "exl3"``), and
* GLM TR3 checkpoints, whose ``quantization_config`` is a ModelOpt shim: the config's
  ``override_quantization_method`` claims the checkpoint when config.json carries a
  ``hybrid_tr3_tail`` block with ``format: "exl3-trellis"``.

What runs: each EXL3 linear (Replicated, ColumnParallel, MergedColumnParallel, QKVParallel,
RowParallel, and the ParallelLMHead, split over the vocabulary at any TP) receives its
``trellis``/``suh``/``svh``/``su``/``sv``/``mcg``/``mul1`` tensors through per-parameter
weight loaders that keep the layer's tensor-parallel share of them: the enclosing 128-aligned
window when the share does not fall on Hadamard blocks (:func:`kvarn_ckpt.exl3.aligned_window`),
cut exactly after decoding. After loading, each logical weight is dequantized once with the
reference decoder (exl3_torch.py) and the layer runs a plain ``F.linear``. Routed MoE experts
stored as EXL3, stock or TR3 rank-sliced, go through :class:`kvarn_ckpt.vllm_moe.Exl3MoEMethod`
(decoded into vLLM's dense fused-MoE layout, then vLLM's unquantized fused MoE). This is the
correctness path: memory is that of the dense weights, and fused EXL3 GEMMs are later work.

Importing this module imports torch and vLLM; ``import kvarn_ckpt`` never does.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import (
    QUANTIZATION_METHODS,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

from kvarn_ckpt.exl3 import aligned_window
from kvarn_ckpt.exl3_torch import codebook_from_markers, dequantize, unpack_signs

__all__ = ["EXL3_SUFFIXES", "Exl3Config", "Exl3LinearMethod", "register"]

logger = logging.getLogger("kvarn_ckpt.vllm_quant")

EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
_QKV_INDEX = {"q": 0, "k": 1, "v": 2}
_STATE = "_kvarn_exl3"


@dataclass
class _Exl3State:
    """Per-layer loading state: the layer's partition sizes and the tensors received so far,
    per logical weight (q/k/v or gate/up are separate EXL3 linears with their own vectors)."""

    in_features: int
    outs: list[int]
    dtype: torch.dtype
    parts: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: Per logical weight, the (offset, size) this rank keeps of its decoded input / output
    #: window along an axis that was cut off a 128-wide Hadamard block boundary.
    cut_in: dict[int, tuple[int, int]] = field(default_factory=dict)
    cut_out: dict[int, tuple[int, int]] = field(default_factory=dict)
    device: torch.device | None = None


def _state(layer: torch.nn.Module) -> _Exl3State:
    st = layer.__dict__.get(_STATE)
    if not isinstance(st, _Exl3State):
        raise RuntimeError(f"{type(layer).__name__} was not set up by Exl3LinearMethod")
    return st


def _exl3_prefixes(model_dir: Path) -> set[str] | None:
    """Module prefixes with a ``.trellis`` tensor, from the index (or the single shard)."""
    index = model_dir / "model.safetensors.index.json"
    names: list[str] = []
    try:
        if index.is_file():
            names = list(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
        else:
            from kvarn_ckpt.safetensors_header import read_header

            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                return None
            for f in files:
                names.extend(read_header(f).tensors)
    except (OSError, ValueError, KeyError):
        return None
    return {n[: -len(".trellis")] for n in names if n.endswith(".trellis")}


class Exl3Config(QuantizationConfig):
    """vLLM quantization config for EXL3 checkpoints (reference dequantization)."""

    def __init__(self, quant_config: dict[str, Any], hybrid_tail: dict[str, Any] | None = None):
        super().__init__()  # type: ignore[no-untyped-call]
        self.raw = quant_config
        self.hybrid_tail = hybrid_tail
        #: Checkpoint module prefixes stored as EXL3; ``None`` until the model dir is known.
        self.exl3_prefixes: set[str] | None = None

    def __repr__(self) -> str:
        return f"Exl3Config(reference dequant, {len(self.exl3_prefixes or ())} EXL3 modules)"

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]
        return "exl3"

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float16, torch.bfloat16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # plain torch ops: any device vLLM runs on

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Exl3Config:
        return cls(
            config,
            config.get("hybrid_tr3_tail")
            if isinstance(config.get("hybrid_tr3_tail"), dict)
            else None,
        )

    @classmethod
    def override_quantization_method(  # type: ignore[override]
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        if user_quant not in (None, "exl3"):
            return None
        if hf_quant_cfg.get("quant_method") == "exl3":
            return "exl3"
        tail = getattr(hf_config, "hybrid_tr3_tail", None) or hf_quant_cfg.get("hybrid_tr3_tail")
        if isinstance(tail, dict) and tail.get("format") == "exl3-trellis":
            return "exl3"
        return None

    def maybe_update_config(
        self, model_name: str, hf_config: Any = None, revision: str | None = None
    ) -> None:
        tail = getattr(hf_config, "hybrid_tr3_tail", None)
        if isinstance(tail, dict):
            self.hybrid_tail = tail
        path = Path(model_name)
        if not path.is_dir():
            try:
                from huggingface_hub import try_to_load_from_cache

                found = try_to_load_from_cache(model_name, "config.json", revision=revision)
                path = Path(found).parent if isinstance(found, str) else path
            except ImportError:
                pass
        if path.is_dir():
            self.exl3_prefixes = _exl3_prefixes(path)
        if self.exl3_prefixes is None:
            logger.warning(
                "kvarn-ckpt exl3: cannot list the EXL3 modules of %s; every linear layer is "
                "treated as EXL3 and one without EXL3 tensors will fail after loading",
                model_name,
            )

    # -- which layers are EXL3
    def _is_exl3(self, prefix: str) -> bool:
        if self.exl3_prefixes is None:
            return True
        if prefix in self.exl3_prefixes:
            return True
        head, _, last = prefix.rpartition(".")
        subs = self.packed_modules_mapping.get(last, [])
        hits = [f"{head}.{s}" if head else s for s in subs]
        flags = [h in self.exl3_prefixes for h in hits]
        if any(flags) and not all(flags):
            raise ValueError(
                f"{prefix} fuses {subs}, of which only some are EXL3 in the checkpoint; a fused "
                "vLLM layer needs all its parts in one format"
            )
        return any(flags)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from vllm.model_executor.layers.fused_moe import FusedMoE

        if isinstance(layer, FusedMoE):
            from kvarn_ckpt.vllm_moe import Exl3MoEMethod, moe_layout

            layout = moe_layout(self, layer, prefix)
            if layout is None:
                return None  # vLLM's unquantized fused MoE
            return Exl3MoEMethod(layer.moe_config, layout, prefix)
        if isinstance(layer, ParallelLMHead):
            return Exl3LinearMethod(self) if self._is_exl3(prefix) else None
        if isinstance(layer, LinearBase):
            return Exl3LinearMethod(self) if self._is_exl3(prefix) else UnquantizedLinearMethod()
        return None


def _shard_index(layer: torch.nn.Module, shard_id: object) -> int:
    if shard_id is None:
        return 0
    if isinstance(shard_id, str):
        if shard_id not in _QKV_INDEX:
            raise ValueError(f"unknown QKV shard id {shard_id!r}")
        return _QKV_INDEX[shard_id]
    if isinstance(shard_id, int):
        return shard_id
    raise ValueError(f"EXL3 layers load one shard at a time, got shard id {shard_id!r}")


def _out_range(layer: torch.nn.Module, shard: int, shard_id: object, full: int) -> tuple[int, int]:
    """The output columns [start, start+size) of logical weight ``shard`` held by this rank."""
    tp_rank: int = getattr(layer, "tp_rank", 0)
    tp_size: int = getattr(layer, "tp_size", 1)
    if isinstance(layer, QKVParallelLinear) and shard_id is None and tp_size > 1:
        raise ValueError("a fused qkv EXL3 tensor cannot be split over ranks; store q/k/v apart")
    if isinstance(layer, QKVParallelLinear) and shard_id is not None:
        if shard == 0:
            size = layer.num_heads * layer.head_size
            return tp_rank * size, size
        head = layer.head_size if shard == 1 else layer.v_head_size
        size = layer.num_kv_heads * head
        return (tp_rank // layer.num_kv_head_replicas) * size, size
    if isinstance(layer, ParallelLMHead):
        idx = layer.shard_indices
        return idx.org_vocab_start_index, idx.org_vocab_end_index - idx.org_vocab_start_index
    if isinstance(layer, (ReplicatedLinear, RowParallelLinear)):
        return 0, full
    if shard_id is None and isinstance(layer, MergedColumnParallelLinear):
        raise ValueError("a fused gate_up EXL3 tensor is not supported; store the parts")
    return tp_rank * (full // tp_size), full // tp_size


class Exl3LinearMethod(LinearMethodBase):
    """Loads EXL3 tensors per logical weight and runs the dequantized weight."""

    def __init__(self, config: Exl3Config) -> None:
        self.config = config

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        layer.__dict__[_STATE] = _Exl3State(
            input_size_per_partition, list(output_partition_sizes), params_dtype
        )
        for suffix in EXL3_SUFFIXES:
            param = Parameter(torch.empty(0, dtype=torch.int16), requires_grad=False)
            param.weight_loader = self._loader(layer, suffix)  # type: ignore[attr-defined]
            layer.register_parameter(suffix, param)

    def _loader(self, layer: torch.nn.Module, suffix: str) -> Any:
        def load(param: Parameter, loaded: torch.Tensor, loaded_shard_id: object = None) -> None:
            st = _state(layer)
            shard = _shard_index(layer, loaded_shard_id)
            sliced = self._slice(layer, suffix, loaded, shard, loaded_shard_id)
            st.parts.setdefault(shard, {})[suffix] = sliced
            st.device = param.device

        return load

    def _slice(
        self, layer: torch.nn.Module, suffix: str, t: torch.Tensor, shard: int, shard_id: object
    ) -> torch.Tensor:
        """This rank's part of one stored tensor: the Hadamard-aligned window around the
        rank's rows (RowParallel: input side) or columns (column-parallel and the lm_head:
        output side); the exact cut is recorded and applied after decoding."""
        if suffix in ("mcg", "mul1"):
            return t
        st = _state(layer)
        div = 16 if suffix in ("trellis", "su", "sv") else 1
        tp_rank: int = getattr(layer, "tp_rank", 0)
        if isinstance(layer, RowParallelLinear):
            if suffix in ("svh", "sv"):
                return t
            size = layer.input_size_per_partition
            lo, hi, off = aligned_window(tp_rank * size, size, t.shape[0] * div)
            st.cut_in[shard] = (off, size)
            return t[lo // div : hi // div]
        if suffix in ("suh", "su"):
            return t
        full = (t.shape[1] if suffix == "trellis" else t.shape[0]) * div
        start, size = _out_range(layer, shard, shard_id, full)
        if (start, size) == (0, full):
            return t
        lo, hi, off = aligned_window(start, size, full)
        st.cut_out[shard] = (off, size)
        if suffix == "trellis":
            return t[:, lo // 16 : hi // 16]
        return t[lo // div : hi // div]

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        st = _state(layer)
        n_shards = len(st.outs)
        name = getattr(layer, "prefix", type(layer).__name__)
        if sorted(st.parts) != list(range(n_shards)):
            raise ValueError(
                f"{name}: EXL3 tensors were loaded for parts {sorted(st.parts)} but the layer "
                f"has {n_shards} part(s); the checkpoint is missing EXL3 tensors for this layer"
            )
        device = st.device or torch.device("cpu")
        weights = []
        for i in range(n_shards):
            p = st.parts[i]
            if "trellis" not in p:
                raise ValueError(f"{name}: part {i} has no .trellis tensor")
            suh = p["suh"] if "suh" in p else unpack_signs(p["su"]) if "su" in p else None
            svh = p["svh"] if "svh" in p else unpack_signs(p["sv"]) if "sv" in p else None
            if suh is None or svh is None:
                raise ValueError(f"{name}: part {i} lacks its suh/svh sign vectors")
            codebook = codebook_from_markers(p.get("mcg"), p.get("mul1"))
            w = dequantize(p["trellis"].to(device), suh.to(device), svh.to(device), codebook)
            if i in st.cut_in:
                w = w.narrow(0, *st.cut_in[i])
            if i in st.cut_out:
                w = w.narrow(1, *st.cut_out[i])
            weights.append(w)
        w_all = torch.cat(weights, dim=1)  # [in, out]
        want_out = sum(st.outs)
        if isinstance(layer, ParallelLMHead) and w_all.shape[1] < want_out:
            w_all = F.pad(w_all, (0, want_out - w_all.shape[1]))  # padded vocab rows
        if tuple(w_all.shape) != (st.in_features, want_out):
            raise ValueError(
                f"{name}: EXL3 tensors decode to {list(w_all.shape)} ([in, out]) but the layer "
                f"expects [{st.in_features}, {want_out}] on this rank"
            )
        for suffix in EXL3_SUFFIXES:
            delattr(layer, suffix)
        layer.weight = Parameter(w_all.t().contiguous().to(st.dtype), requires_grad=False)
        st.parts.clear()
        st.cut_in.clear()
        st.cut_out.clear()

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = cast(torch.Tensor, layer.weight)
        return F.linear(x, weight.to(x.dtype), bias)


_REGISTERED = False


def register() -> None:
    """Register the ``exl3`` quantization method with vLLM (idempotent).

    Call it from a vLLM general plugin (kvarn-vllm's ``register()``), so that it runs in
    every vLLM process before model configs are parsed.
    """
    global _REGISTERED
    if _REGISTERED and "exl3" in QUANTIZATION_METHODS:
        return
    register_quantization_config("exl3")(Exl3Config)
    _REGISTERED = True
