"""EXL3 routed MoE experts in vLLM's ``FusedMoE``, by reference dequantization.

:class:`Exl3MoEMethod` is the ``FusedMoE`` quantization method the ``exl3`` config
(:mod:`kvarn_ckpt.vllm_quant`) returns for an MoE layer whose routed experts are stored as
EXL3. It is vLLM's own unquantized fused-MoE method with a different way in:

1. **Loading.** ``create_weights`` registers placeholder parameters named so that the model's
   own ``load_weights`` (its ``expert_params_mapping``, which rewrites
   ``experts.{E}.gate_proj.`` to ``experts.w13_`` and ``down_proj`` to ``w2_``) routes each
   expert tensor to them with its ``expert_id`` and ``shard_id`` (``w1`` gate, ``w3`` up,
   ``w2`` down):

   * stock exllamav3 experts ``experts.{E}.{proj}.{trellis|suh|svh|su|sv|mcg|mul1}`` land in
     ``w13_<suffix>`` / ``w2_<suffix>``;
   * GLM TR3 rank slices ``experts.{E}.{proj}.rank{r}.<suffix>`` land in the submodules
     ``w13_rank{r}`` / ``w2_rank{r}`` (a dotted parameter name is a submodule path);
   * TR3 ``shared_h_v1`` vectors ``experts.shared_h.{proj}.rank{r}.{suh|svh}`` land in the
     submodule tree ``shared_h.{gate_proj|up_proj|down_proj|gate_up_proj}.rank{r}``
     (``gate_up_proj`` because DeepSeek-style loaders rename ``gate_proj``/``up_proj`` names
     to their stacked parameter before looking them up).

   Each loader keeps only what this rank needs: experts of other expert-parallel ranks are
   declined, and along the intermediate dimension only the Hadamard-aligned window of each
   stored slice that overlaps the rank's share (:func:`kvarn_ckpt.exl3.rank_pieces`), so a
   TR3 checkpoint sliced for TP4 loads at TP 1, 2, 4 or 8.
2. **After loading.** Every local expert's gate, up and down projections are decoded with
   the reference decoder (:func:`kvarn_ckpt.exl3_torch.dequantize`, float32, on the layer's
   device), cut to the rank's share, and written into dense ``w13_weight``
   ``[experts, 2 * intermediate, hidden]`` and ``w2_weight`` ``[experts, hidden,
   intermediate]`` in the model dtype, the layout vLLM's unquantized method expects. A
   missing tensor fails here, naming the layer, expert, projection and slice.
3. **Running.** Everything after that is :class:`UnquantizedFusedMoEMethod`: its weight
   post-processing and backend choice (Triton/FlashInfer on CUDA, the CPU fused MoE on CPU)
   and its ``apply``.

**Memory.** This is the correctness path: the experts are held dense in the model dtype,
``local_experts * 3 * hidden * intermediate_per_rank * 2`` bytes per layer in bf16/fp16
(about 4.7x a 3.4-bit EXL3 checkpoint's expert bytes), plus, until each layer is processed,
the raw EXL3 tensors of this rank in host memory. A fused EXL3 MoE GEMM is later work.

Not supported (fails closed with a message): experts with biases, non-gated activations,
expert-parallel load balancing (EPLB), dense ``.weight`` experts mixed into an EXL3 MoE layer
(including TR3's NVFP4-kept experts), TR3 schemas that do not put the experts under the
layer's own module path, and re-loading weights into an already processed layer.

Importing this module imports torch and vLLM.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module, Parameter
from vllm.model_executor.layers.fused_moe import FusedMoE
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

from kvarn_ckpt.exl3 import RankPiece, rank_pieces
from kvarn_ckpt.exl3_torch import codebook_from_markers, dequantize, unpack_signs

if TYPE_CHECKING:
    from kvarn_ckpt.vllm_quant import Exl3Config

__all__ = ["EXPERT_SUFFIXES", "Exl3MoEMethod", "MoELayout", "moe_layout"]

logger = logging.getLogger("kvarn_ckpt.vllm_moe")

EXPERT_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1")
_STATE = "_kvarn_exl3_moe"
_PROJ_NAME = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_GROUP_OF = {"w1": "w13", "w3": "w13", "w2": "w2"}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class MoELayout:
    """How one MoE layer's routed experts are stored.

    ``stored_slices`` is 1 for stock exllamav3 experts (one EXL3 linear per expert and
    projection) and the TR3 ``hybrid_tr3_tail.tp`` for rank-sliced experts; ``rank_named``
    says whether the tensor names carry ``.rank{r}``; ``shared_h`` whether the hidden-side
    vectors may come from TR3's per-(projection, rank) ``shared_h`` tensors, and
    ``shared_only`` whether they must (``rotation_layout: shared_h_v1``).
    """

    stored_slices: int = 1
    rank_named: bool = False
    shared_h: bool = False
    shared_only: bool = False
    source: str = "exl3"


def _tail_layers(tail: dict[str, Any]) -> tuple[int, int] | None:
    layers = tail.get("moe_layers")
    if (
        isinstance(layers, list)
        and len(layers) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
    ):
        return int(layers[0]), int(layers[1])
    return None


def _tr3_layout(tail: dict[str, Any], prefix: str, layer_idx: int, n_experts: int) -> MoELayout:
    """Check that a TR3 tail describes experts this method can route, for layer ``prefix``."""
    where = f"{prefix}: hybrid_tr3_tail"
    tp = tail.get("tp")
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"{where}.tp must be a positive integer, got {tp!r}")
    keep = tail.get("nvfp4_keep_per_layer", 0)
    if keep:
        raise NotImplementedError(
            f"{where}: nvfp4_keep_per_layer={keep} keeps some experts as NVFP4; the kvarn-ckpt "
            "reference path loads a layer's routed experts only when all of them are EXL3"
        )
    per_layer = tail.get("experts_per_layer")
    if per_layer is not None and per_layer != n_experts:
        raise ValueError(
            f"{where}.experts_per_layer is {per_layer!r} but the model's layer has "
            f"{n_experts} routed experts"
        )
    layout = tail.get("rotation_layout")
    if layout not in (None, "shared_h_v1", "per_expert_v1"):
        raise NotImplementedError(
            f"{where}.rotation_layout {layout!r} is unknown (shared_h_v1, per_expert_v1)"
        )
    schema = str(tail.get("tensor_schema", "")).replace("{L}", str(layer_idx))
    want = re.escape(prefix) + r"\.\{E\}\.\{proj\}\.rank\{r\}\.\{[A-Za-z0-9_|]+\}"
    if not re.fullmatch(want, schema):
        raise NotImplementedError(
            f"{where}.tensor_schema {tail.get('tensor_schema')!r} does not name experts as "
            f"'{prefix}.{{E}}.{{proj}}.rank{{r}}.{{...}}' under this layer's module path; the "
            "vLLM loader cannot route such names to the experts"
        )
    shared_text = tail.get("shared_h_tensor_schema")
    shared = False
    if shared_text is not None:
        shared_l = str(shared_text).replace("{L}", str(layer_idx))
        want_h = re.escape(prefix) + r"\.shared_h\.\{proj\}\.rank\{r\}\.\{[A-Za-z0-9_|]+\}"
        if not re.fullmatch(want_h, shared_l):
            raise NotImplementedError(
                f"{where}.shared_h_tensor_schema {shared_text!r} is not "
                f"'{prefix}.shared_h.{{proj}}.rank{{r}}.{{suh|svh}}'; the vLLM loader cannot "
                "route such names"
            )
        shared = True
    if layout == "shared_h_v1" and not shared:
        raise ValueError(f"{where}: rotation_layout shared_h_v1 needs a shared_h_tensor_schema")
    return MoELayout(tp, True, shared, layout == "shared_h_v1", "TR3")


def moe_layout(config: Exl3Config, layer: FusedMoE, prefix: str) -> MoELayout | None:
    """The storage layout of ``layer``'s routed experts, or ``None`` when they are not EXL3.

    TR3 (``hybrid_tr3_tail`` with ``format: exl3-trellis``) claims the layers in its
    ``moe_layers``; elsewhere a layer is EXL3 when the checkpoint index lists ``.trellis``
    tensors under its prefix (or, when the index could not be read, always).
    """
    tail = config.hybrid_tail
    m = _LAYER_RE.search(prefix + ".")
    layer_idx = int(m.group(1)) if m else None
    known = config.exl3_prefixes
    under = sorted(p for p in known or () if p.startswith(prefix + "."))
    if isinstance(tail, dict) and tail.get("format") == "exl3-trellis":
        span = _tail_layers(tail)
        if span is None:
            raise ValueError(f"{prefix}: hybrid_tr3_tail.moe_layers must be [first, last]")
        if layer_idx is not None and span[0] <= layer_idx <= span[1]:
            return _tr3_layout(tail, prefix, layer_idx, layer.logical_num_experts)
        if under:
            raise NotImplementedError(
                f"{prefix}: the checkpoint holds EXL3 expert tensors ({under[0]}, ...) outside "
                f"hybrid_tr3_tail.moe_layers {list(span)}"
            )
        return None
    if known is None or under:
        if any(re.fullmatch(r"rank\d+", p.rpartition(".")[2]) for p in under):
            raise NotImplementedError(
                f"{prefix}: expert tensors are rank-sliced ({under[0]}) but config.json has no "
                "hybrid_tr3_tail describing the slicing"
            )
        return MoELayout()
    return None


@dataclass
class _MoEState:
    """Per-layer loading state."""

    prefix: str
    layout: MoELayout
    hidden: int  # the checkpoint's hidden size (before any padding vLLM applies)
    hidden_param: int  # the dense parameters' hidden size
    inter_full: int  # intermediate size over all tensor-parallel ranks
    inter_part: int  # this rank's share
    num_local: int
    dtype: torch.dtype
    device: torch.device
    pieces: dict[int, RankPiece]
    #: local expert -> projection (w1/w3/w2) -> stored slice -> suffix -> tensor
    experts: dict[int, dict[str, dict[int, dict[str, torch.Tensor]]]] = field(default_factory=dict)
    #: (projection, stored slice) -> hidden-side vector from TR3 shared_h
    shared: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    to_global: dict[int, int] = field(default_factory=dict)


def _state(layer: Module) -> _MoEState:
    st = layer.__dict__.get(_STATE)
    if not isinstance(st, _MoEState):
        raise RuntimeError(f"{type(layer).__name__} was not set up by Exl3MoEMethod")
    return st


def _placeholder(device: torch.device | None = None) -> Parameter:
    return Parameter(torch.empty(0, dtype=torch.int16, device=device), requires_grad=False)


class Exl3MoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized fused MoE, fed by EXL3 experts decoded after loading."""

    def __init__(self, moe: FusedMoEConfig, layout: MoELayout, prefix: str) -> None:
        super().__init__(moe)
        self.layout = layout
        self.prefix = prefix

    @property
    def supports_eplb(self) -> bool:
        return False  # EPLB moves expert weights around; not wired to the EXL3 loaders

    def create_weights(  # type: ignore[no-untyped-def]
        self,
        layer: Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        if not isinstance(layer, FusedMoE):
            raise TypeError(f"Exl3MoEMethod serves FusedMoE layers, got {type(layer).__name__}")
        if self.moe.has_bias:
            raise NotImplementedError(
                f"{self.prefix}: EXL3 routed experts with biases are not supported"
            )
        if not self.moe.is_act_and_mul:
            raise NotImplementedError(
                f"{self.prefix}: EXL3 routed experts need a gated (act-and-mul) MLP"
            )
        tp_size, tp_rank = int(layer.tp_size), int(layer.tp_rank)
        unpadded = self.moe.intermediate_size_per_partition_unpadded
        inter_full = (intermediate_size_per_partition if unpadded is None else unpadded) * tp_size
        try:
            pieces = rank_pieces(inter_full, self.layout.stored_slices, tp_size, tp_rank)
        except ValueError as e:
            raise ValueError(
                f"{self.prefix}: intermediate size {inter_full} cannot be mapped from "
                f"{self.layout.stored_slices} stored slice(s) to tensor-parallel rank "
                f"{tp_rank} of {tp_size}: {e}"
            ) from e
        probe = torch.empty(0)  # the device vLLM builds the model on (a torch.device context)
        st = _MoEState(
            prefix=self.prefix,
            layout=self.layout,
            hidden=int(self.moe.hidden_dim_unpadded or hidden_size),
            hidden_param=hidden_size,
            inter_full=inter_full,
            inter_part=intermediate_size_per_partition,
            num_local=num_experts,
            dtype=params_dtype,
            device=probe.device,
            pieces={p.stored: p for p in pieces},
        )
        layer.__dict__[_STATE] = st
        for group in ("w13", "w2"):
            dense = _placeholder()
            dense.weight_loader = self._refuse_dense(layer)  # type: ignore[attr-defined]
            layer.register_parameter(f"{group}_weight", dense)
            for suffix in EXPERT_SUFFIXES:
                p = _placeholder()
                p.weight_loader = self._expert_loader(layer, group, 0, suffix, False)  # type: ignore[attr-defined]
                layer.register_parameter(f"{group}_{suffix}", p)
            if self.layout.rank_named:
                for r in range(self.layout.stored_slices):
                    holder = Module()
                    for suffix in EXPERT_SUFFIXES:
                        p = _placeholder()
                        p.weight_loader = self._expert_loader(layer, group, r, suffix, True)  # type: ignore[attr-defined]
                        holder.register_parameter(suffix, p)
                    layer.register_module(f"{group}_rank{r}", holder)
        if self.layout.shared_h:
            root = Module()
            for proj in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
                per_proj = Module()
                for r in range(self.layout.stored_slices):
                    holder = Module()
                    for leaf in ("suh", "svh"):
                        p = _placeholder()
                        p.weight_loader = self._shared_loader(layer, proj, r, leaf)  # type: ignore[attr-defined]
                        holder.register_parameter(leaf, p)
                    per_proj.register_module(f"rank{r}", holder)
                root.register_module(proj, per_proj)
            layer.register_module("shared_h", root)

    # -- loaders
    def _refuse_dense(self, layer: Module) -> Any:
        prefix = self.prefix

        def load(param: Parameter, loaded_weight: torch.Tensor, *args: Any, **kw: Any) -> None:
            raise ValueError(
                f"{prefix}: the checkpoint has a dense expert weight (expert "
                f"{kw.get('expert_id', '?')}, {kw.get('shard_id', '?')}) in a layer whose routed "
                "experts are EXL3; the kvarn-ckpt reference path needs all experts of a layer "
                "in one format"
            )

        return load

    def _expert_loader(
        self, layer: Module, group: str, stored: int, suffix: str, rank_named: bool
    ) -> Any:
        def load(
            param: Parameter,
            loaded_weight: torch.Tensor,
            weight_name: str | None = None,
            shard_id: str | None = None,
            expert_id: int | None = None,
            return_success: bool = False,
        ) -> bool | None:
            st = _state(layer)
            what = f"{st.prefix}: {weight_name or group + '_' + suffix}"
            if rank_named != st.layout.rank_named:
                raise ValueError(
                    f"{what}: expert tensors are "
                    + (
                        "rank-sliced but the layer's experts are stored whole"
                        if rank_named
                        else "stored whole but hybrid_tr3_tail declares rank-sliced experts"
                    )
                )
            if shard_id not in _GROUP_OF or _GROUP_OF[shard_id] != group or expert_id is None:
                raise ValueError(
                    f"{what}: expected an expert tensor with shard_id "
                    f"{'w1/w3' if group == 'w13' else 'w2'} and an expert_id, got "
                    f"shard_id={shard_id!r}, expert_id={expert_id!r}"
                )
            assert isinstance(layer, FusedMoE)
            local = int(layer._map_global_expert_id_to_local_expert_id(int(expert_id)))
            if local < 0:  # another expert-parallel rank's expert
                return False if return_success else None
            st.to_global[local] = int(expert_id)
            piece = st.pieces.get(stored)
            if piece is not None:
                t = self._slice(st, what, shard_id, suffix, loaded_weight, piece)
                st.experts.setdefault(local, {}).setdefault(shard_id, {}).setdefault(stored, {})[
                    suffix
                ] = t
            return True if return_success else None

        return load

    def _shared_loader(self, layer: Module, proj: str, stored: int, leaf: str) -> Any:
        def load(param: Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
            st = _state(layer)
            if proj == "gate_up_proj":
                if shard_id not in (0, 1):
                    raise ValueError(
                        f"{st.prefix}: shared_h gate_up_proj vector with shard id {shard_id!r}"
                    )
                key = "w1" if shard_id == 0 else "w3"
            else:
                key = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[proj]
            hside = "svh" if key == "w2" else "suh"
            name = f"{st.prefix}.shared_h.{_PROJ_NAME[key]}.rank{stored}.{leaf}"
            if leaf != hside:
                raise ValueError(
                    f"{name}: only the hidden-side vector ({hside}) of a "
                    f"{_PROJ_NAME[key]} slice is shared under shared_h"
                )
            if tuple(loaded_weight.shape) != (st.hidden,):
                raise ValueError(
                    f"{name} has shape {list(loaded_weight.shape)}; expected [{st.hidden}]"
                )
            if stored in st.pieces:
                st.shared[(key, stored)] = loaded_weight

        return load

    @staticmethod
    def _slice(
        st: _MoEState,
        what: str,
        proj: str,
        suffix: str,
        t: torch.Tensor,
        piece: RankPiece,
    ) -> torch.Tensor:
        """Check one stored tensor's shape and keep this rank's window of it."""
        if suffix in ("mcg", "mul1"):
            if t.numel() != 1:
                raise ValueError(f"{what}: a codebook marker is a scalar, got {list(t.shape)}")
            return t
        per_slice = st.inter_full // st.layout.stored_slices
        down = proj == "w2"
        n_in, n_out = (per_slice, st.hidden) if down else (st.hidden, per_slice)
        if suffix == "trellis":
            want: tuple[int, ...] = (n_in // 16, n_out // 16)
            got = tuple(t.shape[:2]) if t.dim() == 3 else tuple(t.shape)
            if t.dtype != torch.int16 or t.dim() != 3 or got != want:
                raise ValueError(
                    f"{what} is {t.dtype}{list(t.shape)}; expected int16 "
                    f"[{n_in // 16}, {n_out // 16}, 16*bits] for a {_PROJ_NAME[proj]} of "
                    f"hidden {st.hidden} and intermediate {per_slice} per stored slice"
                )
            if (piece.lo, piece.hi) == (0, per_slice):
                return t
            lo, hi = piece.lo // 16, piece.hi // 16
            return (t[lo:hi] if down else t[:, lo:hi]).clone()
        inter_side = (suffix in ("suh", "su")) == down
        div = 16 if suffix in ("su", "sv") else 1
        n = (per_slice if inter_side else st.hidden) // div
        if tuple(t.shape) != (n,):
            raise ValueError(f"{what} has shape {list(t.shape)}; expected [{n}]")
        if not inter_side:
            if st.layout.shared_only and suffix in ("suh", "svh"):
                raise ValueError(
                    f"{what}: rotation_layout shared_h_v1 keeps the hidden-side vector only "
                    "under shared_h; a per-expert copy makes the checkpoint ambiguous"
                )
            return t
        if (piece.lo, piece.hi) == (0, per_slice):
            return t
        # A copy, so that the rest of the stored slice is not kept alive by a view.
        return t[piece.lo // div : piece.hi // div].clone()

    # -- after loading
    def _decode(self, st: _MoEState, local: int, proj: str) -> torch.Tensor:
        """This rank's dense ``[in, out]`` float32 weight of one projection of one expert."""
        down = proj == "w2"
        axis = 0 if down else 1
        hside, hpacked = ("svh", "sv") if down else ("suh", "su")
        iside, ipacked = ("suh", "su") if down else ("svh", "sv")
        out = []
        gid = st.to_global.get(local, local)
        for r, piece in sorted(st.pieces.items()):
            t = st.experts.get(local, {}).get(proj, {}).get(r, {})
            where = f"{st.prefix}: expert {gid} {_PROJ_NAME[proj]}" + (
                f" rank{r}" if st.layout.rank_named else ""
            )
            if "trellis" not in t:
                raise ValueError(f"{where}: no .trellis was loaded; the checkpoint lacks it")
            inter = t[iside] if iside in t else unpack_signs(t[ipacked]) if ipacked in t else None
            if hside in t:
                hid: torch.Tensor | None = t[hside]
            elif hpacked in t:
                hid = unpack_signs(t[hpacked])
            else:
                hid = st.shared.get((proj, r))
            if inter is None or hid is None:
                missing = iside if inter is None else hside
                raise ValueError(
                    f"{where}: no .{missing} vector was loaded"
                    + (" (nor a shared_h one)" if inter is not None and st.layout.shared_h else "")
                )
            suh, svh = (inter, hid) if down else (hid, inter)
            codebook = codebook_from_markers(t.get("mcg"), t.get("mul1"))
            w = dequantize(
                t["trellis"].to(st.device), suh.to(st.device), svh.to(st.device), codebook
            )
            out.append(w.narrow(axis, piece.offset, piece.size))
        return torch.cat(out, dim=axis)

    def process_weights_after_loading(self, layer: Module) -> None:
        st = _state(layer)
        unexpected = sorted(e for e in st.experts if not 0 <= e < st.num_local)
        if unexpected:
            raise ValueError(f"{st.prefix}: tensors loaded for unknown local experts {unexpected}")
        h, ip = st.hidden, st.inter_part
        w13 = torch.zeros(st.num_local, 2 * ip, st.hidden_param, dtype=st.dtype, device=st.device)
        w2 = torch.zeros(st.num_local, st.hidden_param, ip, dtype=st.dtype, device=st.device)
        for e in range(st.num_local):
            gate, up, down = (self._decode(st, e, p) for p in ("w1", "w3", "w2"))
            w13[e, :ip, :h] = gate.t().to(st.dtype)
            w13[e, ip:, :h] = up.t().to(st.dtype)
            w2[e, :h, :] = down.t().to(st.dtype)
            st.experts.pop(e, None)  # free the raw tensors as we go
        for group in ("w13", "w2"):
            for suffix in (*EXPERT_SUFFIXES, "weight"):
                delattr(layer, f"{group}_{suffix}")
            for r in range(st.layout.stored_slices if st.layout.rank_named else 0):
                delattr(layer, f"{group}_rank{r}")
        if st.layout.shared_h:
            delattr(layer, "shared_h")
        st.shared.clear()
        layer.register_parameter("w13_weight", Parameter(w13, requires_grad=False))
        layer.register_parameter("w2_weight", Parameter(w2, requires_grad=False))
        logger.debug(
            "%s: decoded %d EXL3 experts into dense %s (%.1f MiB)",
            st.prefix,
            st.num_local,
            st.dtype,
            (w13.numel() + w2.numel()) * w13.element_size() / 2**20,
        )
        super().process_weights_after_loading(layer)
