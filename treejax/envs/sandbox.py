"""A sandboxed Python runner for tool-use rollouts: the model's code runs in a child process with time, memory,
output and file limits, and whatever it does comes back as text (an observation), never as an exception.

Layers (each one a limit the child cannot lift):

1. **A fresh process group** (``start_new_session``) in a fresh temporary directory (the working directory; deleted
   afterwards), with an empty environment and Python's isolated mode (``-I``: no user site, no ``PYTHON*``
   variables, no script directory on ``sys.path``).
2. **Resource limits** (``setrlimit``, the child's first statements, before it reads the code): address space
   (``memory_mb``), CPU seconds (``timeout_s + 1``), the largest file it may write (``file_mb``), open files (64)
   and no core dumps. The process limit (``RLIMIT_NPROC``) does not bind root, so it is not relied on. (Set in the
   child rather than in a ``preexec_fn``: the parent is a multithreaded JAX process, and code between ``fork``
   and ``exec`` can deadlock there; without it ``subprocess`` starts the child with ``vfork``/``posix_spawn``.)
3. **An audit hook** (:pep:`578`, installed before the snippet runs; a hook cannot be removed) that raises
   ``PermissionError`` on: starting processes (``os.system``, ``subprocess``, ``os.fork``/``posix_spawn``/``exec*``,
   ``pty``), opening files for writing outside the temporary directory, network connections (``socket.connect``,
   ``bind``, ``getaddrinfo``), ``ctypes`` / ``_ctypes`` (native calls would bypass the hook), and changing the
   directory or the limits. The snippet sees an ordinary Python exception; the observation carries its traceback.
4. **A wall-clock limit** (``timeout_s``): past it the whole process group gets ``SIGKILL``, and so does every
   descendant still found under the child in ``/proc`` (a descendant that left the group).

stdout and stderr go to files in the working directory, so the file-size limit bounds a flood of output too. The
result (:class:`RunResult`) holds the first ``max_output`` characters of stdout and the last of stderr, the exit code,
whether the limit killed it, the seconds, and :meth:`RunResult.observation`: the text an environment appends to
the conversation. This is a guard for a model's mistakes and ordinary misbehaviour on a research machine, not a
security boundary against a determined attacker (no namespaces or seccomp; run untrusted models in a container).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

_PRELUDE = r'''
import os, sys
import resource as _resource

for _name, _value in zip(("RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE"), map(int, sys.argv[1:4])):
    _resource.setrlimit(getattr(_resource, _name), (_value, _value))
_resource.setrlimit(_resource.RLIMIT_NOFILE, (64, 64))
_resource.setrlimit(_resource.RLIMIT_CORE, (0, 0))
del _name, _value, _resource

def _install():
    root = os.path.realpath(os.getcwd())
    blocked = {"os.system", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen", "pty.spawn",
               "socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "os.chdir", "os.setsid",
               "resource.setrlimit", "os.kill", "os.killpg", "ctypes.dlopen", "ctypes.dlsym", "gc.get_objects",
               "gc.get_referrers", "gc.get_referents", "sys._current_frames"}
    sealed = [False]

    def inside(path):
        full = os.path.realpath(os.fsdecode(path))
        return full == root or full.startswith(root + os.sep), full

    def hook(event, args):
        if not sealed[0]:
            return
        if event in blocked or event.startswith(("os.exec", "os.spawn")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in ("ctypes", "_ctypes"):
            raise PermissionError("sandbox: ctypes is not allowed")
        if event == "open" and len(args) >= 3 and isinstance(args[0], (str, bytes, os.PathLike)):
            mode, flags = args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND
                                                         | os.O_TRUNC)))
            ok, full = inside(args[0])
            if writes and not ok:
                raise PermissionError(f"sandbox: writing {full} (outside the working directory) is not allowed")
        if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.chmod",
                     "os.truncate", "shutil.rmtree", "shutil.move", "shutil.copyfile") and args:
            ok, full = inside(args[0])
            if not ok:
                raise PermissionError(f"sandbox: {event} of {full} (outside the working directory) is not allowed")

    sys.addaudithook(hook)
    return sealed

_sealed = _install()
_code = sys.stdin.read()
_sealed[0] = True
del _sealed, _install
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
'''


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Limits of one run: wall-clock ``timeout_s``, address space ``memory_mb``, the largest file ``file_mb``, the
    characters of stdout / stderr kept (``max_output``), and the interpreter (default: this one)."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_output: int = 4000
    python: str = ""

    def __post_init__(self):
        if self.timeout_s <= 0 or self.memory_mb < 64 or self.file_mb < 0 or self.max_output < 1:
            raise ValueError(f"SandboxConfig: timeout_s > 0, memory_mb >= 64, file_mb >= 0 and max_output >= 1 "
                             f"required, got {self}")


_SIGNALS = {int(signal.SIGXFSZ): "the code wrote more output or file data than its limit and was stopped",
            int(signal.SIGXCPU): "the code used more CPU time than its limit and was stopped",
            int(signal.SIGKILL): "the code was killed (memory or time limit)",
            int(signal.SIGSEGV): "the code crashed (segmentation fault)"}


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one run did: its (cut) ``stdout`` / ``stderr``, ``exit_code`` (negative: killed by that signal),
    ``timed_out`` (the wall-clock limit killed it), ``seconds``."""

    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def observation(self) -> str:
        """The text a tool call returns: stdout, then on failure the error (the traceback's last line, or the
        limit that stopped it)."""
        out = self.stdout
        if self.timed_out:
            return f"{out}\n[error] the code ran past its time limit and was stopped".lstrip("\n")
        if self.exit_code != 0:
            lines = [ln for ln in self.stderr.strip().splitlines() if ln.strip()]
            why = lines[-1] if lines else _SIGNALS.get(-self.exit_code, f"exit code {self.exit_code}")
            return f"{out}\n[error] {why}".lstrip("\n")
        return out


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` still alive (read from ``/proc``; empty where there is no ``/proc``)."""
    parent: dict[int, int] = {}
    try:
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        parent[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
    except OSError:
        return []
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _kill_all(proc: subprocess.Popen) -> None:
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def run_python(code: str, config: SandboxConfig = SandboxConfig()) -> RunResult:
    """Runs ``code`` in the sandbox (module docstring) and returns what it did; never raises for anything the code
    does."""
    if not isinstance(code, str):
        raise TypeError(f"run_python takes the code as str, got {type(code).__name__}")
    workdir = tempfile.mkdtemp(prefix="treejax_tool_")
    t = time.perf_counter()
    timed_out = False
    try:
        # stdout / stderr go to files in the working directory: RLIMIT_FSIZE bounds them (a flood of output
        # stops the child with SIGXFSZ instead of filling this process's memory through a pipe)
        with open(os.path.join(workdir, ".stdout"), "wb") as fo, open(os.path.join(workdir, ".stderr"), "wb") as fe:
            limits = [str(config.memory_mb * 2 ** 20), str(int(config.timeout_s) + 1), str(config.file_mb * 2 ** 20)]
            proc = subprocess.Popen([config.python or sys.executable, "-I", "-B", "-c", _PRELUDE, *limits],
                                    cwd=workdir, stdin=subprocess.PIPE, stdout=fo, stderr=fe,
                                    env={"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"},
                                    start_new_session=True)
            try:
                proc.stdin.write(code.encode())
                proc.stdin.close()
            except BrokenPipeError:  # the child died before reading its code
                pass
            try:
                proc.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_all(proc)
                proc.wait()
            _kill_all(proc)  # whatever it left behind
        out = _read(os.path.join(workdir, ".stdout"), config.max_output, tail=False)
        err = _read(os.path.join(workdir, ".stderr"), config.max_output, tail=True)  # the error is at the end
        code_ = proc.returncode
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return RunResult(stdout=out, stderr=err, exit_code=int(code_), timed_out=timed_out,
                     seconds=time.perf_counter() - t)


def _read(path: str, chars: int, tail: bool) -> str:
    """The first (or with ``tail`` the last) ``chars`` characters of a file the child wrote."""
    try:
        with open(path, "rb") as f:
            if tail:
                f.seek(max(0, os.path.getsize(path) - 4 * chars))
                return f.read().decode("utf-8", "replace")[-chars:]
            return f.read(4 * chars).decode("utf-8", "replace")[:chars]
    except OSError:
        return ""


__all__ = ["RunResult", "SandboxConfig", "run_python"]
