"""The ``kvarn-ckpt`` command line: ``inspect``, ``resolve`` and ``annotate``.

Exit codes: 0 success; 1 the checkpoint has errors (inspect) or the KV format cannot be
resolved safely (resolve) or annotation was refused; 2 bad command-line usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvarn_ckpt import __version__
from kvarn_ckpt.annotate import annotate
from kvarn_ckpt.inspection import format_report, inspect_checkpoint
from kvarn_ckpt.problems import CheckpointError
from kvarn_ckpt.resolve import resolve_kv_format
from kvarn_format import VALID_DTYPES

__all__ = ["build_parser", "main"]


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvarn-ckpt",
        description="Inspect, validate and annotate KVarN-quantized checkpoints.",
    )
    p.add_argument("--version", action="version", version=f"kvarn-ckpt {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("path", help="checkpoint directory (with config.json)")
        sp.add_argument(
            "--kv-cache-dtype",
            default=None,
            help="the KV cache dtype you would pass to vLLM (wins over the "
            "checkpoint's declaration when valid for the model)",
        )
        sp.add_argument("--tp", type=_positive, default=1, help="tensor-parallel size")
        sp.add_argument(
            "--accept-name-heuristic",
            action="store_true",
            help="use the KV format guessed from the checkpoint name when nothing "
            "declares one (never silently; always reported as 'heuristic')",
        )
        sp.add_argument("--json", action="store_true", help="print JSON")

    ins = sub.add_parser("inspect", help="report architecture, weights, KV format, problems")
    common(ins)
    ins.add_argument(
        "--gpu",
        default=None,
        help="also plan KV capacity on this GPU (h200, h100, a100-80g, l40s, "
        "rtx-pro-6000, or a size in GiB)",
    )
    ins.add_argument(
        "--max-model-len",
        type=_positive,
        default=None,
        help="context length for the capacity plan (default: the model's)",
    )
    ins.add_argument(
        "--mem-util",
        type=float,
        default=0.9,
        help="gpu_memory_utilization for the capacity plan (default 0.9)",
    )

    res = sub.add_parser("resolve", help="print the KV cache dtype the checkpoint resolves to")
    common(res)

    ann = sub.add_parser("annotate", help="declare the KV format in config.json")
    ann.add_argument("path", help="checkpoint directory (with config.json)")
    ann.add_argument("--kv-cache-dtype", required=True, help=f"one of: {', '.join(VALID_DTYPES)}")
    ann.add_argument(
        "--block-size",
        type=_positive,
        default=None,
        help="optional cross-check: must equal the dtype's tile size",
    )
    ann.add_argument(
        "--tp", type=_positive, default=1, help="tensor-parallel size to check the geometry against"
    )
    ann.add_argument(
        "--replace", action="store_true", help="overwrite a different existing declaration"
    )
    ann.add_argument(
        "--dry-run", action="store_true", help="print the new config.json instead of writing it"
    )
    return p


def _inspect(args: argparse.Namespace) -> int:
    report = inspect_checkpoint(
        args.path,
        user_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tp,
        accept_heuristic=args.accept_name_heuristic,
        gpu=args.gpu,
        max_model_len=args.max_model_len,
        mem_util=args.mem_util,
    )
    if args.json:
        print(json.dumps(report.as_dict(), indent=2, sort_keys=False))
    else:
        print(format_report(report))
    return report.exit_code


def _resolve(args: argparse.Namespace) -> int:
    res = resolve_kv_format(
        args.path,
        args.kv_cache_dtype,
        tensor_parallel_size=args.tp,
        accept_heuristic=args.accept_name_heuristic,
    )
    if args.json:
        print(json.dumps(res.as_dict(), indent=2))
    else:
        for p in res.problems:
            print(p, file=sys.stderr)
        print(res.dtype if res.dtype is not None else "none")
    return 0 if res.ok else 1


def _annotate(args: argparse.Namespace) -> int:
    result = annotate(
        args.path,
        args.kv_cache_dtype,
        block_size=args.block_size,
        tensor_parallel_size=args.tp,
        replace=args.replace,
        dry_run=args.dry_run,
        producer=f"kvarn-ckpt {__version__}",
    )
    if args.dry_run:
        sys.stdout.write(result.new_text)
    elif not result.changed:
        print(f"{result.path}: already declares {result.dtype}; unchanged")
    else:
        was = f" (was {result.previous})" if result.previous else ""
        print(f"{result.path}: declared kv_cache_quant {result.dtype}{was}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvarn-ckpt`` console script."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "resolve":
            return _resolve(args)
        return _annotate(args)
    except CheckpointError as e:
        print(f"kvarn-ckpt: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
