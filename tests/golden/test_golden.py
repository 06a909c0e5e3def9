"""The golden runs of the rollout-chain redesign (tests/golden/golden.py): every CLI feature case and every shipped
config, 2 steps each, equal bit for bit to what the code before the redesign recorded. Bit-for-bit equality holds
on the kind of machine that recorded them (XLA:CPU, x86-64, jax 0.10.2); elsewhere re-record on the old code first
(``git stash; python -m tests.golden.golden record``)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # ~75 two-step runs (~15 min with a warm compilation cache, ~45 min cold)
def test_every_golden_run_is_equal_bit_for_bit():
    """``python -m tests.golden.golden check`` in a process of its own, with the caller's XLA flags: the records
    were made that way (one CPU device, XLA's default optimisation level), not under this suite's flags (8 fake
    devices, LLVM passes off: tests/conftest.py). Its work folder keeps a compilation cache between runs."""
    env = dict(os.environ, XLA_FLAGS=os.environ.get("TREEJAX_TEST_CALLER_XLA_FLAGS", ""))
    out = subprocess.run([sys.executable, "-m", "tests.golden.golden", "check"], cwd=ROOT, env=env)
    assert out.returncode == 0
