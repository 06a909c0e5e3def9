"""Per-call cost of the code tool's sandbox (README "The sandbox's threat model"): the median wall-clock
milliseconds of one ``run_python`` call with the isolation layer (bubblewrap) against the opt-out
(``isolation="none"``: the same child, prelude and audit hook as before issue 51, without the layer).

    python experiments/sandbox_overhead.py [--calls 50] [--code "print(1)"]

Prints one line per mode (median, 10th and 90th percentile ms over ``--calls`` calls, after 3 warm-up calls)
and the difference of the medians. The modes alternate call by call, so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

from treejax.envs.sandbox import SandboxConfig, check_isolation, run_python


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


if __name__ == "__main__":
    main()
