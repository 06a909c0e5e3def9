"""The persistent compilation cache (issue 24): on by default in the user's cache folder, off by gin or env."""

import os
import subprocess
import sys

from treejax.compile_cache import default_cache_dir, resolve_cache_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_where_the_cache_goes(monkeypatch, tmp_path):
    monkeypatch.delenv("TREEJAX_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "treejax" / "jax")
    assert resolve_cache_dir("auto") == default_cache_dir()  # on by default
    assert resolve_cache_dir("off") is None
    assert resolve_cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax_own"))
    assert resolve_cache_dir("auto") is None  # JAX's own variable: left to JAX
    monkeypatch.setenv("TREEJAX_COMPILATION_CACHE", "off")
    assert resolve_cache_dir("auto") is None
    monkeypatch.setenv("TREEJAX_COMPILATION_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir("off") == str(tmp_path / "env")  # the environment wins


def test_run_config_switch_parses():
    from treejax import train

    assert train.parse([], []).compilation_cache == "auto"
    assert train.parse([], ["RunConfig.compilation_cache='off'"]).compilation_cache == "off"


def test_a_compiled_program_lands_in_the_cache(tmp_path):
    """A fresh process with the cache enabled writes the executable of a jitted function into the folder."""
    code = ("import jax, jax.numpy as jnp\n"
            "from treejax.compile_cache import enable_compilation_cache\n"
            "print(enable_compilation_cache('auto'))\n"
            "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
            "jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((64, 64))).block_until_ready()\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XDG_CACHE_HOME=str(tmp_path / "xdg"),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TREEJAX_COMPILATION_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    folder = tmp_path / "xdg" / "treejax" / "jax"
    assert out.stdout.strip() == str(folder)
    assert os.listdir(folder), "nothing was cached"
