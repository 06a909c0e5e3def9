"""The golden runs of the rollout-chain redesign (tests/golden/golden.py): every CLI feature case and every shipped
config, 2 steps each, equal bit for bit to the recorded runs. Bit-for-bit equality holds only on the kind of machine
that recorded them (the file's ``_machine``: CPU model, vector unit, jax, jaxlib; golden.py's docstring says what
differs elsewhere), so on another machine the test skips; re-record there on the code before a change
(``git stash; python -m tests.golden.golden record --all; git stash pop``), then check."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.golden import golden  # noqa: E402


@pytest.mark.slow  # ~90 two-step runs (~15 min with a warm compilation cache, ~45 min cold)
def test_every_golden_run_is_equal_bit_for_bit():
    """``python -m tests.golden.golden check`` in a process of its own, with the caller's XLA flags: the records
    were made that way (one CPU device, XLA's default optimisation level), not under this suite's flags (8 fake
    devices, LLVM passes off: tests/conftest.py). Its work folder keeps a compilation cache between runs."""
    recorded = json.load(open(golden.GOLDEN)).get("_machine")
    env = dict(os.environ, XLA_FLAGS=os.environ.get("TREEJAX_TEST_CALLER_XLA_FLAGS", ""))
    here = json.loads(subprocess.run([sys.executable, "-c", "import json; from tests.golden import golden; "
                                      "print(json.dumps(golden.machine()))"], cwd=ROOT, env=env,
                                     capture_output=True, text=True, check=True).stdout)
    if recorded != here:
        pytest.skip(f"golden runs recorded on {recorded}, this machine is {here}: bit-equality holds only there")
    out = subprocess.run([sys.executable, "-m", "tests.golden.golden", "check"], cwd=ROOT, env=env)
    assert out.returncode == 0


def test_the_records_name_their_machine():
    """Every case was recorded on one machine, named in the file (``record --all`` writes it)."""
    records = json.load(open(golden.GOLDEN))
    assert set(records["_machine"]) == {"cpu", "vector", "jax", "jaxlib"}
    assert all("steps" in r or "error" in r for k, r in records.items() if k != "_machine")
