"""Metrics tests: TensorBoard scalars round trip, console line, and deferred (non-blocking) readback order."""

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.metrics import DeferredMetrics, MetricsWriter, format_console, iter_event_scalars, to_host_scalars


def test_event_files_round_trip_and_console(tmp_path):
    lines = []
    with MetricsWriter(tmp_path / "tb", console_keys=("loss", "reward"), print_fn=lines.append,
                       total_steps=3) as w:
        for step in range(3):
            w.write_scalars(step, {"loss": jnp.float32(0.5 * step), "reward": 0.25, "rl": {"kl": jnp.float32(1e-4)}})
        w.write_image(2, "tree", np.zeros((8, 8, 3), np.uint8))
        w.write_text(2, "sample", "hello")
    got = sorted(iter_event_scalars(tmp_path / "tb"))
    assert ("loss", 2, 1.0) in got and ("reward", 0, 0.25) in got
    assert [s for t, s, _ in got if t == "rl/kl"] == [0, 1, 2]
    assert lines[1].startswith("step 1/3 | loss 0.5 | reward 0.25 | elapsed")


def test_format_console_and_scalars():
    assert format_console(4, {"b": 2.0, "a": 1e-6}) == "step 4 | a 1.000e-06 | b 2"
    with pytest.raises(ValueError, match="not a scalar"):
        to_host_scalars({"x": jnp.zeros(3)})


def test_deferred_returns_previous_step_only():
    d = DeferredMetrics()
    assert d.push(0, {"x": jnp.float32(0.0)}) == []
    assert d.push(1, {"x": jnp.float32(1.0)}) == [(0, {"x": 0.0})]
    assert d.flush() == [(1, {"x": 1.0})]
    assert d.flush() == []


def test_two_writers_in_one_folder_never_share_an_event_file(tmp_path):
    """Two writers opened in the same second (two runs, or a run and its resume) write separate files, and every
    point of both reads back."""
    import os

    a = MetricsWriter(tmp_path, print_fn=lambda line: None)
    b = MetricsWriter(tmp_path, print_fn=lambda line: None)
    a.write_scalars(1, {"x": 1.0})
    b.write_scalars(1, {"x": 2.0})
    a.close()
    b.close()
    assert len([f for f in os.listdir(tmp_path) if "tfevents" in f]) == 2
    assert sorted(v for t, _, v in iter_event_scalars(tmp_path) if t == "x") == [1.0, 2.0]
