"""``kvpilot generate``: a bad sampling flag is an argparse error (exit 2) before the model loads."""

from __future__ import annotations

import pytest

from kvpilot.cli import main


@pytest.mark.parametrize("seed", [str(1 << 64), str(-(1 << 63) - 1), "99999999999999999999999"])
def test_a_sampling_seed_a_generator_cannot_take_is_refused(seed, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", "tiny-random", "--sampling-seed", seed, "hi"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"kvpilot generate: error: seed must be an integer in [-2**63, 2**64 - 1], got {seed}\n"
    )


@pytest.mark.parametrize("seed", [(1 << 64) - 1, -(1 << 63)])
def test_the_extreme_seeds_are_accepted(seed):
    from kvpilot.engine.sampling.params import SamplingParams

    assert SamplingParams(seed=seed).seed == seed
