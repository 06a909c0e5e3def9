"""Test set-up: 8 fake CPU devices for sharding tests, strict rank promotion, slow/gpu/devices markers.

``TREEJAX_TEST_DEVICE=gpu`` runs the suite on the default backend (a GPU) instead: the CPU platform and the fake
devices are not forced, tests marked ``devices(n)`` skip where fewer than ``n`` devices exist, tests marked
``gpu`` run, and the session runs with ``jax_default_matmul_precision = "highest"``, so float32 matmuls are full
fp32 (XLA's GPU default is TF32) and the float32 tolerances stay the CPU ones (bf16 operands keep their bf16
algorithms; a test or fixture may still ask for another precision explicitly). See docs/gpu.md, "Running the
correctness suite on a GPU".
"""

import os
import subprocess
import sys


def _xla_knows(flag: str) -> bool:
    """Whether this jaxlib's CPU client starts with ``flag`` in XLA_FLAGS (it aborts on a flag it does not know)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    try:
        return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True,
                              timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


TEST_DEVICE = os.environ.get("TREEJAX_TEST_DEVICE", "cpu")
if TEST_DEVICE not in ("cpu", "gpu"):
    raise ValueError(f"TREEJAX_TEST_DEVICE must be 'cpu' or 'gpu', got {TEST_DEVICE!r}")

# Must happen before jax initialises its backends.
#: The caller's XLA_FLAGS, before the ones below: the golden runs (tests/golden) replay in a process with these.
os.environ.setdefault("TREEJAX_TEST_CALLER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
if TEST_DEVICE == "cpu":
    _flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in _flags:
        _flags = (_flags + " --xla_force_host_platform_device_count=8").strip()
    # XLA:CPU aborts the whole process (LOG(FATAL) in InProcessCommunicator, "Termination timeout ... exceeded")
    # when the 8 fake devices of one collective do not all arrive within 40 s: on a loaded 2-core machine (xdist
    # workers, the runs tests start, compiles) one device's thread can be that late, and the worker dies with
    # "node down". A starved test is slow, not wrong: wait up to 30 min (XLA's own collective timeout) instead.
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in _flags:
        _flags += (" --xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
                   " --xla_cpu_collective_call_terminate_timeout_seconds=1800")
    # Compile without LLVM's optimisation passes: the suite's programs are small and most of its time is XLA:CPU
    # compiling them, not running them. Measured on this 2-core machine, alone, on tests/rl/test_packing.py +
    # tests/sampling/test_decode.py (40 tests): 248 CPU s / 177 s wall at the default level, 162 CPU s / 132 s at 0,
    # same results (XLA's own HLO passes still run; without fast-math LLVM may not reassociate floating-point
    # arithmetic at any level). Set another --xla_backend_optimization_level in XLA_FLAGS to test at that level.
    if "xla_backend_optimization_level" not in _flags:
        _flags += " --xla_backend_optimization_level=0"
    # Emit fusions with XLA:CPU's older elemental emitter instead of its MLIR fusion emitters, whose compile
    # pipeline costs more than the suite's small programs ever run. Measured on this 2-core machine (user CPU s,
    # on top of the level-0 flag above): tests/rl/test_loop_features.py::test_every_estimator_and_loss_term_
    # through_rl_step 36.2 -> 18.4; all of tests/rl (547 tests) 767 -> 524, all passing. Upstream XLA is retiring
    # that emitter (openxla/xla#48001) and an unknown XLA flag aborts the process, so the flag is passed only
    # where this jaxlib knows it: asked once, in a child process (~3 s), whose answer xdist's workers and the
    # processes tests start inherit (XLA_FLAGS, or TREEJAX_TEST_NO_LEGACY_EMITTER=1 where it does not know it).
    # Set --xla_cpu_use_fusion_emitters=true in XLA_FLAGS to test with the fusion emitters.
    if "xla_cpu_use_fusion_emitters" not in _flags and os.environ.get("TREEJAX_TEST_NO_LEGACY_EMITTER") != "1":
        if _xla_knows("--xla_cpu_use_fusion_emitters=false"):
            _flags += " --xla_cpu_use_fusion_emitters=false"
        else:
            os.environ["TREEJAX_TEST_NO_LEGACY_EMITTER"] = "1"
    os.environ["XLA_FLAGS"] = _flags
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# runs started by tests do not write into the user's compilation cache (~/.cache/treejax/jax); the cache itself is
# tested with temporary folders (tests/test_compile_cache.py)
os.environ.setdefault("TREEJAX_COMPILATION_CACHE", "off")
# Opt-in (TREEJAX_TEST_XLA_CACHE=1): one persistent XLA cache for the whole CPU session, in a fresh folder that the
# first process (pytest, or xdist's controller) makes and deletes at exit; xdist's workers and the processes tests
# start inherit it through JAX's own variables, so every repeated program after the first is loaded, not compiled
# (the default run took 1,350 s with it instead of 1,631 s). Off by default: in two full runs on 2 cores a worker
# died inside XLA's executable serialization while writing to it (SIGSEGV / SIGABRT in
# compilation_cache.put_executable_and_time; tests/sampling/test_tree.py and tests/test_checkpoint.py, each passing
# alone), and a crashed worker fails the run. Those crashes came late in long-lived workers, as did the later ones
# without the cache that pytest_runtest_teardown below traces to vm.max_map_count, so they were probably the same
# cause. Re-run once with that fix (a fresh clone, 2 cores): no worker lost, but the two-process loop
# (tests/parallel/test_multiprocess.py::test_two_processes_train_like_one[expanded], both processes reading and
# writing the shared cache) hung in its second step until the launcher's 900 s timeout, so it stays opt-in. A test
# about the cache itself pops these variables.
if TEST_DEVICE == "cpu" and "JAX_COMPILATION_CACHE_DIR" not in os.environ and \
        os.environ.get("TREEJAX_TEST_XLA_CACHE") == "1":
    import atexit
    import shutil
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = _SESSION_CACHE = tempfile.mkdtemp(prefix="treejax-tests-xla-")
    atexit.register(shutil.rmtree, _SESSION_CACHE, True)
if TEST_DEVICE == "cpu" and os.environ.get("TREEJAX_TEST_XLA_CACHE") == "1":
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
ON_GPU = os.environ.get("JAX_PLATFORMS") != "cpu" and jax.default_backend() == "gpu"
if ON_GPU:  # for the whole session, module-scoped fixtures included (module docstring)
    jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """GPU-only tests are skipped where no GPU is present, ``devices(n)`` tests where fewer devices are."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (TREEJAX_TEST_DEVICE=gpu)")
    for item in items:
        if "gpu" in item.keywords and not ON_GPU:
            item.add_marker(skip_gpu)
        for mark in item.iter_markers("devices"):
            if jax.device_count() < mark.args[0]:
                item.add_marker(pytest.mark.skip(reason=f"needs {mark.args[0]} devices, {jax.device_count()} here"))


