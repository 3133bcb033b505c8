"""Shared fixtures: tiny random checkpoints written by tools/make_tiny_model.py (cached per session)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from numba.core.dispatcher import Dispatcher

REPO = Path(__file__).resolve().parents[1]


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make_tiny = _load_tool("make_tiny_model")


def _compile_each_kernel_once_across_workers() -> None:
    """The test workers (pytest -n) share numba's on-disk cache but take no lock on it: two that need
    the same kernel at once both compile it (a large kernel: half a minute each). Here a top-level
    compile holds a file lock named after the function, so the second waits and then loads the
    first's result from the cache. Compiles nested in another (a kernel's callees) take no lock, so a
    thread holds one lock at most and none can wait on another in a cycle."""
    locks = Path(tempfile.gettempdir()) / f"edgemoe-test-compile-locks-{os.getuid()}"
    locks.mkdir(exist_ok=True)
    compile_unlocked = Dispatcher.compile
    nested = threading.local()

    def compile_locked(self, sig):
        if getattr(nested, "depth", 0):
            return compile_unlocked(self, sig)
        name = f"{self.py_func.__module__}.{self.py_func.__qualname__}"
        with open(locks / name, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            nested.depth = 1
            try:
                return compile_unlocked(self, sig)
            finally:
                nested.depth = 0

    Dispatcher.compile = compile_locked


_compile_each_kernel_once_across_workers()

# The VRAM tier's device: the CPU stands in for a GPU everywhere, and where torch sees a CUDA GPU the same
# tests run on it too (tools/bench_device.py runs them on a GPU machine).
VRAM_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=VRAM_DEVICES)
def vram_device(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def bundled_int4_store(tmp_path_factory) -> Path:
    """The bundled model converted at 4 bits (made once per session; tests only read it)."""
    from edgemoe.bundled import bundled_model_path
    from edgemoe.convert import convert

    store = tmp_path_factory.mktemp("bundled") / "int4"
    convert(bundled_model_path(), store, bits=4)
    return store


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(arch, **config_overrides) -> checkpoint directory (built once per distinct call)."""
    made: dict[str, Path] = {}

    def build(arch: str = "mixtral", fused_experts: bool = False, shards: int = 1, dtype: str = "float32",
              seed: int = 0, mxfp4: bool = False, **overrides) -> Path:
        key = json.dumps([arch, fused_experts, shards, dtype, seed, mxfp4, overrides], sort_keys=True)
        if key not in made:
            out = tmp_path_factory.mktemp(arch)
            made[key] = make_tiny.make_tiny_model(out, arch, seed=seed, dtype=dtype, fused_experts=fused_experts,
                                                  shards=shards, mxfp4=mxfp4, **overrides)
        return made[key]

    return build


@pytest.fixture(scope="session", autouse=True)
def private_latency_cache(tmp_path_factory):
    """Latency calibrations go to a per-session directory, not the user's cache."""
    import os
    os.environ["EDGEMOE_CACHE_DIR"] = str(tmp_path_factory.mktemp("edgemoe-cache"))


@pytest.fixture(scope="session", autouse=True)
def one_thread_for_automatic_counts():
    """Models loaded in a test without a thread count run on one thread. The automatic count follows
    the machine's load (edgemoe.threads), and torch's products round by thread count, so two loads
    compared bit for bit could otherwise run at different counts while the suite itself loads the
    machine. The kernels' own results do not depend on the count (tests/test_int_kernels.py), and
    tests that set a count keep it."""
    import edgemoe.threads

    patch = pytest.MonkeyPatch()
    patch.setattr(edgemoe.threads, "physical_cores", lambda: 1)
    yield
    patch.undo()
