"""Local multi-process launcher: ``python -m treejax.launch --num_processes 2 --devices_per_process 4 -- <args>``.

Starts ``N`` copies of ``treejax-train <args>`` (or of ``python -m MODULE <args>`` with ``--module``) on this
machine, joined by ``jax.distributed`` through a coordinator on a free local port. Each process gets, in its
environment, ``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT``, ``JAX_NUM_PROCESSES=N``, ``JAX_PROCESS_ID=i`` (read by
:func:`treejax.parallel.multihost.maybe_initialize_distributed`), ``TREEJAX_HEARTBEAT_TIMEOUT_S`` when given, and
its devices:

* ``--platform cpu`` (default) with ``--devices_per_process K``: ``JAX_PLATFORMS=cpu`` and
  ``XLA_FLAGS=--xla_force_host_platform_device_count=K`` (fake CPU devices; collectives through gloo);
* ``--platform gpu`` with ``--devices_per_process K``: ``CUDA_VISIBLE_DEVICES`` = GPUs ``i*K .. i*K+K-1``.

Each output line of process ``i`` is prefixed with ``[i]``. Failures propagate: when a process exits with a
non-zero status (or is killed), the launcher kills the others (their process groups, SIGKILL: without the failed
peer they can only wait in a collective), names the process and its status, and exits non-zero (the failed
process's status, 128 + signal for a signal). ``--timeout_s`` bounds the whole run the same way. SIGINT/SIGTERM
to the launcher are forwarded to every process (treejax-train saves a checkpoint and stops at the next step).

Several hosts need no launcher: run the same ``treejax-train`` command on every host with
``--coordinator HOST0:PORT --num_processes N --process_id i`` (README, "Several processes and hosts").
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

__all__ = ["free_port", "launch", "main", "process_env"]


def free_port() -> int:
    """A TCP port that was free on every address a moment ago (bound and released; the coordinator binds it next).

    The coordinator (``jax.distributed``) listens on the wildcard addresses ``[::]`` and ``0.0.0.0``, so the port
    is probed there: a port bound only on ``127.0.0.1`` can still be the local port of another socket on another
    address (an outgoing connection from the ephemeral range), and the coordinator's bind then fails with
    "Address already in use" (seen on a 2-GPU machine)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual stack: IPv4 and IPv6 wildcards
            s.bind(("::", 0))
            return s.getsockname()[1]
    except OSError:  # no IPv6 on this host
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("0.0.0.0", 0))
            return s.getsockname()[1]


def process_env(base: dict[str, str], index: int, num_processes: int, coordinator: str,
                devices_per_process: int | None, platform: str, heartbeat_timeout_s: int | None) -> dict[str, str]:
    """The environment of process ``index`` (module docstring)."""
    env = dict(base)
    env.update(JAX_COORDINATOR_ADDRESS=coordinator, JAX_NUM_PROCESSES=str(num_processes), JAX_PROCESS_ID=str(index),
               PYTHONUNBUFFERED="1")
    if heartbeat_timeout_s is not None:
        env["TREEJAX_HEARTBEAT_TIMEOUT_S"] = str(heartbeat_timeout_s)
    if devices_per_process is not None:
        if platform == "cpu":
            flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
            env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
            env["JAX_PLATFORMS"] = "cpu"
        else:
            first = index * devices_per_process
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + k) for k in range(devices_per_process))
    return env


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _pump(stream, out, prefix: str) -> None:
    for line in iter(stream.readline, b""):
        out.buffer.write(prefix.encode() + line)
        out.flush()
    stream.close()


def _kill_all(procs: list[subprocess.Popen], sig: int = signal.SIGKILL) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass


