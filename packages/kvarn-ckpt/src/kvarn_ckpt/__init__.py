"""kvarn-ckpt: read, validate and load KVarN-quantized checkpoints.

Importing this package imports neither torch nor vLLM: the torch reference decoder
(:mod:`kvarn_ckpt.exl3_torch`) and the vLLM quantization method (:mod:`kvarn_ckpt.vllm_quant`)
are separate modules, imported only by whoever needs them.
"""

from kvarn_ckpt.annotate import AnnotateResult, annotate
from kvarn_ckpt.checkpoint import Checkpoint, WeightFormat, open_checkpoint
from kvarn_ckpt.declaration import (
    DECLARATION_KEY,
    DECLARATION_VERSION,
    KVDeclaration,
    build_declaration,
    find_declaration,
)
from kvarn_ckpt.exl3 import Exl3Linear, Exl3Report, trellis_bits, validate_exl3
from kvarn_ckpt.heuristic import NameHint, name_hint
from kvarn_ckpt.inspection import InspectReport, format_report, inspect_checkpoint
from kvarn_ckpt.model_config import AttentionGeometry, read_geometry
from kvarn_ckpt.problems import (
    CheckpointError,
    KVFormatError,
    Problem,
    ProblemList,
    SafetensorsHeaderError,
)
from kvarn_ckpt.resolve import KVResolution, geometry_conflicts, resolve_for_vllm, resolve_kv_format
from kvarn_ckpt.safetensors_header import SafetensorsHeader, TensorInfo, read_header

__version__ = "0.1.0"

__all__ = [
    "DECLARATION_KEY",
    "DECLARATION_VERSION",
    "AnnotateResult",
    "AttentionGeometry",
    "Checkpoint",
    "CheckpointError",
    "Exl3Linear",
    "Exl3Report",
    "InspectReport",
    "KVDeclaration",
    "KVFormatError",
    "KVResolution",
    "NameHint",
    "Problem",
    "ProblemList",
    "SafetensorsHeader",
    "SafetensorsHeaderError",
    "TensorInfo",
    "WeightFormat",
    "annotate",
    "build_declaration",
    "find_declaration",
    "format_report",
    "geometry_conflicts",
    "inspect_checkpoint",
    "name_hint",
    "open_checkpoint",
    "read_geometry",
    "read_header",
    "resolve_for_vllm",
    "resolve_kv_format",
    "trellis_bits",
    "validate_exl3",
]
