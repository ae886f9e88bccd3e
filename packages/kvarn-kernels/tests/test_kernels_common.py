"""Host-side helpers of kvarn_kernels._common."""

from __future__ import annotations

import triton  # type: ignore[import-untyped]

from kvarn_kernels._common import cdiv, next_pow2


def test_host_integer_helpers_match_triton() -> None:
    """The plain-Python stand-ins for ``triton.cdiv`` and ``triton.next_power_of_2`` (whose
    constexpr-function calls cost microseconds per eager launch) give the same numbers."""
    for n in range(1, 1100):
        assert next_pow2(n) == triton.next_power_of_2(n), n
        for d in (1, 3, 4, 16, 128):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert cdiv(0, 4) == 0
