"""EXL3 tensor conventions and header-only validation of EXL3 checkpoints.

Conventions (learned from exllamav3 1.6.5 ``modules/quant/exl3.py``, ``exl3_lib/quantize.py``
and its CUDA ``pack``/``codebook`` sources; see docs/checkpoints.md §EXL3 for the full text):

* A quantized linear ``{prefix}`` with ``in`` inputs and ``out`` outputs stores
  ``{prefix}.trellis`` int16 ``[in/16, out/16, 16*K]``: one 16x16 weight tile per
  (in-tile, out-tile), ``K`` bits per weight, so the last dim gives the bitrate. Half-integer
  rates (1.5/2.5/3.5) store ``16*KA + 8`` words and need the ``mul1`` codebook.
* ``{prefix}.suh`` fp16 ``[in]`` and ``{prefix}.svh`` fp16 ``[out]``: the input- and
  output-side sign/scale vectors of the Hadamard sandwich (legacy checkpoints store packed
  sign bits as int16 ``.su [in/16]`` / ``.sv [out/16]`` instead).
* An optional codebook marker: ``{prefix}.mcg`` or ``{prefix}.mul1``, a scalar int32 holding
  the codebook multiplier (0xCBAC1FED or 0x83DCD12D); no marker means the 3INST codebook.
* An optional ``{prefix}.bias`` ``[out]``.
* Both ``in`` and ``out`` are multiples of 128: the weight is rotated by 128-wide Hadamard
  blocks on both sides.

GLM TR3 checkpoints (``hybrid_tr3_tail``) slice each routed expert's gate/up/down projection
into ``tp`` rank slices named by ``tensor_schema``; with ``rotation_layout: shared_h_v1`` the
hidden-side vector of each (layer, projection, rank) is stored once under
``shared_h_tensor_schema`` instead of once per expert.
"""

from __future__ import annotations

import json
import re
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvarn_ckpt.checkpoint import Checkpoint
from kvarn_ckpt.problems import ProblemList
from kvarn_ckpt.safetensors_header import TensorInfo, read_tensor_bytes

__all__ = [
    "HADAMARD_BLOCK",
    "MCG_MULTIPLIER",
    "MUL1_MULTIPLIER",
    "Exl3Linear",
    "Exl3Report",
    "RankPiece",
    "aligned_window",
    "rank_pieces",
    "trellis_bits",
    "validate_exl3",
]

MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
HADAMARD_BLOCK = 128
#: Markers whose stored value is read back; above this count a deterministic sample is read.
MARKER_READ_LIMIT = 4096
_VECTOR_SUFFIXES = ("suh", "svh", "su", "sv", "mcg", "mul1")
_TORCH_DTYPE = {
    "torch.int16": "I16",
    "torch.float16": "F16",
    "torch.half": "F16",
    "torch.int32": "I32",
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
    "torch.float": "F32",
    "torch.uint32": "U32",
}
_PROJS = ("gate_proj", "up_proj", "down_proj")


