"""Compile the kvarn kernels for sm_90a on any machine (no GPU) and report static numbers.

For each variant: registers per thread and spill bytes (``ptxas -v``), SASS instructions in
the hottest loop body (the largest backward-branch range), and the ``BAR``, ``LDS``/``STS``,
``SHFL``, MMA and global-load instructions in it. Used for docs/kernel-notes.md.

    uv run python packages/kvarn-kernels/scripts/static_kernels.py [--only NAME] [--sass DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)

import triton  # type: ignore[import-untyped]
from triton.backends.compiler import GPUTarget  # type: ignore[import-untyped]
from triton.compiler import ASTSource  # type: ignore[import-untyped]

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def compile_kernel(
    fn: Any,
    sig: dict[str, str],
    consts: dict[str, Any],
    num_warps: int,
    num_stages: int = 3,
    maxnreg: int | None = None,
) -> Any:
    """``fn`` (a Triton or a Gluon kernel) compiled for sm_90a; pointers get the 16-byte
    divisibility the JIT gives them, except those it does not specialize on alignment."""
    full = {}
    attrs = {}
    unaligned = {p.name for p in fn.params if p.do_not_specialize_on_alignment}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            full[name] = "constexpr"
        else:
            full[name] = sig.get(name, "i32")
            if full[name].startswith("*") and name not in unaligned:
                attrs[(i,)] = [["tt.divisibility", 16]]
    if getattr(fn, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource  # type: ignore[import-untyped]

        src = GluonASTSource(fn, full, constexprs=consts, attrs=attrs)
    else:
        src = ASTSource(fn, full, constexprs=consts, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={
            "num_warps": num_warps,
            "num_stages": num_stages,
            **({} if maxnreg is None else {"maxnreg": maxnreg}),
        },
    )


def analyse(kernel: Any, sass_out: Path | None = None, tag: str = "") -> dict[str, Any]:
    ptx = kernel.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.ptx"
        p.write_text(ptx)
        o = Path(tmp) / "k.cubin"
        log = subprocess.run(
            [str(BIN / "ptxas"), "-v", "--gpu-name=sm_90a", str(p), "-o", str(o)],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [str(BIN / "cuobjdump"), "-sass", str(o)], capture_output=True, text=True, check=True
        ).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))  # type: ignore[union-attr]
    spill_st = sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))
    smem = re.search(r"(\d+) bytes smem", log)
    if sass_out is not None:
        sass_out.mkdir(parents=True, exist_ok=True)
        (sass_out / f"{tag}.sass").write_text(sass)
        (sass_out / f"{tag}.ptxas.log").write_text(log)  # its warnings (serialized wgmma)
    # instructions: lines "/*0a30*/   IMAD ... ;"
    ins: list[tuple[int, str]] = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    addr_idx = {a: i for i, (a, _) in enumerate(ins)}
    best = (0, 0)
    for i, (_a, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", text)
        if not m:
            continue
        tgt = None
        if m.group(1):
            tgt = int(m.group(1), 16)
        else:
            lab = re.search(r"`\((\.L_x_\d+)\)", text)
            if lab:
                tgt = _label_addr(sass, lab.group(1))
        if tgt is not None and tgt in addr_idx and addr_idx[tgt] < i:
            j = addr_idx[tgt]
            # not a range with an EXIT in it: an out-of-line wait (an mbarrier's retry, placed
            # after the epilogue) that jumps back into the loop spans the epilogue too
            exits = any(re.search(r"\bEXIT\b", t) for _, t in ins[j : i + 1])
            if i - j > best[1] - best[0] and not exits:
                best = (j, i)
    body = [t for _, t in ins[best[0] : best[1] + 1]]

    def count(pat: str, texts: list[str] = body) -> int:
        return sum(1 for t in texts if re.search(pat, t))

    every = [t for _, t in ins]

    return {
        "regs": regs,
        "spill_bytes": spill_st,
        "smem": int(kernel.metadata.shared) or (int(smem.group(1)) if smem else 0),
        "total_sass": len(ins),
        "loop_sass": len(body),
        "loop_bar": count(r"\bBAR\b"),
        "loop_lds_sts": count(r"\b(LDS|STS|LDSM)\b"),
        "loop_shfl": count(r"\bSHFL\b"),
        "loop_mma": count(r"\b(HMMA|HGMMA|WGMMA)\b"),
        "loop_ldg": count(r"\b(LDG|LDGSTS)\b"),
        "loop_mufu": count(r"\bMUFU\b"),
        # whole kernel (for kernels without a loop, e.g. fully unrolled ones)
        "all_bar": count(r"\bBAR\b", every),
        "all_smem": count(r"\b(LDS|STS|LDSM|STSM)(\.|\b)", every),
        "all_stg128": count(r"\bSTG\.E\.128\b", every),
        "all_stg_narrow": count(r"\bSTG\.E(\.U16|\.64|\.U8)?\s", every),
        "all_ldg": count(r"\bLDG\b", every),
        "all_fp32": count(r"^(@!?P\d )?(FMUL|FFMA|FADD|FMNMX)\b", every),
        "all_cvt": count(r"^(@!?P\d )?(HADD2\.F32|F2FP|I2F|F2F)\b", every),
        "all_alu": count(r"^(@!?P\d )?(LOP3|PRMT|SHF|IADD3|IMAD|LEA|ISETP|SEL)\b", every),
    }


def _label_addr(sass: str, label: str) -> int | None:
    lines = sass.splitlines()
    for k, line in enumerate(lines):
        if line.strip().startswith(label + ":"):
            for nxt in lines[k + 1 :]:
                m = re.match(r"\s+/\*([0-9a-f]{4,})\*/", nxt)
                if m:
                    return int(m.group(1), 16)
    return None


VARIANTS: dict[str, Callable[[], Any]] = {}


def variant(name: str) -> Callable[[Callable[[], Any]], Callable[[], Any]]:
    def deco(f: Callable[[], Any]) -> Callable[[], Any]:
        VARIANTS[name] = f
        return f

    return deco


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--only", help="substring of the variant names to run (a comma list: any of them)"
    )
    ap.add_argument("--sass", type=Path, help="write each variant's SASS here")
    ap.add_argument(
        "--whole",
        action="store_true",
        help="count over the whole kernel instead of its hottest loop (unrolled kernels)",
    )
    args = ap.parse_args()
    if args.whole:
        _whole_table(args)
        return
    print(
        f"{'variant':44s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'loop':>5s} {'BAR':>4s} "
        f"{'LDS/STS':>7s} {'SHFL':>4s} {'MMA':>4s} {'LDG':>4s}"
    )
    for name, r in _analysed(args, 44):
        print(
            f"{name:44s} {r['regs']:4d} {r['spill_bytes']:5d} {r['smem']:6d} {r['loop_sass']:5d} "
            f"{r['loop_bar']:4d} {r['loop_lds_sts']:7d} {r['loop_shfl']:4d} {r['loop_mma']:4d} "
            f"{r['loop_ldg']:4d}",
            flush=True,
        )


def _analysed(args: argparse.Namespace, width: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """The selected variants (``--only``) with their analysis; a variant that fails to
    compile is reported in its table row and skipped."""
    import static_variants

    for name, fn in static_variants.VARIANTS.items():
        if args.only and not any(part in name for part in args.only.split(",")):
            continue
        try:
            r = analyse(fn(), args.sass, name)
        except Exception as exc:  # report and go on
            print(f"{name:{width}s} FAILED {type(exc).__name__}: {str(exc)[:200]}")
            continue
        yield name, r


def _whole_table(args: argparse.Namespace) -> None:
    """Whole-kernel counts: SASS, barriers, shared-memory ops, wide vs narrow stores."""
    print(
        f"{'variant':48s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'SASS':>5s} {'BAR':>4s} "
        f"{'LDS/STS':>7s} {'STG128':>6s} {'STGnar':>6s} {'LDG':>4s} {'FP32':>5s} {'CVT':>4s} "
        f"{'INT':>5s}"
    )
    for name, r in _analysed(args, 48):
        print(
            f"{name:48s} {r['regs']:4d} {r['spill_bytes']:5d} {r['smem']:6d} "
            f"{r['total_sass']:5d} {r['all_bar']:4d} {r['all_smem']:7d} {r['all_stg128']:6d} "
            f"{r['all_stg_narrow']:6d} {r['all_ldg']:4d} {r['all_fp32']:5d} {r['all_cvt']:4d} "
            f"{r['all_alu']:5d}",
            flush=True,
        )


if __name__ == "__main__":
    main()
