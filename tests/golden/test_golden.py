"""The golden runs of the rollout-chain redesign (tests/golden/golden.py): every CLI feature case and every shipped
config, 2 steps each, equal bit for bit to what the code before the redesign recorded. Bit-for-bit equality holds
on the kind of machine that recorded them (XLA:CPU, x86-64, jax 0.10.2); elsewhere re-record on the old code first
(``git stash; python -m tests.golden.golden record``)."""

import pytest

from golden import golden  # tests/golden is a package; pytest puts tests/ on the path


@pytest.mark.slow  # ~75 two-step runs (~15 min with a warm compilation cache, ~45 min cold)
def test_every_golden_run_is_equal_bit_for_bit():
    assert golden.main(["check"]) == 0  # its work folder keeps a compilation cache between runs
