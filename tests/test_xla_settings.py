"""The project's XLA flags per backend: the CPU compiler flags only where the backend is the
CPU (a GPU build of jaxlib exits on a ``--xla_cpu_*`` flag it does not know), decided before any
backend starts; a user's ``XLA_FLAGS`` wins. The GPU case is simulated by the functions' inputs
(and, in a subprocess, by ``JAX_PLATFORMS``), so every test runs on a CPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from svflow_jax.xla_settings import (
    QUICK_FLAGS,
    accelerator_plugins,
    expected_platform,
    project_flags,
    use_project_flags,
)


@pytest.mark.parametrize(("platforms", "plugins", "expected"), [
    ("cpu", ("jax_cuda13_plugin",), "cpu"),  # JAX_PLATFORMS decides, plugins or not
    ("cuda", (), "accelerator"),
    ("cuda,cpu", (), "accelerator"),  # the first entry is the one JAX tries first
    ("cpu,cuda", (), "cpu"),
    (" GPU ", (), "accelerator"),
    ("tpu", (), "accelerator"),
    ("", ("jax_cuda13_plugin",), "accelerator"),  # unset: an installed plugin is preferred
    ("", ("libtpu",), "accelerator"),
    ("", (), "cpu"),
])
def test_expected_platform_rule(platforms, plugins, expected):
    assert expected_platform(platforms, plugins) == expected


def test_quick_flags_only_on_the_cpu():
    assert project_flags(quick=True, platform="cpu") == QUICK_FLAGS
    assert "--xla_cpu_use_fusion_emitters=false" in QUICK_FLAGS
    assert project_flags(quick=True, platform="accelerator") == ""
    assert project_flags(quick=False, platform="cpu") == ""
    assert project_flags(quick=False, platform="accelerator") == ""
    with pytest.raises(ValueError, match="platform must be 'cpu' or 'accelerator'"):
        project_flags(quick=True, platform="cuda")


def test_use_project_flags_per_backend_and_the_users_flags_win(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert use_project_flags(quick=True, platform="accelerator") == ""
    assert "XLA_FLAGS" not in os.environ
    assert use_project_flags(quick=True, platform="cpu") == QUICK_FLAGS == os.environ["XLA_FLAGS"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    assert use_project_flags(quick=True, platform="cpu") == "--xla_gpu_autotune_level=0"


def test_plugins_found_without_importing_them(tmp_path, monkeypatch):
    """A module of the ``jax_plugins`` namespace package (how jax_cuda13_plugin installs) is
    found, and not imported (importing it would register the plugin)."""
    package = tmp_path / "jax_plugins" / "fake_cuda_plugin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')\n")
    assert "fake_cuda_plugin" not in accelerator_plugins()
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "fake_cuda_plugin" in accelerator_plugins()
    assert expected_platform("", accelerator_plugins()) == "accelerator"
    assert "jax_plugins.fake_cuda_plugin" not in sys.modules


def test_jax_platforms_cuda_sets_no_flag_and_starts_no_backend():
    """In a fresh process with ``JAX_PLATFORMS=cuda`` (no GPU needed: nothing is computed) the
    quick run's flags stay unset, and deciding starts no backend."""
    code = ("from svflow_jax.xla_settings import use_project_flags\n"
            "flags = use_project_flags(quick=True)\n"
            "from jax._src import xla_bridge\n"
            "print(repr(flags), xla_bridge.backends_are_initialized())\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for platforms, expected in (("cuda", "'' False"), ("cpu", f"{QUICK_FLAGS!r} False")):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env={**env, "JAX_PLATFORMS": platforms}, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == expected


def test_the_tests_own_process_uses_the_compilation_cache():
    """conftest.py names a persistent compilation cache for the whole suite; jax reads its
    variables once, when it is imported, which may come first (a plugin, ``expected_platform``),
    so conftest also sets the options: a program compiled here lands in that folder. The
    ``svflow`` commands the tests start open the same folder (``$SVFLOW_CACHE_DIR``), not the
    user's own cache."""
    import jax
    import jax.numpy as jnp

    from svflow_jax.xla_settings import default_cache_dir

    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if not folder:
        pytest.skip("the compilation cache is turned off (SVFLOW_TEST_JAX_CACHE is empty)")
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        pytest.skip("a JAX_COMPILATION_CACHE_DIR of the user's own, under jax's thresholds, "
                    "which keep no program as quick to compile as this one")
    assert jax.config.jax_compilation_cache_dir == folder
    assert str(default_cache_dir()) == folder
    assert jax.config.jax_persistent_cache_min_compile_time_secs == float(
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"])

    def cache_probe(x):
        return x * 7.25 + 1.0

    jax.jit(cache_probe)(jnp.arange(3.0)).block_until_ready()
    assert list(Path(folder).glob("jit_cache_probe-*-cache"))
