"""kvarn_kernels.warmup: the scratch launches cover every compile a prefill step can select."""

from __future__ import annotations

import pytest
import torch

from kvarn_kernels.rotation import _block_r
from kvarn_kernels.warmup import _token_counts, warmup


@pytest.mark.parametrize(("hq", "hk"), [(32, 8), (64, 8), (8, 1), (12, 4), (40, 8), (128, 16)])
def test_token_counts_reach_every_rotation_row_tile(hq: int, hk: int) -> None:
    """Each row count a step can have (K/V rows T * Hk, query rows T * Hq) falls in a
    row-tile class that one of the warm-up's token counts also reaches."""
    counts = _token_counts(hq, hk)
    for heads in (hk, hq):
        reachable = {_block_r(t * heads) for t in range(1, 20_000)}
        warmed = {_block_r(t * heads) for t in counts}
        assert warmed == reachable, (heads, counts)


def test_warmup_runs_every_prefill_op(device: torch.device) -> None:
    """All launches go through the public ops' argument checks (on a CPU under the
    interpreter, where nothing is compiled) and return."""
    n = warmup(
        "kvarn_k4v4_g128",
        head_dim=64,
        num_q_heads=16,
        num_kv_heads=8,
        device=device,
        dtype=torch.bfloat16,
    )
    assert n == 2 + 3 * len(_token_counts(16, 8))


def test_warmup_refuses_an_unknown_format(device: torch.device) -> None:
    with pytest.raises(ValueError, match="kvarn"):
        warmup("kvarn_k9v9_g128", head_dim=64, num_q_heads=4, num_kv_heads=1, device=device)
