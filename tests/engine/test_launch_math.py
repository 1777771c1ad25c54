"""The host-side launch arithmetic gives Triton's integers."""

import triton

from kvpilot.engine.attention.kernels.launch_math import cdiv, next_power_of_2


def test_next_power_of_2_is_tritons():
    for n in range(1, 70_000):
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_is_tritons():
    for a in range(0, 3000, 7):
        for b in (1, 2, 3, 16, 31, 64, 256, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