def launch(command: list[str], num_processes: int, *, devices_per_process: int | None = None,
           platform: str = "cpu", heartbeat_timeout_s: int | None = None, timeout_s: float | None = None,
           port: int | None = None, poll_s: float = 0.2) -> int:
    """Runs ``command`` as ``num_processes`` processes of one ``jax.distributed`` job; returns the exit status
    (0 when every process exited 0; module docstring for the failure rules)."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    for i in range(num_processes):
        env = process_env(os.environ, i, num_processes, coordinator, devices_per_process, platform,
                          heartbeat_timeout_s)
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)  # its own process group: killed as a whole
        procs.append(p)
        for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[{i}] "), daemon=True)
            t.start()
            pumps.append(t)
        print(f"treejax.launch: process {i} of {num_processes} started (pid {p.pid}, coordinator {coordinator})",
              file=sys.stderr, flush=True)

    forwarded = {"signal": None}

    def forward(signum, frame):
        del frame
        forwarded["signal"] = signum
        _kill_all(procs, signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    start = time.monotonic()
    status = 0
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed and forwarded["signal"] is None:
                i, rc = failed[0]
                alive = [j for j, c in enumerate(codes) if c is None]
                print(f"treejax.launch: process {i} (pid {procs[i].pid}) {_describe(rc)}; "
                      + (f"killing processes {alive}" if alive else "no other process is running"),
                      file=sys.stderr, flush=True)
                _kill_all(procs)
                status = rc if rc > 0 else 128 - rc
                message = f"treejax.launch: failed: process {i} of {num_processes} {_describe(rc)}"
                break
            if all(c is not None for c in codes):
                status = next((c if c > 0 else 128 - c for c in codes if c != 0), 0)
                message = None if status == 0 else f"treejax.launch: stopped by {signal.Signals(forwarded['signal']).name}"
                break
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                alive = [j for j, c in enumerate(codes) if c is None]
                _kill_all(procs)
                status = 124
                message = f"treejax.launch: failed: timed out after {timeout_s:g} s; killed processes {alive}"
                break
            time.sleep(poll_s)
        for p in procs:
            p.wait()
        for t in pumps:
            t.join(timeout=5)
    finally:
        _kill_all(procs)
        for s, h in previous.items():
            signal.signal(s, h)
    if message:
        print(message, file=sys.stderr, flush=True)
    return status


def _shell_join(args: list[str]) -> str:
    """``args`` as a shell command line, a gin binding with single quotes in double quotes, as the README writes
    it (``--gin_param "RunConfig.estimator='grpo'"``)."""
    def quote(arg: str) -> str:
        if shlex.quote(arg) == arg or any(c in arg for c in '"$`\\!'):
            return shlex.quote(arg)
        return f'"{arg}"'

    return " ".join(map(quote, args))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        cut = argv.index("--")
        own, rest = argv[:cut], argv[cut + 1:]
    else:
        own, rest = argv, []
    parser = argparse.ArgumentParser(prog="python -m treejax.launch",
                                     usage="python -m treejax.launch -n N [options] -- TRAINER_ARGS ...",
                                     description=__doc__.split("\n\n")[0],
                                     epilog="everything after -- goes to each process (treejax-train's arguments)")
    parser.add_argument("-n", "--num_processes", type=int, required=True)
    parser.add_argument("--devices_per_process", type=int, default=None,
                        help="fake CPU devices (--platform cpu) or GPUs (--platform gpu) per process")
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--module", default="treejax.train", help="run python -m MODULE (default treejax.train)")
    parser.add_argument("--heartbeat_timeout_s", type=int, default=None,
                        help="jax.distributed: a process silent this long is dead and the others stop (JAX: 100)")
    parser.add_argument("--timeout_s", type=float, default=None, help="kill every process after this long")
    parser.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    args, unknown = parser.parse_known_args(own)
    if unknown:  # e.g. --gin_param before the separator: say where it goes, with the command that does it
        known = list(own)
        for arg in unknown:
            known.remove(arg)
        parser.error(f"unrecognized arguments: {_shell_join(unknown)}; the trainer's arguments go after --: "
                     f"python -m treejax.launch {_shell_join(known)} -- {_shell_join(unknown + rest)}")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        parser.error(f"--devices_per_process must be >= 1, got {args.devices_per_process}")
    if args.num_processes < 1:
        parser.error(f"--num_processes must be >= 1, got {args.num_processes}")
    command = [sys.executable, "-m", args.module, *rest]
    return launch(command, args.num_processes, devices_per_process=args.devices_per_process, platform=args.platform,
                  heartbeat_timeout_s=args.heartbeat_timeout_s, timeout_s=args.timeout_s, port=args.port)


if __name__ == "__main__":
    sys.exit(main())
