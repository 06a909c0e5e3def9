"""CPU smoke test of experiments/bench_tree_attention.py (Pallas interpreter, tiny shapes): every tile setting
gives a row, equal outputs across tiles, bad tile strings are refused."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "experiments"))


@pytest.mark.slow  # ~27 s on 2 cores: the benchmark's sweep writer, not a kernel check
def test_tile_sweep_writes_a_row_per_setting(tmp_path, capsys):
    import bench_tree_attention

    out = tmp_path / "tiles.json"
    bench_tree_attention.main(["--preset", "tiny", "--prompts", "1", "--leaves", "4", "--depth", "2", "--segment",
                               "16", "--prompt-len", "8", "--granule", "16", "--tiles", "16,16,16", "32,16,16,4,3",
                               "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["tiles"] for r in rows] == ["16,16,16", "32,16,16,4,3"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in rows)
    assert "max |out - first| 0.0e+00" in capsys.readouterr().out  # tiles change the order of sums only
    with pytest.raises(SystemExit, match="powers of two"):
        bench_tree_attention.main(["--preset", "tiny", "--tiles", "24,16,16"])


@pytest.mark.slow  # ~1 min on 2 cores: Mosaic GPU's interpret mode at qwen2.5-0.5b's 14 heads
def test_mgpu_rows_next_to_triton(tmp_path, capsys):
    """``--mgpu`` adds a row per Mosaic GPU setting after the Triton ones, its forward checked against the Triton
    forward (bf16 inputs: a bf16-sized difference); a bad setting is refused."""
    import bench_tree_attention

    out = tmp_path / "mgpu.json"
    bench_tree_attention.main(["--preset", "qwen2.5-0.5b", "--prompts", "1", "--leaves", "2", "--depth", "2",
                               "--segment", "64", "--prompt-len", "40", "--granule", "64", "--tiles", "64,64,64",
                               "--mgpu", "default", "--repeats", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kernel"], r["tiles"]) for r in rows] == [("triton", "64,64,64"), ("mgpu", "mgpu default")]
    diff = float(capsys.readouterr().out.split("max |out - triton| ")[1].split()[0])
    assert diff < 3e-2
    with pytest.raises(SystemExit, match="bad option"):
        bench_tree_attention.main(["--preset", "tiny", "--mgpu", "q=128"])
