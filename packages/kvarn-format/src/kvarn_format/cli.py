"""The ``kvarn`` command: ``kvarn plan`` (KV capacity per cache format) and ``kvarn inspect``
(the byte layout of one KVarN record).

Subcommands are entries of a small registry, so another module can add one (for example an
``eval`` command) by exposing a :class:`Subcommand` named ``SUBCOMMAND`` and listing its module
in :data:`EXTENSION_MODULES`.

Errors the user can fix (unknown dtype or model, bad config file, a format the model cannot
take, a configuration that does not fit) print one line on stderr and exit with status 2,
without a traceback. ``--json`` output is a stable interface: see :data:`PLAN_ROW_KEYS` and
:func:`inspect_dict`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NoReturn

from kvarn_format.catalog import ModelConfigError, ModelGeometry, catalog_names, load_model
from kvarn_format.geometry import record_layout
from kvarn_format.registry import (
    DENSE_HEAD_DIMS,
    VALID_DTYPES,
    CacheDTypeError,
    DenseFormat,
    MLAFormat,
    parse_cache_dtype,
)
from kvarn_format.sizing import (
    GPUS,
    BudgetError,
    GiB,
    KVPlan,
    ServingConfig,
    WorkerMemory,
    plan,
    resolve_cache_format,
    valid_cache_dtypes,
    worker_memory,
)
from kvarn_format.weights import WeightFormat, parse_weight_format

__all__ = ["EXTENSION_MODULES", "PLAN_ROW_KEYS", "Subcommand", "inspect_dict", "main", "register"]

EXIT_USAGE: Final[int] = 2

#: Modules that each expose ``SUBCOMMAND: Subcommand``; imported when present.
EXTENSION_MODULES: tuple[str, ...] = ()

#: Keys of every ``kvarn plan --json`` row, whether the format fits or not.
PLAN_ROW_KEYS: Final[tuple[str, ...]] = (
    "dtype",
    "fits",
    "error",
    "model",
    "tp",
    "gpu",
    "gpu_total_bytes",
    "mem_util",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "spec_tokens",
    "block_size",
    "kv_tokens",
    "num_blocks",
    "ratio_vs_fp16",
    "max_concurrency",
    "blocks_per_request",
    "requested_bytes",
    "weight_bytes",
    "weight_format",
    "overhead_bytes",
    "available_bytes",
    "page_bytes_per_block",
    "kv_cache_bytes",
    "side_pool_slots",
    "side_pool_bytes",
    "workspace_bytes",
    "unused_bytes",
    "layers",
    "notes",
)


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One ``kvarn`` subcommand: how to declare its arguments and how to run it."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


_REGISTRY: dict[str, Subcommand] = {}


def register(cmd: Subcommand) -> Subcommand:
    """Add a subcommand (names are unique)."""
    if cmd.name in _REGISTRY:
        raise ValueError(f"kvarn subcommand {cmd.name!r} is already registered")
    _REGISTRY[cmd.name] = cmd
    return cmd


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage error as one line (exit status 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fmt_bytes(n: int) -> str:
    if n == 0:
        return "0"
    if abs(n) >= GiB // 10:
        return f"{n / GiB:.2f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def _gib_amount(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size in GiB, got {text!r}") from None
    if not value >= 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a size in GiB >= 0, got {text!r}")
    return round(value * GiB)


# ---------------------------------------------------------------------------------------------
# kvarn plan


def _configure_plan(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="Qwen3-32B",
        help=f"catalog name ({', '.join(catalog_names())}) or a config.json path "
        "(default: Qwen3-32B)",
    )
    p.add_argument(
        "--gpu",
        default="h200",
        help=f"{'|'.join(GPUS)} or the GPU's total memory in GiB as CUDA reports it "
        "(default: h200 = 139.80 GiB, measured)",
    )
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument(
        "--mem-util",
        type=_fraction,
        default=0.9,
        help="vLLM gpu_memory_utilization (default 0.9)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive_int,
        default=None,
        help="default: the model's max_position_embeddings",
    )
    p.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=128,
        help="scheduler limit; sizes the side pool (default 128; vLLM's serve default on an "
        "H200 is 1024)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        default=2048,
        help="tokens per step; sizes the side pool and activations (default 2048; vLLM's serve "
        "default on an H200 is 8192)",
    )
    p.add_argument(
        "--spec-tokens",
        type=_nonneg_int,
        default=0,
        help="speculative tokens per step (reserves rollback tiles; default 0)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default=None,
        help="show one format only (default: auto, fp8 and every KVarN format valid for the model)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="weight format for the estimate: bf16, fp16, fp8, int4 or exl3:<bpw> "
        "(default: the checkpoint's own, from quantization_config)",
    )
    p.add_argument(
        "--weights-scope",
        choices=("linear", "experts"),
        default="linear",
        help="quantize all linear layers (default) or only the routed experts",
    )
    p.add_argument(
        "--weight-gib",
        type=_gib_amount,
        default=None,
        help="weight memory per GPU in GiB (overrides the estimate)",
    )
    p.add_argument(
        "--overhead-gib",
        type=_gib_amount,
        default=None,
        help="activation + CUDA-graph + non-torch memory per GPU in GiB (overrides the estimate)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per format")


def _failed_row(dtype: str, error: str, ctx: dict[str, Any]) -> dict[str, Any]:
    """A plan row for a format that does not fit: same keys, zero capacity, the error."""
    row: dict[str, Any] = dict.fromkeys(PLAN_ROW_KEYS, 0)
    row.update(ctx)
    row.update(dtype=dtype, fits=False, error=error, ratio_vs_fp16=None, layers=[], notes=[])
    return row


def _run_plan(args: argparse.Namespace) -> int:
    model = load_model(args.model)
    weight_fmt: WeightFormat | None = None
    if args.weights is not None:
        weight_fmt = parse_weight_format(args.weights, scope=args.weights_scope)
    elif args.weights_scope != "linear":
        raise ValueError("--weights-scope needs --weights (e.g. --weights exl3:3.4)")
    if args.kv_cache_dtype is not None:
        resolve_cache_format(args.kv_cache_dtype)  # unknown strings fail here, listing all
        dtypes: tuple[str, ...] = (args.kv_cache_dtype,)
    else:
        dtypes = valid_cache_dtypes(model)
    max_model_len = args.max_model_len or model.max_position_embeddings
    if max_model_len is None:
        raise ValueError(f"{model.name} has no max_position_embeddings: pass --max-model-len")
    serving = ServingConfig(
        max_model_len, args.max_num_seqs, args.max_num_batched_tokens, args.spec_tokens
    )
    memory = worker_memory(
        model,
        serving,
        gpu=args.gpu,
        tp=args.tp,
        mem_util=args.mem_util,
        weights=weight_fmt,
        weight_bytes=args.weight_gib,
        overhead_bytes=args.overhead_gib,
    )
    plans: list[KVPlan | tuple[str, str]] = []
    for dtype in dtypes:
        try:
            plans.append(
                plan(
                    model,
                    dtype,
                    tp=args.tp,
                    max_model_len=serving.max_model_len,
                    max_num_seqs=serving.max_num_seqs,
                    max_num_batched_tokens=serving.max_num_batched_tokens,
                    spec_tokens=serving.spec_tokens,
                    memory=memory,
                )
            )
        except BudgetError as e:
            if args.kv_cache_dtype is not None:
                raise
            plans.append((dtype, str(e)))
    if args.json:
        ctx = _context(model, serving, memory)
        rows = [
            p.as_dict() if isinstance(p, KVPlan) else _failed_row(p[0], p[1], ctx) for p in plans
        ]
        print(json.dumps(rows, indent=2))
        return 0
    _print_plan_table(model, serving, memory, plans)
    return 0


def _context(model: ModelGeometry, serving: ServingConfig, memory: WorkerMemory) -> dict[str, Any]:
    return {
        "model": model.name,
        "tp": memory.tp,
        "gpu": memory.gpu.name,
        "gpu_total_bytes": memory.gpu.total_bytes,
        "mem_util": memory.mem_util,
        "max_model_len": serving.max_model_len,
        "max_num_seqs": serving.max_num_seqs,
        "max_num_batched_tokens": serving.max_num_batched_tokens,
        "spec_tokens": serving.spec_tokens,
        "requested_bytes": memory.requested_bytes,
        "weight_bytes": memory.weight_bytes,
        "weight_format": memory.weight_format,
        "overhead_bytes": memory.overhead_bytes,
        "available_bytes": memory.available_bytes,
    }


def _print_plan_table(
    model: ModelGeometry,
    serving: ServingConfig,
    memory: WorkerMemory,
    plans: Sequence[KVPlan | tuple[str, str]],
) -> None:
    gpu = memory.gpu
    print(model.describe())
    print(
        f"GPU {gpu.name}: {gpu.total_gib:.2f} GiB ({gpu.nominal}), tp={memory.tp}, "
        f"mem-util {memory.mem_util:g}"
    )
    print(
        f"max_model_len {serving.max_model_len:,}, max_num_seqs {serving.max_num_seqs}, "
        f"max_num_batched_tokens {serving.max_num_batched_tokens:,}, "
        f"spec tokens {serving.spec_tokens}"
    )
    overhead = "estimated" if memory.overhead is not None else "given"
    print(
        f"per GPU: requested {_fmt_bytes(memory.requested_bytes)} = weights "
        f"{_fmt_bytes(memory.weight_bytes)} ({memory.weight_format}, {memory.weight_note}) + "
        f"overhead {_fmt_bytes(memory.overhead_bytes)} ({overhead}) + KV budget "
        f"{_fmt_bytes(memory.available_bytes)}"
    )
    conc = f"max conc @{serving.max_model_len:,}"
    header = (
        f"{'dtype':<18} {'block':>5} {'KV tokens':>12} {'x fp16':>7} {conc:>18} "
        f"{'side pool':>11} {'workspace':>11} {'KV pages':>11}"
    )
    print()
    print(header)
    print("-" * len(header))
    for p in plans:
        if isinstance(p, KVPlan):
            b = p.budget
            ratio = "-" if p.ratio_vs_fp16 is None else f"{p.ratio_vs_fp16:.2f}x"
            print(
                f"{p.dtype:<18} {b.block_size:>5} {p.kv_tokens:>12,} {ratio:>7} "
                f"{p.max_concurrency:>18,} {_fmt_bytes(b.side_pool_bytes):>11} "
                f"{_fmt_bytes(b.workspace_bytes):>11} {_fmt_bytes(b.kv_cache_bytes):>11}"
            )
        else:
            print(f"{p[0]:<18} does not fit: {p[1]}")
    notes = sorted({n for p in plans if isinstance(p, KVPlan) for n in p.notes})
    if notes:
        print()
        for n in notes:
            print(f"note: {n}")


register(Subcommand("plan", "KV cache capacity per cache format", _configure_plan, _run_plan))


# ---------------------------------------------------------------------------------------------
# kvarn inspect


def inspect_dict(
    dtype: str, head_dim: int | None = None, slot_rounding: str = "align8"
) -> dict[str, Any]:
    """The ``kvarn inspect --json`` object: ``record_layout(...).as_dict()`` plus
    ``head_dim_defaulted`` (True when a dense dtype was shown at head_dim 128 by default)."""
    fmt = parse_cache_dtype(dtype)
    defaulted = False
    if isinstance(fmt, DenseFormat) and head_dim is None:
        head_dim, defaulted = 128, True
    if slot_rounding not in ("align8", "pow2"):
        raise ValueError(f"slot rounding must be align8 or pow2, got {slot_rounding!r}")
    layout = record_layout(
        fmt, head_dim, slot_rounding="pow2" if slot_rounding == "pow2" else "align8"
    )
    out = layout.as_dict()
    out["head_dim_defaulted"] = defaulted
    return out


def _configure_inspect(p: argparse.ArgumentParser) -> None:
    p.add_argument("dtype", help=f"a KVarN cache dtype: {', '.join(VALID_DTYPES)}")
    p.add_argument(
        "--head-dim",
        type=_positive_int,
        default=None,
        help=f"head dim for dense formats ({', '.join(map(str, DENSE_HEAD_DIMS))}; default 128)",
    )
    p.add_argument(
        "--slot-rounding",
        choices=("align8", "pow2"),
        default="align8",
        help="pad records to 8 B (default) or round D>=256 per-token slots to a power of two",
    )
    p.add_argument("--json", action="store_true", help="print the layout as a JSON object")


def _run_inspect(args: argparse.Namespace) -> int:
    fmt = parse_cache_dtype(args.dtype)
    d = inspect_dict(args.dtype, args.head_dim, args.slot_rounding)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    if isinstance(fmt, DenseFormat):
        what = (
            f"dense, {fmt.key_bits}-bit K / {fmt.value_bits}-bit V, G={fmt.group} tokens per tile"
        )
        hd = f"head_dim {d['head_dim']}"
        if d["head_dim_defaulted"]:
            hd += f" (default; --head-dim takes {', '.join(map(str, DENSE_HEAD_DIMS))})"
        per = "per token per KV head"
        fp16 = 4 * int(d["head_dim"])
    else:
        assert isinstance(fmt, MLAFormat)
        what = (
            f"MLA, {fmt.latent_bits}-bit latent (R={fmt.latent_rank}) + RoPE "
            f"{fmt.rope_dim}, G={fmt.group} tokens per tile"
        )
        hd = "one latent per token (no KV heads)"
        per = "per token per layer"
        fp16 = 2 * (fmt.latent_rank + fmt.rope_dim)
    print(f"{d['dtype']}: {what}; {hd}")
    print()
    header = (
        f"{'field':<20} {'offset':>7} {'size':>7}  {'dtype':<5} {'shape':<12} {'bits':>4}  meaning"
    )
    print(header)
    print("-" * len(header))
    for f in d["fields"]:
        shape = "[" + ", ".join(map(str, f["shape"])) + "]"
        bits = "" if f["bits"] is None else str(f["bits"])
        print(
            f"{f['name']:<20} {f['offset']:>7,} {f['size']:>7,}  {f['dtype']:<5} {shape:<12} "
            f"{bits:>4}  {f['meaning']}"
        )
    print()
    print(
        f"tile: {d['tile_bytes']:,} B (payload {d['payload_bytes']:,} B + {d['pad_bytes']} B pad, "
        f"slot rounding {d['slot_rounding']})"
    )
    print(
        f"{per}: {d['bytes_per_token_per_head']:g} B vs {fp16} B fp16 -> "
        f"{d['ratio_vs_fp16']:.2f}x fewer bytes; {d['bits_per_element']:g} bits per element"
    )
    return 0


register(Subcommand("inspect", "byte layout of one KVarN record", _configure_inspect, _run_inspect))


# ---------------------------------------------------------------------------------------------
# main


def _load_extensions() -> None:
    for name in EXTENSION_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        cmd = getattr(module, "SUBCOMMAND", None)
        if isinstance(cmd, Subcommand) and cmd.name not in _REGISTRY:
            register(cmd)


def build_parser() -> argparse.ArgumentParser:
    _load_extensions()
    parser = _Parser(
        prog="kvarn",
        description="KVarN KV-cache formats: capacity planning and record layouts.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for cmd in _REGISTRY.values():
        sp = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.configure(sp)
        sp.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvarn`` console script. Returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    run: Callable[[argparse.Namespace], int] = args._run
    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (``kvarn plan | head``): stop quietly, as other tools do.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (CacheDTypeError, ModelConfigError, BudgetError, ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"kvarn {args.command}: error: {message}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
