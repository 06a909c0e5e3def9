"""The Python tool's sandbox (treejax.envs.sandbox): ordinary code returns its output; hostile snippets (an endless
loop, a huge allocation, spawning processes, os.system, writes outside the working directory, the network, ctypes,
an output flood) each come back as a clean error observation within the limits, and leave nothing behind."""

from __future__ import annotations

import os
import time

import pytest

from treejax.envs.sandbox import RunResult, SandboxConfig, run_python

FAST = SandboxConfig(timeout_s=2.0, memory_mb=512, file_mb=1, max_output=200)


def test_ordinary_code_returns_its_output():
    r = run_python("import math\nprint(sum(i * i for i in range(10)), round(math.pi, 3))", FAST)
    assert r.ok and r.observation() == "285 3.142\n"
    r = run_python("open('notes.txt', 'w').write('kept'); print(open('notes.txt').read())", FAST)
    assert r.ok and r.observation() == "kept\n"  # its own working directory is writable


def test_an_exception_is_its_last_line():
    r = run_python("print('before')\nraise ValueError('bad input')", FAST)
    assert not r.ok and r.exit_code == 1
    assert r.observation() == "before\n\n[error] ValueError: bad input"


def test_an_endless_loop_is_stopped_at_the_time_limit():
    t = time.perf_counter()
    r = run_python("print('started', flush=True)\nwhile True:\n    pass", FAST)
    assert r.timed_out and not r.ok and time.perf_counter() - t < FAST.timeout_s + 3
    assert r.observation().startswith("started\n") and "time limit" in r.observation()


def test_a_huge_allocation_is_a_memory_error():
    r = run_python("x = bytearray(8 * 2**30)", FAST)
    assert not r.ok and r.observation() == "[error] MemoryError"


@pytest.mark.parametrize("code, event", [
    ("import os\nfor _ in range(50):\n    if os.fork() == 0:\n        import time; time.sleep(60)", "os.fork"),
    ("import subprocess\nfor _ in range(50):\n    subprocess.Popen(['sleep', '60'])", "subprocess.Popen"),
    ("import os; os.system('touch /tmp/treejax_sandbox_escaped')", "os.system"),
    ("import multiprocessing as mp\nmp.Process(target=print).start()", "os.fork"),
    ("import os; os.execv('/bin/sh', ['sh'])", "os.exec"),
    ("import socket; socket.create_connection(('192.0.2.1', 80), timeout=1)", "socket."),
    ("import ctypes", "ctypes"),
    ("import os; os.kill(1, 9)", "os.kill"),
])
def test_processes_network_and_native_calls_are_refused(code, event):
    r = run_python(code, FAST)
    assert not r.ok and not r.timed_out
    assert "[error] PermissionError: sandbox: " in r.observation() and event in r.observation()
    assert not os.path.exists("/tmp/treejax_sandbox_escaped")


@pytest.mark.parametrize("code", ["open('/tmp/treejax_sandbox_w', 'w').write('x')",
                                  "import os; os.open('/tmp/treejax_sandbox_w', os.O_WRONLY | os.O_CREAT)",
                                  "import os; os.remove('/etc/hostname')",
                                  "open('../treejax_sandbox_w', 'a')"])
def test_writes_outside_the_working_directory_are_refused(code):
    r = run_python(code, FAST)
    assert "[error] PermissionError: sandbox: " in r.observation()
    assert not os.path.exists("/tmp/treejax_sandbox_w")


def test_an_output_flood_is_bounded():
    t = time.perf_counter()
    r = run_python("while True:\n    print('x' * 10000)", FAST)
    assert not r.ok and len(r.stdout) == FAST.max_output and "File too large" in r.observation()
    assert time.perf_counter() - t < FAST.timeout_s + 3


def test_the_hook_cannot_be_switched_off_from_the_snippet():
    r = run_python("import __main__, gc\nprint(sorted(k for k in vars(__main__) if 'seal' in k))\ngc.get_objects()", FAST)
    assert r.stdout == "[]\n" and "gc.get_objects is not allowed" in r.observation()


def test_bad_arguments():
    with pytest.raises(TypeError, match="str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxConfig(timeout_s=0)
    assert RunResult("", "", -25, False, 0.1).observation().startswith("[error] the code wrote more output")
