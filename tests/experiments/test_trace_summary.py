"""experiments/trace_summary.py on hand-written perfetto traces: device kernels summed by name (host events
ignored when a device process exists, used when none does), ``--match``, and a clear error without traces."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "experiments"))


def _trace(path, processes, events):
    os.makedirs(path, exist_ok=True)
    meta = [dict(ph="M", name="process_name", pid=pid, args=dict(name=name)) for pid, name in processes.items()]
    x = [dict(ph="X", pid=pid, name=name, ts=i, dur=dur) for i, (pid, name, dur) in enumerate(events)]
    with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
        json.dump(dict(traceEvents=meta + x), f)


def test_device_kernels_summed_by_name(tmp_path, capsys):
    import trace_summary

    _trace(tmp_path / "gpu" / "plugins", {1: "/host:CPU", 2: "/device:GPU:0"},
           [(2, "tree_flash_forward", 30.0), (2, "fusion.1", 10.0), (2, "tree_flash_forward", 50.0),
            (1, "ThunkExecutor::Execute", 500.0)])
    _trace(tmp_path / "cpu", {1: "/host:CPU"}, [(1, "ThunkExecutor::Execute", 5.0)])
    out = trace_summary.main([str(tmp_path), "--top", "5"])
    gpu = next(v for k, v in out.items() if "gpu" in k)
    assert gpu["processes"] == ["/device:GPU:0"] and gpu["total_us"] == 90.0
    assert gpu["kernels"] == [("tree_flash_forward", 80.0, 2), ("fusion.1", 10.0, 1)]
    cpu = next(v for k, v in out.items() if "cpu" in k)
    assert cpu["processes"] == ["/host:CPU"] and cpu["kernels"] == [("ThunkExecutor::Execute", 5.0, 1)]
    assert " 88.9%" in capsys.readouterr().out
    only = trace_summary.main([str(tmp_path / "gpu"), "--match", "fusion"])
    assert list(only.values())[0]["kernels"] == [("fusion.1", 10.0, 1)]
    with pytest.raises(SystemExit, match="no perfetto_trace.json.gz"):
        trace_summary.main([str(tmp_path / "empty")])