def trellis_bits(last_dim: int) -> float | None:
    """Bits per weight of a trellis whose last dim is ``last_dim`` (``None`` if impossible).

    Integer rates 1..8 store ``16*K`` int16 words per 256-weight tile; the half-integer rates
    ``KA + 0.5`` (KA 1..3) alternate KA- and (KA+1)-bit steps and store ``16*KA + 8``.
    """
    if last_dim % 16 == 0 and 1 <= last_dim // 16 <= 8:
        return float(last_dim // 16)
    if last_dim % 16 == 8 and 1 <= (last_dim - 8) // 16 <= 3:
        return (last_dim - 8) / 16 + 0.5
    return None


def aligned_window(start: int, size: int, full: int) -> tuple[int, int, int]:
    """The Hadamard-aligned stretch ``[lo, hi)`` of a ``full``-long EXL3 axis that holds
    ``[start, start + size)``, and the offset of ``start`` inside it.

    An EXL3 weight is rotated by 128-wide Hadamard blocks along both axes, so a sub-range can
    be decoded on its own only when it starts and ends on a block boundary. A tensor-parallel
    rank whose range does not (an MoE intermediate size of 768 over 4 ranks: 192 each; a
    vocabulary shard of a padded lm_head) decodes this slightly larger window and keeps
    ``[offset, offset + size)`` of the result.
    """
    if full <= 0 or full % HADAMARD_BLOCK:
        raise ValueError(f"an EXL3 axis of {full} is not a positive multiple of {HADAMARD_BLOCK}")
    if start < 0 or size <= 0 or start + size > full:
        raise ValueError(f"range [{start}, {start + size}) is not inside [0, {full})")
    lo = start // HADAMARD_BLOCK * HADAMARD_BLOCK
    hi = min(full, -(-(start + size) // HADAMARD_BLOCK) * HADAMARD_BLOCK)
    return lo, hi, start - lo


@dataclass(frozen=True, slots=True)
class RankPiece:
    """What one serving rank takes from one stored slice of a sliced axis.

    ``stored`` is the index of the stored slice (a TR3 ``rank{r}``; 0 for an unsliced
    tensor); ``lo``/``hi`` the Hadamard-aligned window to decode, in that slice's own
    coordinates; ``offset``/``size`` the part of the decoded window this rank keeps; ``dest``
    where it goes in the rank's partition.
    """

    stored: int
    lo: int
    hi: int
    offset: int
    size: int
    dest: int


def rank_pieces(full: int, stored_slices: int, tp_size: int, tp_rank: int) -> list[RankPiece]:
    """Map a serving rank's contiguous share of a ``full``-long axis onto stored slices.

    The axis (an MoE intermediate dimension) is stored as ``stored_slices`` equal, contiguous
    slices (TR3 pre-slices experts for its encoder's TP; stock EXL3 stores one), and the
    serving engine gives rank ``tp_rank`` of ``tp_size`` the contiguous range
    ``[tp_rank * full / tp_size, (tp_rank + 1) * full / tp_size)``, the split vLLM's
    column- and row-parallel layers use. Any pair of sizes works: a rank may take several
    whole slices (serving TP below the stored one) or part of one (above it).
    """
    if stored_slices <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"bad split: {stored_slices} stored slices, rank {tp_rank} of {tp_size} ranks"
        )
    if full % stored_slices or full % tp_size:
        raise ValueError(
            f"an axis of {full} does not split into {stored_slices} stored slices and "
            f"{tp_size} serving ranks"
        )
    per_slice = full // stored_slices
    want_lo, want_hi = tp_rank * full // tp_size, (tp_rank + 1) * full // tp_size
    out = []
    for r in range(stored_slices):
        s_lo = r * per_slice
        a, b = max(want_lo, s_lo), min(want_hi, s_lo + per_slice)
        if a >= b:
            continue
        lo, hi, off = aligned_window(a - s_lo, b - a, per_slice)
        out.append(RankPiece(r, lo, hi, off, b - a, a - want_lo))
    return out


@dataclass(frozen=True, slots=True)
class Exl3Linear:
    """One validated EXL3 linear layer, with the names of the tensors that decode it."""

    prefix: str
    in_features: int
    out_features: int
    bits: float
    codebook: str  # "3inst" | "mcg" | "mul1"
    trellis: str
    suh: str | None  # fp16 input-side vector (possibly a shared-H tensor)
    svh: str | None
    su: str | None = None  # legacy packed signs
    sv: str | None = None
    marker: str | None = None
    bias: str | None = None


@dataclass
class Exl3Report:
    """What validation found: the linears, the bitrate summary and per-layer counts."""

    linears: dict[str, Exl3Linear] = field(default_factory=dict)
    exl3_tensors: int = 0
    quantized_weights: int = 0
    quantized_bits: float = 0.0
    bits_histogram: dict[float, int] = field(default_factory=dict)
    markers_checked: int = 0
    markers_total: int = 0
    tr3: dict[str, Any] | None = None

    @property
    def mean_bpw(self) -> float | None:
        if not self.quantized_weights:
            return None
        return self.quantized_bits / self.quantized_weights

    def as_dict(self) -> dict[str, Any]:
        return {
            "linears": len(self.linears),
            "exl3_tensors": self.exl3_tensors,
            "quantized_weights": self.quantized_weights,
            "mean_bits_per_weight": None if self.mean_bpw is None else round(self.mean_bpw, 6),
            "bits_histogram": {str(k): v for k, v in sorted(self.bits_histogram.items())},
            "markers_checked": self.markers_checked,
            "markers_total": self.markers_total,
            "tr3": self.tr3,
        }


# --------------------------------------------------------------------------- TR3 schema


@dataclass(frozen=True)
class _Schema:
    """A ``tensor_schema`` such as ``model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{a|b}``."""

    text: str
    base: str  # the part before the final ".{a|b|...}"
    leaves: tuple[str, ...]
    regex: re.Pattern[str]

    def name(self, leaf: str, **values: object) -> str:
        out = self.base
        for k, v in values.items():
            out = out.replace("{" + k + "}", str(v))
        return f"{out}.{leaf}"


def _compile_schema(text: object, allowed: set[str]) -> _Schema | None:
    if not isinstance(text, str):
        return None
    m = re.fullmatch(r"(.+)\.\{([A-Za-z0-9_|]+)\}", text)
    if not m:
        return None
    base, leaves = m.group(1), tuple(m.group(2).split("|"))
    pattern = ""
    pos = 0
    for ph in re.finditer(r"\{([A-Za-z]+)\}", base):
        if ph.group(1) not in allowed:
            return None
        pattern += re.escape(base[pos : ph.start()])
        kind = ph.group(1)
        pattern += f"(?P<{kind}>[A-Za-z0-9_]+)" if kind == "proj" else f"(?P<{kind}>\\d+)"
        pos = ph.end()
    pattern += re.escape(base[pos:]) + r"\.(?P<leaf>[A-Za-z0-9_]+)"
    return _Schema(text, base, leaves, re.compile(pattern))


def _plain_file(ckpt: Checkpoint, ref: str) -> Any | None:
    name = ref.split(":", 1)[0]
    path = ckpt.path / name
    if "/" in name or "\\" in name or not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _layer_field(doc: Any, layer: int, field_name: str, first_layer: int) -> Any:
    """Per-layer value from a tier file: ``{L: {field}}``, ``{"layers": {L: {field}}}``,
    ``{field: {L: ...}}`` or ``{field: [per layer from first_layer]}``."""
    if not isinstance(doc, dict):
        return None
    for holder in (doc, doc.get("layers")):
        if isinstance(holder, dict):
            entry = holder.get(str(layer))
            if isinstance(entry, dict) and field_name in entry:
                return entry[field_name]
    by_field = doc.get(field_name)
    if isinstance(by_field, dict):
        return by_field.get(str(layer))
    if isinstance(by_field, list) and 0 <= layer - first_layer < len(by_field):
        return by_field[layer - first_layer]
    return None


# --------------------------------------------------------------------------- validator


class _Validator:
    def __init__(self, ckpt: Checkpoint, problems: ProblemList) -> None:
        self.ckpt = ckpt
        self.t = ckpt.tensors
        self.p = problems
        self.report = Exl3Report()
        self.declared_codebook = ckpt.weight_format.codebook
        storage = (ckpt.quant_sidecar or {}).get("tensor_storage")
        self.storage: dict[str, Any] = storage if isinstance(storage, dict) else {}
        self.markers: list[TensorInfo] = []
        self.tail = ckpt.hybrid_tr3_tail if ckpt.weight_format.kind == "exl3-tr3" else None
        self.schema: _Schema | None = None
        self.shared_schema: _Schema | None = None
        self.layout: str | None = None
        self.expert_bits: dict[tuple[int, int], set[float]] = defaultdict(set)

    # -- helpers
    def _expect(
        self, name: str, dtype: set[str], shape: tuple[int, ...] | None, what: str
    ) -> TensorInfo | None:
        info = self.t.get(name)
        if info is None:
            self.p.error("exl3.missing_tensor", f"{what} {name} is missing", name)
            return None
        if info.dtype not in dtype:
            self.p.error(
                "exl3.dtype", f"{name} is {info.dtype}; expected {' or '.join(sorted(dtype))}", name
            )
            return None
        if shape is not None and info.shape != shape:
            self.p.error(
                "exl3.shape", f"{name} has shape {list(info.shape)}; expected {list(shape)}", name
            )
            return None
        return info

    def _shared_vector(self, prefix: str, leaf: str) -> str | None:
        """The shared-H tensor standing in for ``prefix.leaf`` under shared_h_v1."""
        if self.schema is None or self.shared_schema is None or self.layout != "shared_h_v1":
            return None
        m = self.schema.regex.fullmatch(f"{prefix}.trellis")
        if not m:
            return None
        values = {k: v for k, v in m.groupdict().items() if k in ("L", "proj", "r")}
        hside = "svh" if values.get("proj") == "down_proj" else "suh"
        if leaf != hside:
            return None  # only the hidden-side vector is shared; the other stays per expert
        return self.shared_schema.name(leaf, **values)

    # -- one linear
    def linear(self, prefix: str) -> Exl3Linear | None:
        tname = f"{prefix}.trellis"
        tr = self.t[tname]
        if tr.dtype != "I16" or len(tr.shape) != 3:
            self.p.error(
                "exl3.trellis",
                f"{tname} is {tr.dtype}{list(tr.shape)}; a trellis "
                "is int16 [in/16, out/16, 16*bits]",
                tname,
            )
            return None
        bits = trellis_bits(tr.shape[2])
        if bits is None:
            self.p.error(
                "exl3.bits",
                f"{tname} last dim {tr.shape[2]} is not 16*K for K in "
                "1..8 (or 16*K+8 for the half-integer rates)",
                tname,
            )
            return None
        n_in, n_out = tr.shape[0] * 16, tr.shape[1] * 16
        if n_in % HADAMARD_BLOCK or n_out % HADAMARD_BLOCK:
            self.p.error(
                "exl3.shape",
                f"{tname} decodes to a {n_in}x{n_out} weight; EXL3 "
                f"needs both dims to be multiples of {HADAMARD_BLOCK} (Hadamard "
                "blocks)",
                tname,
            )
            return None

        def side(fp: str, packed: str, n: int) -> tuple[str | None, str | None, bool]:
            if f"{prefix}.{fp}" in self.t:
                ok = self._expect(f"{prefix}.{fp}", {"F16"}, (n,), "sign/scale vector")
                return f"{prefix}.{fp}", None, ok is not None
            if f"{prefix}.{packed}" in self.t:
                ok = self._expect(f"{prefix}.{packed}", {"I16"}, (n // 16,), "packed signs")
                return None, f"{prefix}.{packed}", ok is not None
            shared = self._shared_vector(prefix, fp)
            if shared is not None:
                ok = self._expect(shared, {"F16"}, (n,), "shared-H vector")
                return shared, None, ok is not None
            self.p.error(
                "exl3.missing_tensor",
                f"{prefix}.{fp} (or {prefix}.{packed}) is "
                "missing"
                + (" and no shared-H vector resolves it" if self.layout == "shared_h_v1" else ""),
                prefix,
            )
            return None, None, False

        suh, su, ok_in = side("suh", "su", n_in)
        svh, sv, ok_out = side("svh", "sv", n_out)

        marker = None
        codebook = "3inst"
        present = [m for m in ("mcg", "mul1") if f"{prefix}.{m}" in self.t]
        if len(present) == 2:
            self.p.error("exl3.codebook", f"{prefix} has both .mcg and .mul1 markers", prefix)
            return None
        if present:
            codebook = present[0]
            marker = f"{prefix}.{codebook}"
            info = self._expect(marker, {"I32", "U32"}, None, "codebook marker")
            if info is None:
                return None
            if info.shape not in ((), (1,)):
                self.p.error(
                    "exl3.shape",
                    f"{marker} has shape {list(info.shape)}; a codebook marker is a scalar",
                    marker,
                )
                return None
            self.markers.append(info)
        if bits != int(bits) and codebook != "mul1":
            self.p.error(
                "exl3.codebook",
                f"{tname} is a half-integer rate ({bits} bpw), which "
                "exists only with the mul1 codebook",
                tname,
            )
        if self.declared_codebook is not None and codebook != self.declared_codebook:
            self.p.error(
                "exl3.codebook",
                f"{prefix} uses the {codebook} codebook (marker "
                f"{'absent' if marker is None else marker.rsplit('.', 1)[1]}) but the config "
                f"declares codebook {self.declared_codebook!r}",
                prefix,
            )
        bias = None
        if f"{prefix}.bias" in self.t and self._expect(
            f"{prefix}.bias", {"F16", "BF16", "F32"}, (n_out,), "bias"
        ):
            bias = f"{prefix}.bias"
        self._check_storage(prefix, bits, codebook)
        if not (ok_in and ok_out):
            return None
        lin = Exl3Linear(prefix, n_in, n_out, bits, codebook, tname, suh, svh, su, sv, marker, bias)
        self.report.linears[prefix] = lin
        self.report.quantized_weights += n_in * n_out
        self.report.quantized_bits += bits * n_in * n_out
        self.report.bits_histogram[bits] = self.report.bits_histogram.get(bits, 0) + 1
        return lin

    def _check_storage(self, prefix: str, bits: float, codebook: str) -> None:
        entry = self.storage.get(prefix)
        if not isinstance(entry, dict):
            return
        where = f"quantization_config.json:tensor_storage[{prefix}]"
        if entry.get("quant_format") not in (None, "exl3"):
            self.p.error(
                "sidecar.mismatch",
                f"{prefix} has an EXL3 trellis but tensor_storage "
                f"says quant_format {entry.get('quant_format')!r}",
                where,
            )
        bpw = entry.get("bits_per_weight")
        if isinstance(bpw, (int, float)) and float(bpw) != bits:
            self.p.error(
                "exl3.bits",
                f"tensor_storage says {prefix} has {bpw} bits per weight "
                f"but its trellis width means {bits:g}",
                where,
            )
        for cb, key, mult in (
            ("mcg", "mcg_multiplier", MCG_MULTIPLIER),
            ("mul1", "mul1_multiplier", MUL1_MULTIPLIER),
        ):
            val = entry.get(key)
            if (val is not None) != (codebook == cb):
                self.p.error(
                    "sidecar.mismatch",
                    f"tensor_storage {key}={val!r} disagrees with "
                    f"the stored marker (codebook {codebook})",
                    where,
                )
            elif val is not None and val != mult:
                self.p.error(
                    "exl3.marker_value",
                    f"tensor_storage {key}={val:#x}; exllamav3's {cb} multiplier is {mult:#x}",
                    where,
                )
        stored = entry.get("stored_tensors")
        if isinstance(stored, dict):
            for name, meta in stored.items():
                info = self.t.get(name)
                if info is None:
                    self.p.error(
                        "exl3.missing_tensor",
                        f"tensor_storage lists {name}, which no shard holds",
                        where,
                    )
                    continue
                if isinstance(meta, dict):
                    shape = meta.get("shape")
                    if isinstance(shape, list) and tuple(shape) != info.shape:
                        self.p.error(
                            "sidecar.mismatch",
                            f"tensor_storage gives {name} shape "
                            f"{shape}, the shard header {list(info.shape)}",
                            where,
                        )
                    dt = _TORCH_DTYPE.get(str(meta.get("dtype")))
                    if dt is not None and dt != info.dtype:
                        self.p.error(
                            "sidecar.mismatch",
                            f"tensor_storage gives {name} dtype "
                            f"{meta.get('dtype')}, the shard header {info.dtype}",
                            where,
                        )

    # -- markers
    def check_marker_values(self) -> None:
        ms = self.markers
        self.report.markers_total = len(ms)
        if not ms:
            return
        step = max(1, -(-len(ms) // MARKER_READ_LIMIT))
        sample = ms[::step]
        for info in sample:
            raw = read_tensor_bytes(info, max_bytes=8)
            (val,) = struct.unpack("<I", raw[:4])
            want = MCG_MULTIPLIER if info.name.endswith(".mcg") else MUL1_MULTIPLIER
            if val != want:
                self.p.error(
                    "exl3.marker_value",
                    f"{info.name} holds {val:#010x}; the "
                    f"{info.name.rsplit('.', 1)[1]} codebook marker is {want:#010x}",
                    info.name,
                )
        self.report.markers_checked = len(sample)
        if step > 1:
            self.p.info(
                "exl3.marker_sample",
                f"read {len(sample)} of {len(ms)} codebook "
                f"markers (every {step}th) to keep validation header-only",
            )

    # -- orphans and sidecar completeness
    def orphans(self, shared_names: set[str]) -> None:
        for name in self.t:
            prefix, _, leaf = name.rpartition(".")
            if (
                leaf in _VECTOR_SUFFIXES
                and f"{prefix}.trellis" not in self.t
                and name not in shared_names
            ):
                self.p.error(
                    "exl3.missing_tensor", f"{name} exists but {prefix}.trellis is missing", name
                )
        for key, entry in self.storage.items():
            if (
                isinstance(entry, dict)
                and entry.get("quant_format") == "exl3"
                and f"{key}.trellis" not in self.t
            ):
                self.p.error(
                    "exl3.missing_tensor",
                    f"tensor_storage lists EXL3 module {key} but {key}.trellis is in no shard",
                    key,
                )

    # -- generic completeness for stock exllamav3 checkpoints
    def layer_completeness(self, prefixes: list[str], skip: set[str]) -> None:
        layer_re = re.compile(r"^(?P<head>.*?layers)\.(?P<L>\d+)\.(?P<rest>.+)$")
        children: dict[tuple[str, str], set[str]] = defaultdict(set)  # (head, parent) -> kids
        present: dict[tuple[str, int, str], set[str]] = defaultdict(set)
        experts: dict[tuple[str, int, str], set[int]] = defaultdict(set)
        for prefix in prefixes:
            if prefix in skip:
                continue
            m = layer_re.match(prefix)
            if not m:
                continue
            head, layer, rest = m.group("head"), int(m.group("L")), m.group("rest")
            parent, _, child = rest.rpartition(".")
            children[(head, parent)].add(child)
            present[(head, layer, parent)].add(child)
            em = re.fullmatch(r"(?P<base>.*experts)\.(?P<E>\d+)", parent)
            if em:
                experts[(head, layer, em.group("base"))].add(int(em.group("E")))
        weights = {n.rsplit(".", 1)[0] for n in self.t if n.endswith(".weight")}
        for (head, layer, parent), kids in present.items():
            for child in sorted(children[(head, parent)] - kids):
                module = f"{head}.{layer}.{parent}.{child}" if parent else f"{head}.{layer}.{child}"
                if module not in weights:
                    self.p.error(
                        "exl3.missing_module",
                        f"{module} has neither a trellis nor a "
                        "weight, while the same module is EXL3 in other layers",
                        module,
                    )
        n_exp = (
            self.ckpt.language_config.get("n_routed_experts")
            or self.ckpt.language_config.get("num_experts")
            or self.ckpt.language_config.get("num_local_experts")
        )
        for (head, layer, base), ids in experts.items():
            expected = set(range(n_exp)) if isinstance(n_exp, int) else set(range(max(ids) + 1))
            missing = sorted(expected - ids)
            if missing:
                self.p.error(
                    "exl3.missing_expert",
                    f"{head}.{layer}.{base}: {len(missing)} "
                    f"expert(s) have no EXL3 tensors (first: {missing[:8]})",
                    f"{head}.{layer}.{base}",
                )


# --------------------------------------------------------------------------- TR3


def _tr3(v: _Validator) -> tuple[set[str], set[str]]:
    """Validate the rank-sliced TR3 expert set. Returns (TR3 prefixes, shared-H names)."""
    tail = v.tail or {}
    p = v.p
    where = "config.json:hybrid_tr3_tail"
    v.schema = _compile_schema(tail.get("tensor_schema"), {"L", "E", "proj", "r"})
    if v.schema is None:
        p.error(
            "tr3.schema",
            f"tensor_schema {tail.get('tensor_schema')!r} is not of the form "
            "'...{L}...{E}...{proj}...{r}.{trellis|suh|svh|mcg}'",
            where,
        )
        return set(), set()
    v.shared_schema = _compile_schema(tail.get("shared_h_tensor_schema"), {"L", "proj", "r"})
    shared_present = v.shared_schema is not None and any(
        v.shared_schema.regex.fullmatch(n) for n in v.t if ".shared_h." in n
    )
    layout = tail.get("rotation_layout")
    if layout is None:
        layout = "shared_h_v1" if shared_present else "per_expert_v1"
        p.info("tr3.layout", f"no rotation_layout; inferred {layout} from the tensor names", where)
    if layout not in ("shared_h_v1", "per_expert_v1"):
        p.error(
            "tr3.layout",
            f"rotation_layout {layout!r} is unknown (shared_h_v1, per_expert_v1)",
            where,
        )
        return set(), set()
    if layout == "shared_h_v1" and v.shared_schema is None:
        p.error(
            "tr3.schema",
            "rotation_layout shared_h_v1 needs a shared_h_tensor_schema like "
            "'...{L}...shared_h.{proj}.rank{r}.{suh|svh}'",
            where,
        )
        return set(), set()
    v.layout = layout

    def pos_int(key: str) -> int | None:
        val = tail.get(key)
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            p.error(
                "tr3.config",
                f"hybrid_tr3_tail.{key} must be a positive integer, got {val!r}",
                where,
            )
            return None
        return val

    tp, n_exp = pos_int("tp"), pos_int("experts_per_layer")
    layers = tail.get("moe_layers")
    if not (
        isinstance(layers, list)
        and len(layers) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in layers)
        and 0 <= layers[0] <= layers[1]
    ):
        p.error(
            "tr3.config", f"hybrid_tr3_tail.moe_layers must be [first, last], got {layers!r}", where
        )
        return set(), set()
    if tp is None or n_exp is None:
        return set(), set()
    first, last = layers
    lang = v.ckpt.language_config
    hidden_raw, inter_raw = lang.get("hidden_size"), lang.get("moe_intermediate_size")
    hidden = hidden_raw if isinstance(hidden_raw, int) else 0
    inter = inter_raw if isinstance(inter_raw, int) else 0
    shapes_ok = hidden > 0 and inter > 0
    if not shapes_ok:
        p.error(
            "tr3.config",
            "config.json lacks hidden_size / moe_intermediate_size; expert "
            "shapes cannot be checked",
            v.ckpt.language_config_where,
        )
    elif inter % tp or (inter // tp) % HADAMARD_BLOCK:
        p.error(
            "tr3.config",
            f"moe_intermediate_size {inter} does not split into {tp} rank "
            f"slices that are multiples of {HADAMARD_BLOCK}",
            where,
        )
        shapes_ok = False
    codebook = tail.get("codebook")
    want_marker = codebook if codebook in ("mcg", "mul1") else None
    mult = tail.get("mcg_multiplier")
    if mult is not None and mult != MCG_MULTIPLIER:
        p.error(
            "exl3.marker_value",
            f"hybrid_tr3_tail.mcg_multiplier={mult!r}; the mcg "
            f"multiplier is {MCG_MULTIPLIER} ({MCG_MULTIPLIER:#x})",
            where,
        )

    # Bits rule.
    bits = tail.get("bits")
    k_values: set[float] | None = None
    tier_doc: Any = None
    tier_field = None
    if isinstance(bits, (int, float)) and not isinstance(bits, bool):
        k_values = {float(bits)}
    elif bits == "mixed":
        kv = tail.get("k_values")
        if isinstance(kv, list) and kv and all(isinstance(k, int) for k in kv):
            k_values = {float(k) for k in kv}
        else:
            p.warning(
                "tr3.config",
                "bits is 'mixed' without a k_values list; per-expert bits "
                "are only checked against tier files",
                where,
            )
        ref = tail.get("bits_per_expert")
        if isinstance(ref, str) and ":" in ref:
            tier_doc = _plain_file(v.ckpt, ref)
            tier_field = ref.split(":", 1)[1]
            if tier_doc is None:
                p.warning(
                    "tr3.tier_file",
                    f"bits_per_expert points to {ref!r}, which is not a "
                    "readable JSON file in the checkpoint; per-expert bits unchecked",
                    where,
                )
    else:
        p.error(
            "tr3.config", f"hybrid_tr3_tail.bits must be a number or 'mixed', got {bits!r}", where
        )
    keep = tail.get("nvfp4_keep_per_layer", 0)
    keep_doc = _plain_file(v.ckpt, str(tail.get("tier_bitmap"))) if keep else None

    inter_r = inter // tp if shapes_ok else 0
    prefixes: set[str] = set()
    shared: set[str] = set()
    tr3_counts: dict[int, tuple[int, int]] = {}
    expected_total = found_total = 0
    # One pass over the names: per-layer counts, and names outside the declared ranges.
    schema_counts: Counter[int] = Counter()
    for n in v.t:
        m = v.schema.regex.fullmatch(n)
        if m is None:
            continue
        lyr, e, proj, r = int(m.group("L")), int(m.group("E")), m.group("proj"), int(m.group("r"))
        if not (
            first <= lyr <= last
            and e < n_exp
            and proj in _PROJS
            and r < tp
            and m.group("leaf") in v.schema.leaves
        ):
            p.error(
                "tr3.unexpected",
                f"{n} matches tensor_schema but lies outside layers "
                f"{first}..{last}, experts <{n_exp}, projections {_PROJS}, ranks <{tp}",
                n,
            )
            continue
        schema_counts[lyr] += 1
    for layer in range(first, last + 1):
        skip: set[int] = set()
        if keep:
            lst = _layer_field(keep_doc, layer, "keep_nvfp4", first)
            if isinstance(lst, list):
                skip = {e for e in lst if isinstance(e, int)}
            elif layer == first:
                p.warning(
                    "tr3.tier_file",
                    f"nvfp4_keep_per_layer={keep} but the kept experts "
                    "cannot be read from tier_bitmap; all experts are expected as EXL3",
                    where,
                )
        expected = 0
        layer_shared: list[str] = []
        for proj in _PROJS:
            for r in range(tp):
                if layout == "shared_h_v1":
                    leaf = "svh" if proj == "down_proj" else "suh"
                    name = v.shared_schema.name(leaf, L=layer, proj=proj, r=r)  # type: ignore[union-attr]
                    shared.add(name)
                    layer_shared.append(name)
                    expected += 1
                    v._expect(name, {"F16"}, (hidden,) if shapes_ok else None, "shared-H vector")
        per_tensor = 3 + (1 if want_marker else 0) - (1 if layout == "shared_h_v1" else 0)
        per_bits = _layer_field(tier_doc, layer, tier_field, first) if tier_field else None
        for e in range(n_exp):
            if e in skip:
                continue
            for proj in _PROJS:
                for r in range(tp):
                    expected += per_tensor
                    prefix = v.schema.name("trellis", L=layer, E=e, proj=proj, r=r)[:-8]
                    prefixes.add(prefix)
                    _tr3_slice(v, prefix, proj, layer, e, hidden, inter_r, shapes_ok, layout)
            ks = v.expert_bits.get((layer, e), set())
            if len(ks) > 1:
                p.error(
                    "tr3.bits",
                    f"layer {layer} expert {e} mixes bitrates {sorted(ks)} across its slices",
                    f"layer {layer} expert {e}",
                )
            for k in ks:
                if k_values is not None and k not in k_values:
                    p.error(
                        "tr3.bits",
                        f"layer {layer} expert {e} is K{k:g}, not one of the "
                        f"declared {sorted(k_values)}",
                        f"layer {layer} expert {e}",
                    )
                if (
                    isinstance(per_bits, list)
                    and e < len(per_bits)
                    and isinstance(per_bits[e], (int, float))
                    and float(per_bits[e]) != k
                ):
                    p.error(
                        "tr3.bits",
                        f"layer {layer} expert {e} is K{k:g} but "
                        f"{tail.get('bits_per_expert')} says K{per_bits[e]}",
                        f"layer {layer} expert {e}",
                    )
        found = schema_counts[layer] + sum(1 for n in layer_shared if n in v.t)
        tr3_counts[layer] = (expected, found)
        expected_total += expected
        found_total += found
        if found != expected:
            p.error(
                "tr3.count",
                f"layer {layer}: expected {expected} TR3 tensors "
                f"({n_exp - len(skip)} experts x 3 projections x {tp} ranks, {layout}), "
                f"found {found}",
                f"layer {layer}",
            )
    v.report.tr3 = {
        "layout": layout,
        "tp": tp,
        "moe_layers": [first, last],
        "experts_per_layer": n_exp,
        "expected_tensors": expected_total,
        "found_tensors": found_total,
    }
    policy = tail.get("protected_tensor_policy")
    if isinstance(policy, dict) and isinstance(policy.get("tensors"), dict):
        for prefix, rule in policy["tensors"].items():
            _protected(v, prefix, rule)
    return prefixes, shared


def _tr3_slice(
    v: _Validator,
    prefix: str,
    proj: str,
    layer: int,
    e: int,
    hidden: int,
    inter_r: int,
    shapes_ok: bool,
    layout: str,
) -> None:
    tname = f"{prefix}.trellis"
    info = v.t.get(tname)
    if info is None:
        v.p.error("exl3.missing_tensor", f"{tname} is missing", tname)
        return
    if info.dtype == "I16" and len(info.shape) == 3:
        k = trellis_bits(info.shape[2])
        if k is not None:
            v.expert_bits[(layer, e)].add(k)
        if shapes_ok:
            want = (
                (hidden // 16, inter_r // 16)
                if proj != "down_proj"
                else (inter_r // 16, hidden // 16)
            )
            if info.shape[:2] != want:
                v.p.error(
                    "exl3.shape",
                    f"{tname} has tiles {list(info.shape[:2])}; a "
                    f"{proj} rank slice needs {list(want)} (hidden {hidden}, "
                    f"intermediate/rank {inter_r})",
                    tname,
                )
    # Missing local/hidden-side vectors and markers are reported by the per-linear check;
    # here only what is specific to the rank-sliced layout.
    hside = "svh" if proj == "down_proj" else "suh"
    if layout == "shared_h_v1" and f"{prefix}.{hside}" in v.t:
        v.p.error(
            "tr3.layout",
            f"{prefix}.{hside} is stored per expert, but shared_h_v1 keeps "
            "it only under shared_h; which one applies is ambiguous",
            prefix,
        )


def _protected(v: _Validator, prefix: str, rule: Any) -> None:
    where = f"hybrid_tr3_tail.protected_tensor_policy[{prefix}]"
    tname = f"{prefix}.trellis"
    info = v.t.get(tname)
    if info is None:
        v.p.error("exl3.missing_tensor", f"protected tensor {tname} is missing", where)
        return
    bits = rule.get("bits") if isinstance(rule, dict) else None
    if (
        info.dtype == "I16"
        and len(info.shape) == 3
        and isinstance(bits, int)
        and info.shape[2] != 16 * bits
    ):
        v.p.error(
            "exl3.bits",
            f"{tname} last dim {info.shape[2]} != 16*{bits} declared by the "
            "protected tensor policy",
            where,
        )
    if f"{prefix}.mcg" not in v.t:
        v.p.error("exl3.codebook", f"protected tensor {prefix} lacks its .mcg marker", where)
    if f"{prefix}.mul1" in v.t:
        v.p.error(
            "exl3.codebook", f"protected tensor {prefix} must not carry a .mul1 marker", where
        )


def validate_exl3(ckpt: Checkpoint, problems: ProblemList) -> Exl3Report:
    """Validate every EXL3 tensor of ``ckpt`` from headers (plus a few 4-byte markers)."""
    v = _Validator(ckpt, problems)
    tr3_prefixes: set[str] = set()
    shared: set[str] = set()
    if v.tail is not None:
        tr3_prefixes, shared = _tr3(v)
    prefixes = sorted(n[: -len(".trellis")] for n in ckpt.tensors if n.endswith(".trellis"))
    for prefix in prefixes:
        v.linear(prefix)
    v.report.exl3_tensors = sum(
        1 for n in ckpt.tensors if n.rpartition(".")[2] in (*_VECTOR_SUFFIXES, "trellis")
    )
    v.orphans(shared)
    if v.tail is None:
        v.layer_completeness(prefixes, tr3_prefixes)
    v.check_marker_values()
    if not prefixes:
        problems.error(
            "exl3.empty",
            "the config declares EXL3 weights but no shard holds a .trellis tensor",
            "config.json",
        )
    return v.report


def summarize_dtypes(ckpt: Checkpoint) -> dict[str, int]:
    """Element counts per stored dtype, over every tensor (for bits-per-parameter)."""
    c: Counter[str] = Counter()
    for info in ckpt.tensors.values():
        c[info.dtype] += info.numel
    return dict(c)
