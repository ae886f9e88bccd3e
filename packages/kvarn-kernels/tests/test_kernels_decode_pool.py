"""``decode_pool_kernel`` alone against a float64 attention over each request's pool rows.

The decode tests (``test_kernels_attention.py``) check the pool launch through whole decode
calls, at block tables of one or two scan windows. Here the kernel runs with a 4-entry scan
window, so a request's pool blocks (the sink, the last block and every third one) spread over
many windows, some holding none; the last tile's rows past the request's length (NaN in the
pool) must be masked, and the partial must land at the index it is given, nothing else.
"""

from __future__ import annotations

import torch

from kvarn_kernels.decode_pool import decode_pool_kernel

G, D, HK, QPK, BN, SCAN = 32, 32, 2, 2, 16, 4
HQ = HK * QPK
QK_SCALE = 0.3


def _case(device: torch.device) -> dict[str, torch.Tensor | list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    seq_lens = [9 * G + 5, 7 * G, 3]  # 10, 7 and 1 blocks
    n_blocks = [-(-n // G) for n in seq_lens]
    width = max(n_blocks)
    total = sum(n_blocks) + 2
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    perm = torch.randperm(total, generator=gen)
    slot_of = torch.full((total,), -1, dtype=torch.int32)
    pool_blocks: list[list[int]] = []  # per request, its pool blocks' indices in the table
    slots = 0
    used = 0
    for b, nb in enumerate(n_blocks):
        table[b, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
        # the sink, the last block and some in between are pool-resident
        chosen = sorted({0, nb - 1} | {j for j in range(nb) if j % 3 == 2})
        for j in chosen:
            slot_of[int(table[b, j])] = slots
            slots += 1
        pool_blocks.append(chosen)
    pool_k = torch.randn(slots, G, HK, D, generator=gen).half()
    pool_v = torch.randn(slots, G, HK, D, generator=gen).half()
    for b, n in enumerate(seq_lens):  # rows past the length: whatever a slot holds, NaN here
        last = int(slot_of[int(table[b, n_blocks[b] - 1])])
        pool_k[last, n - (n_blocks[b] - 1) * G :] = float("nan")
        pool_v[last, n - (n_blocks[b] - 1) * G :] = float("nan")
    q = torch.randn(len(seq_lens) * HQ, D, generator=gen)
    return {
        "q": q.to(device),
        "kv": torch.zeros(total * HK * 64, dtype=torch.uint8, device=device),  # unread
        "pool_k": pool_k.to(device),
        "pool_v": pool_v.to(device),
        "table": table.to(device),
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "slot_of": slot_of.to(device),
        "pool_blocks": pool_blocks,
    }


def _reference(c: dict, b: int, h: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Output and base-2 LSE of request ``b``'s query rows of KV head ``h`` over the rows of
    its table entries ``blocks`` (pool-resident), in float64."""
    n = int(c["seq_lens"][b])
    keys, values = [], []
    for j in blocks:
        slot = int(c["slot_of"][int(c["table"][b, j])])
        live = min(G, n - j * G)
        keys.append(c["pool_k"][slot, :live, h].double().cpu())
        values.append(c["pool_v"][slot, :live, h].double().cpu())
    q = c["q"][b * HQ + h * QPK : b * HQ + (h + 1) * QPK].double().cpu()
    s = q @ torch.cat(keys).T * QK_SCALE  # base-2 logits
    m = s.max(dim=1, keepdim=True).values
    w = torch.exp2(s - m)
    out = w @ torch.cat(values) / w.sum(dim=1, keepdim=True)
    return out, (m.squeeze(1) + torch.log2(w.sum(dim=1))).float()


def test_decode_pool_partial_matches_reference(device: torch.device) -> None:
    c = _case(device)
    bsz = int(c["seq_lens"].shape[0])
    n_rows = bsz * HQ
    part = 1  # the partial the launch writes (after one main-loop split)
    o_part = torch.full(((part + 1) * n_rows, D), float("nan"), device=device)
    lse_part = torch.full(((part + 1) * n_rows,), float("nan"), device=device)
    decode_pool_kernel[(bsz, HK)](
        c["q"],
        c["kv"],
        c["pool_k"],
        c["pool_v"],
        c["table"],
        c["seq_lens"],
        c["slot_of"],
        o_part,
        lse_part,
        QK_SCALE,
        c["table"].stride(0),
        n_rows,
        part,
        HQ=HQ,
        HK=HK,
        QPK=QPK,
        BLOCK_Q=16,
        D=D,
        G=G,
        SHADOW=0,
        STRIDE=64,
        BN=BN,
        SCAN=SCAN,
        num_warps=4,
    )
    assert torch.isnan(o_part[:n_rows]).all(), "the pool launch wrote a main-loop partial"
    assert torch.isnan(lse_part[:n_rows]).all(), "the pool launch wrote a main-loop LSE"
    for b in range(bsz):
        for h in range(HK):
            ref_o, ref_lse = _reference(c, b, h, c["pool_blocks"][b])
            first = part * n_rows + b * HQ + h * QPK
            got_o = o_part[first : first + QPK].double().cpu()
            got_lse = lse_part[first : first + QPK].cpu()
            where = f"request {b}, head {h}, blocks {c['pool_blocks'][b]}"
            torch.testing.assert_close(got_lse, ref_lse, atol=2e-2, rtol=0, msg=where)
            torch.testing.assert_close(got_o, ref_o, atol=2e-2, rtol=2e-2, msg=where)
