"""Per-call cost of the code tool's sandbox (docs/multi-turn.md, "The sandbox's threat model"): the median wall-clock
milliseconds of one ``run_python`` call with the isolation layer (bubblewrap) against the opt-out
(``isolation="none"``: the same child, prelude and audit hook as before issue 51, without the layer).

    python experiments/sandbox_overhead.py [--calls 50] [--code "print(1)"]

Prints one line per mode (median, 10th and 90th percentile ms over ``--calls`` calls, after 3 warm-up calls)
and the difference of the medians (the modes alternate call by call, so a busy machine slows both alike), then
the layer's own set-up: the same bwrap command line running ``/bin/true`` instead of Python, against a plain
``/bin/true``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from treejax.envs.sandbox import SandboxConfig, bwrap_command, check_isolation, run_python


def measure(calls: int, code: str) -> dict[str, list[float]]:
    """Milliseconds of each call, per mode (``"bwrap"``, ``"none"``), the modes alternating."""
    configs = {mode: SandboxConfig(isolation=mode) for mode in ("bwrap", "none")}
    for config in configs.values():
        check_isolation(config)
    times: dict[str, list[float]] = {mode: [] for mode in configs}
    for i in range(calls + 3):
        for mode, config in configs.items():
            t = time.perf_counter()
            r = run_python(code, config)
            ms = 1000 * (time.perf_counter() - t)
            if not r.ok:
                raise RuntimeError(f"{mode}: the snippet failed: {r.observation()}")
            if i >= 3:
                times[mode].append(ms)
    return times


def setup_ms(calls: int) -> tuple[list[float], list[float]]:
    """Milliseconds of the bwrap command line with ``/bin/true`` as the program, and of a plain ``/bin/true``."""
    bwrap = check_isolation(SandboxConfig())
    cmd = bwrap_command(bwrap, SandboxConfig(), os.geteuid() == 0)
    cmd = cmd[:cmd.index("--") + 1] + ["/bin/true"]
    inside, plain = [], []
    for _ in range(calls):
        for argv, out in ((cmd, inside), (["/bin/true"], plain)):
            t = time.perf_counter()
            subprocess.run(argv, check=True)
            out.append(1000 * (time.perf_counter() - t))
    return inside, plain


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--code", default="print(1)")
    args = parser.parse_args(argv)
    times = measure(args.calls, args.code)
    medians = {}
    for mode, ms in times.items():
        q = statistics.quantiles(ms, n=10)
        medians[mode] = statistics.median(ms)
        print(f"{mode:5s}: median {medians[mode]:6.1f} ms per call (p10 {q[0]:.1f}, p90 {q[-1]:.1f}; "
              f"{len(ms)} calls of {args.code!r})")
    print(f"isolation layer overhead: {medians['bwrap'] - medians['none']:+.1f} ms per call (median)")
    inside, plain = setup_ms(max(args.calls, 20))
    print(f"bwrap set-up alone: /bin/true inside the layer {statistics.median(inside):.1f} ms (median; max "
          f"{max(inside):.1f}), plain /bin/true {statistics.median(plain):.1f} ms")


if __name__ == "__main__":
    main()
