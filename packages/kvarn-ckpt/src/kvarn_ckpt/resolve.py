"""Which KV cache format a checkpoint is served with, with an explicit precedence.

1. **user**: the ``--kv-cache-dtype`` the user passed (``None`` and vLLM's default ``"auto"``
   mean "not given");
2. **declared**: the checkpoint's ``kv_cache_quant`` declaration (declaration.py);
3. **heuristic**: what the checkpoint's name suggests (heuristic.py), always reported with a
   warning, and used only when the caller confirms (``accept_heuristic=True``) and the
   suggestion is unambiguous;
4. **none**: no KVarN format; the caller keeps its default cache.

Every KVarN choice is checked against the kvarn-format registry and the model's attention
geometry (MLA vs dense, latent rank and RoPE width, head dim, heads vs tensor parallelism).

Conflict rule: when the user's choice differs from the declaration, **the user wins if the
choice is valid for the model** (the conflict is logged as a warning naming both); when the
user's choice cannot run on the model, resolution fails closed with an error naming the
user's choice, why it does not fit, and the declared format. A declaration that cannot run on
the model is an error when it would be used, and a warning when the user overrides it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvarn_ckpt.checkpoint import Checkpoint, open_checkpoint
from kvarn_ckpt.declaration import KVDeclaration, find_declaration
from kvarn_ckpt.heuristic import NameHint, checkpoint_names, name_hint
from kvarn_ckpt.model_config import AttentionGeometry
from kvarn_ckpt.problems import CheckpointError, KVFormatError, Problem, ProblemList
from kvarn_format import (
    CacheDTypeError,
    UnsupportedGeometryError,
    is_kvarn_dtype,
    parse_cache_dtype,
    record_layout,
)
from kvarn_format.registry import KVarNFormat, MLAFormat, check_mla_geometry

__all__ = [
    "KVResolution",
    "Source",
    "geometry_conflicts",
    "resolve_for_vllm",
    "resolve_kv_format",
]

logger = logging.getLogger("kvarn_ckpt")

Source = Literal["user", "declared", "heuristic", "none"]
_NOT_GIVEN = (None, "", "auto")


@dataclass(frozen=True)
class KVResolution:
    """The outcome of resolution: the dtype to use (or ``None``), where it came from, what
    was considered, and every problem found on the way."""

    dtype: str | None
    source: Source
    user: str | None
    declared: KVDeclaration | None
    hint: NameHint | None
    problems: tuple[Problem, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def is_kvarn(self) -> bool:
        return self.dtype is not None and is_kvarn_dtype(self.dtype)

    def raise_for_errors(self) -> None:
        errors = [p for p in self.problems if p.severity == "error"]
        if errors:
            lines = "\n".join(f"  - {p.message}" for p in errors)
            raise KVFormatError(f"cannot resolve the KV cache format:\n{lines}", errors)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "source": self.source,
            "user": self.user,
            "declared": self.declared.as_dict() if self.declared else None,
            "heuristic": self.hint.as_dict() if self.hint else None,
            "ok": self.ok,
            "problems": [p.as_dict() for p in self.problems],
        }


def geometry_conflicts(
    fmt: KVarNFormat, geometry: AttentionGeometry, tensor_parallel_size: int = 1
) -> list[str]:
    """Why ``fmt`` cannot run on ``geometry`` (empty when it can)."""
    out: list[str] = []
    if geometry.kv_layers <= 0:
        out.append("the model has no full-attention layers for a KVarN cache")
    if isinstance(fmt, MLAFormat):
        if geometry.kind != "mla":
            out.append(
                f"{fmt.name} is an MLA format but this model uses dense attention "
                f"({geometry.num_kv_heads} KV heads of head_dim {geometry.head_dim}); use one "
                "of the dense kvarn_kXvY_gN formats"
            )
            return out
        try:
            check_mla_geometry(fmt, geometry.kv_lora_rank or 0, geometry.qk_rope_head_dim or 0)
        except UnsupportedGeometryError as e:
            out.append(str(e))
        if geometry.num_attention_heads % tensor_parallel_size:
            out.append(
                f"num_attention_heads={geometry.num_attention_heads} does not split over "
                f"tensor_parallel_size={tensor_parallel_size}"
            )
        return out
    if geometry.kind == "mla":
        out.append(
            f"{fmt.name} is a dense format but this model uses MLA (kv_lora_rank="
            f"{geometry.kv_lora_rank}, qk_rope_head_dim={geometry.qk_rope_head_dim}); use one "
            "of the kvarn_mla_* formats"
        )
        return out
    try:
        record_layout(fmt, geometry.head_dim)
    except UnsupportedGeometryError as e:
        out.append(str(e))
    kv, tp = geometry.num_kv_heads, tensor_parallel_size
    if kv % tp and tp % kv:
        out.append(
            f"num_key_value_heads={kv} neither divides nor is divided by tensor_parallel_size={tp}"
        )
    return out


def _check(
    dtype: str, geometry: AttentionGeometry | None, tp: int
) -> tuple[KVarNFormat | None, list[str]]:
    try:
        fmt = parse_cache_dtype(dtype)
    except CacheDTypeError as e:
        return None, [str(e)]
    if geometry is None:
        return fmt, ["the model's attention geometry is unknown (see config problems)"]
    return fmt, geometry_conflicts(fmt, geometry, tp)


def resolve_kv_format(
    checkpoint: Checkpoint | str | os.PathLike[str],
    user_cache_dtype: str | None = None,
    *,
    tensor_parallel_size: int = 1,
    accept_heuristic: bool = False,
) -> KVResolution:
    """Resolve the KV format of ``checkpoint`` under the precedence in the module docstring.

    Never raises for checkpoint content: problems are returned in the resolution (call
    :meth:`KVResolution.raise_for_errors` to fail closed). Raises :class:`CheckpointError`
    only when ``checkpoint`` is a path with no readable config.json.
    """
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    ckpt = (
        checkpoint
        if isinstance(checkpoint, Checkpoint)
        else open_checkpoint(checkpoint, read_weights=False)
    )
    geometry = ckpt.geometry
    tp = tensor_parallel_size
    decl_problems = ProblemList()
    declared = find_declaration(ckpt, decl_problems)
    out = ProblemList()
    user = None if user_cache_dtype in _NOT_GIVEN else user_cache_dtype

    def result(dtype: str | None, source: Source, hint: NameHint | None = None) -> KVResolution:
        return KVResolution(dtype, source, user, declared, hint, tuple(out.items()))

    # 1. The user's explicit choice.
    if user is not None:
        # The checkpoint's own declaration problems do not block a valid explicit choice.
        for p in decl_problems:
            out.add(
                "warning" if p.severity == "error" else p.severity,
                p.code,
                p.message + " (overridden by --kv-cache-dtype)",
                p.where,
            )
        if not user.startswith("kvarn"):
            if declared is not None:
                out.warning(
                    "resolve.user_overrides",
                    f"--kv-cache-dtype {user} overrides the checkpoint's declared "
                    f"{declared.dtype} ({declared.where}); the cache will not be KVarN",
                )
            return result(user, "user")
        _, why = _check(user, geometry, tp)
        if why:
            also = (
                f"; the checkpoint declares {declared.dtype} ({declared.where})"
                + ("" if _check(declared.dtype, geometry, tp)[1] else ", which fits this model")
                if declared is not None
                else ""
            )
            out.error(
                "resolve.user_invalid",
                f"--kv-cache-dtype {user} cannot be used: {'; '.join(why)}{also}",
            )
            return result(None, "user")
        if declared is not None and declared.dtype != user:
            _, decl_why = _check(declared.dtype, geometry, tp)
            out.warning(
                "resolve.conflict",
                f"--kv-cache-dtype {user} differs from the checkpoint's declared "
                f"{declared.dtype} ({declared.where}); using {user} because it is valid for "
                "this model"
                + (
                    f" (the declared format would not be: {'; '.join(decl_why)})"
                    if decl_why
                    else ""
                ),
            )
        return result(user, "user")

    # 2. The checkpoint's declaration.
    out.extend(decl_problems)
    if declared is not None:
        _, why = _check(declared.dtype, geometry, tp)
        if why:
            out.error(
                "resolve.declared_invalid",
                f"the checkpoint declares {declared.dtype} ({declared.where}) but it cannot "
                f"run on this model: {'; '.join(why)}. Pass --kv-cache-dtype explicitly or "
                "re-annotate the checkpoint",
            )
            return result(None, "declared")
        out.info(
            "resolve.declared",
            f"using the checkpoint's declared KV format {declared.dtype} ({declared.where})",
        )
        return result(declared.dtype, "declared")
    if decl_problems.has_errors:
        return result(None, "declared")

    # 3. The name heuristic: reported, never trusted silently.
    hint = name_hint(checkpoint_names(ckpt.path, ckpt.config.get("_name_or_path")), geometry)
    if hint is not None:
        cand = hint.candidate
        why = _check(cand, geometry, tp)[1] if cand else []
        if cand is None or why:
            out.warning(
                "resolve.heuristic_ambiguous",
                f"the name {hint.name!r} suggests KVarN ({hint.label}) but no single format "
                f"follows from it: {hint.reason}"
                + (f"; {'; '.join(why)}" if why else "")
                + (f"; candidates: {', '.join(hint.candidates)}" if hint.candidates else "")
                + ". Pass --kv-cache-dtype or declare it with kvarn-ckpt annotate",
            )
            return result(None, "none", hint)
        if accept_heuristic:
            out.warning(
                "resolve.heuristic_used",
                f"using {cand}, guessed from the name {hint.name!r} ({hint.reason}) because "
                "the name heuristic was accepted; declare it with kvarn-ckpt annotate",
            )
            return result(cand, "heuristic", hint)
        out.warning(
            "resolve.heuristic_candidate",
            f"the name {hint.name!r} suggests {cand} ({hint.reason}); a name is not a "
            "declaration, so it is not used. Confirm with --accept-name-heuristic, pass "
            "--kv-cache-dtype, or declare it with kvarn-ckpt annotate",
        )
        return result(None, "none", hint)

    # 4. Nothing.
    return result(None, "none")


def _local_model_dir(model: str | os.PathLike[str], revision: str | None) -> Path | None:
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if not isinstance(model, str) or model.count("/") != 1:
        return None
    try:  # a hub id already in the local cache; never touches the network
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(model, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def resolve_for_vllm(
    model_path: str | os.PathLike[str],
    user_cache_dtype: str | None,
    *,
    tensor_parallel_size: int = 1,
    revision: str | None = None,
) -> str | None:
    """The cache dtype vLLM should use for ``model_path``; the kvarn-vllm plugin's hook.

    Returns the user's value unchanged when one was given (``None``/``"auto"`` mean not
    given) and it is valid; the checkpoint's declared KVarN dtype when the user gave none (and
    logs that it did); ``None`` when there is nothing to use, so the caller keeps its default.
    Raises :class:`KVFormatError` when the outcome would be unsafe: a KVarN choice the model
    cannot take, a declared format that does not fit, conflicting declarations. The name
    heuristic is never applied here (a server has no confirmation prompt); it is only logged.

    A hub id is looked up in the local Hugging Face cache only; when no config.json can be
    found the user's value is returned as is.
    """
    local = _local_model_dir(model_path, revision)
    if local is None or not (local / "config.json").is_file():
        logger.debug(
            "kvarn-ckpt: no local config.json for %s; KV format left as %r",
            model_path,
            user_cache_dtype,
        )
        return None if user_cache_dtype in _NOT_GIVEN else user_cache_dtype
    try:
        res = resolve_kv_format(local, user_cache_dtype, tensor_parallel_size=tensor_parallel_size)
    except CheckpointError as e:
        raise KVFormatError(f"kvarn-ckpt could not read {local}: {e}") from e
    for p in res.problems:
        if p.severity == "warning":
            logger.warning("kvarn-ckpt: %s", p.message)
    res.raise_for_errors()
    if res.source == "declared" and res.dtype is not None:
        logger.info(
            "kvarn-ckpt: no --kv-cache-dtype given; using the checkpoint's declared KV cache "
            "format %s (%s)",
            res.dtype,
            res.declared.where if res.declared else "?",
        )
    return res.dtype