def pytest_runtest_teardown(item, nextitem):
    """After a test module's last test in this process, drop JAX's compiled programs (``jax.clear_caches()``) and
    collect: XLA:CPU maps each compiled executable's code into its own memory regions, and a worker that keeps every
    program of ~650 tests passes Linux's default ``vm.max_map_count`` (65,530), after which the next compile dies
    with a segmentation fault inside XLA (both workers of a full run, and CI, lost their last tests this way:
    "node down" in tests/test_sft.py and tests/test_train_cli.py). Measured on tests/rl/test_update.py then
    tests/sampling/test_decode.py in one process: 2,501 and 5,850 mapped regions without this, 659 and 1,142 with
    it. A later module that runs a program again compiles it again; a module's own fixtures and programs are kept."""
    if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
        import gc

        jax.clear_caches()
        gc.collect()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer, exported as an HF folder (for runs of the whole loop)."""
    from treejax.models import presets, transformer
    from treejax.models.export import export_hf
    from treejax.models.registry import embedded_model_path
    from treejax.models.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(embedded_model_path("smollm2-135m-instruct"))
    cfg = presets.tiny_config("smollm2-135m", vocab_size=49152, eos_token_ids=tuple(tok.eos_ids), pad_token_id=2)
    params = transformer.init_params(cfg, jax.random.key(0))
    folder = str(tmp_path_factory.mktemp("tiny_hf"))
    export_hf(params, cfg, folder, tok)
    return folder
