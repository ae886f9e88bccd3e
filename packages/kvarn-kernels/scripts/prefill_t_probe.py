"""Static probe of a producer-free short-chunk prefill loop (forty-first session; no GPU).

docs/kernel-notes.md, forty-first session, proposes a fused prefill without producer warps:
each consumer warpgroup dequantizes its chunk's codes in its own registers as the A operand
of ``S^T = K Q^T`` and ``O^T += V^T P^T``. This kernel is that loop's skeleton (codes one a
byte, one channel scale, no pool tiles, masks or splits), compiled for sm_90a on any machine
to see whether the loop fits a warpgroup's registers and what it issues a chunk::

    uv run python packages/kvarn-kernels/scripts/prefill_t_probe.py

Its results are not attention over a KVarN cache and it is never launched.
"""

from __future__ import annotations

from typing import Any

from static_kernels import analyse, compile_kernel  # same folder
from triton.experimental import gluon  # type: ignore[import-untyped]
from triton.experimental.gluon import language as gl  # type: ignore[import-untyped]
from triton.experimental.gluon.language.nvidia.hopper import (  # type: ignore[import-untyped]
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def tprobe_kernel(
    Q, KC, VC, KS, VS, OUT, n_chunks, M: gl.constexpr, D: gl.constexpr, BN: gl.constexpr
):
    """One warpgroup: ``M`` query rows against ``n_chunks`` chunks of ``BN`` keys with the
    scores transposed (``S^T = K Q^T``, then ``O^T += V^T P^T``): K's and V^T's codes, one a
    byte, dequantized in registers as wgmma's A operand; the query rows and ``P^T`` as B from
    shared memory; the softmax along the MMA's M (across the four warps)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, M, 16]
    )
    # both A operands (K [BN, D] and V^T [D, BN]) against accumulators of S_L's layout
    A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_L, k_width=2)
    ROWS: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    QS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, D], gl.float16)
    PS: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, M], gl.float16)
    pid = gl.program_id(0)
    qr = gl.arange(0, M, layout=gl.SliceLayout(1, ROWS))
    qc = gl.arange(0, D, layout=gl.SliceLayout(0, ROWS))
    q = gl.load(Q + pid * M * D + qr[:, None] * D + qc[None, :])
    q_smem = gl.allocate_shared_memory(gl.float16, [M, D], QS, q)
    p_smem = gl.allocate_shared_memory(gl.float16, [BN, M], PS)
    kt = gl.arange(0, BN, layout=gl.SliceLayout(1, A_OP))
    kd = gl.arange(0, D, layout=gl.SliceLayout(0, A_OP))
    vd = gl.arange(0, D, layout=gl.SliceLayout(1, A_OP))
    vt = gl.arange(0, BN, layout=gl.SliceLayout(0, A_OP))
    ks_d = gl.load(KS + kd)  # channel scales
    vs_d = gl.load(VS + vd)
    m_i = gl.full([M], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_L))
    l_i = gl.zeros([M], gl.float32, layout=gl.SliceLayout(0, S_L))
    acc = gl.zeros([D, M], gl.float32, layout=S_L)
    zero_s = gl.zeros([BN, M], gl.float32, layout=S_L)
    for c in range(n_chunks):
        kc = gl.load(KC + c * BN * D + kt[:, None] * D + kd[None, :])
        k = kc.to(gl.float16) * ks_d.to(gl.float16)[None, :]
        s_tok = warpgroup_mma(k, q_smem.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + gl.sum(p, axis=0)
        acc = acc * alpha[None, :]
        m_i = m_new
        p_smem.store(p.to(gl.float16))
        fence_async_shared()
        gl.thread_barrier()
        vc = gl.load(VC + c * BN * D + vt[None, :] * D + vd[:, None])
        v = vc.to(gl.float16) * vs_d.to(gl.float16)[:, None]
        o_tok = warpgroup_mma(v, p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        gl.thread_barrier()
    od = gl.arange(0, D, layout=gl.SliceLayout(1, S_L))
    om = gl.arange(0, M, layout=gl.SliceLayout(0, S_L))
    gl.store(OUT + pid * M * D + om[None, :] * D + od[:, None], acc / l_i[None, :])


SIGNATURE = {
    "Q": "*fp16", "KC": "*u8", "VC": "*u8", "KS": "*fp32", "VS": "*fp32", "OUT": "*fp32",
    "n_chunks": "i32",
}  # fmt: skip


def main() -> None:
    for maxnreg in (None, 168):
        kernel = compile_kernel(
            tprobe_kernel,
            SIGNATURE,
            {"M": 64, "D": 128, "BN": 64},
            num_warps=4,
            maxnreg=maxnreg,
        )
        stats: dict[str, Any] = analyse(kernel, tag="tprobe")
        print(f"register cap {maxnreg}: {stats}")


if __name__ == "__main__":
    main()
