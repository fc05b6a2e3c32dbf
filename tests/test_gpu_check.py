"""The GPU check's CPU dry run (``benchmarks/gpu_check.sh --dry-run``) and its wheel folder
(``benchmarks/gpu_wheels.py``): the folder is built from the installed distributions, installs with no index
into a venv that holds only the GPU image's packages, and every step of the script runs there (the GPU tests
skip without CUDA, the throughput benchmark runs tiny on the CPU); a folder missing a needed wheel fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, load_benchmark

WHEELS = load_benchmark("gpu_wheels")
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"


def _dry_run(out, wheels, *flags) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "WHEELS": str(wheels)}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run", *flags, str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A wheel folder for this interpreter, built as the README says (plus ``--python`` and ``--out``)."""
    out = tmp_path_factory.mktemp("gpu") / "wheels"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_wheels.py"), "--python", HERE, "--out",
                        str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def test_the_folder_holds_the_wheels_and_the_model_within_the_carry_limit(folder):
    """Every bundled distribution has a wheel and a pinned line; the 2-layer GGUF is there; folder plus the
    repository's tracked files fit the 64 MiB a device call carries."""
    m = json.loads((folder / "manifest.json").read_text())
    reqs = (folder / "requirements.txt").read_text().split()
    assert {r.split("==")[0] for r in reqs} == {WHEELS.canonical(n) for n in WHEELS.BUNDLED}
    assert len(m["wheels"]) == len(WHEELS.BUNDLED) and all((folder / w).is_file() for w in m["wheels"])
    assert (folder / WHEELS.MODEL_FILE).stat().st_size < 30 * 2**20
    assert m["missing"] == [] and m["closure_gaps"] == []
    assert m["carry_bytes"] < WHEELS.CARRY_LIMIT


def test_closure_check_names_a_requirement_the_folder_and_image_lack(monkeypatch):
    """Leaving antlr4 (math-verify's parser runtime, absent from the GPU image) out of the bundle is caught."""
    assert WHEELS.check_closure([HERE]) == []
    monkeypatch.delitem(WHEELS.BUNDLED, "antlr4-python3-runtime")
    gaps = WHEELS.check_closure([HERE])
    assert len(gaps) == 1 and gaps[0].startswith("latex2sympy2-extended needs antlr4-python3-runtime")


def test_dry_run_installs_from_the_folder_alone_and_runs_every_step(folder, tmp_path):
    """The whole script in a stand-in for the GPU image: install from the folder (no index), imports, the GPU
    tests (collected, skipped for want of CUDA, each with its reason), the throughput benchmark's figures, and
    the steps that need Ray or vLLM listed as skipped with their reason."""
    r = _dry_run(tmp_path / "out", folder)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["dry_run"] and report["install"]["rc"] == 0 and report["imports"]["rc"] == 0
    v = report["versions"]
    assert v["ray"] is None and v["vllm"] is None and v["pydantic"] and v["gguf"] and v["math-verify"]
    tests = report["gpu_tests"]
    names = {c["test"].split("::")[1] for c in tests["cases"]}
    assert {"test_trainer_step_runs_under_bf16_autocast_on_the_gpu",
            "test_lora_trains_on_the_gpu_and_reaches_the_searcher",
            "test_trainer_mfu_and_engine_tokens_per_s_against_the_gpus_bf16_peak"} <= names
    assert tests["skipped"] == len(tests["cases"]) and tests["failed"] == tests["error"] == 0
    assert all("CUDA" in c["reason"] for c in tests["cases"])
    thr = report["throughput"]["results"]
    assert thr["device"].startswith("cpu") and thr["trainer"]["shared"]["mfu"] > 0
    assert {g["mode"] for g in thr["generation"]} == {"forced", "natural", "continuous"}
    assert all(g["engine_tokens_per_s"] > 0 and g["generate_tokens_per_s"] > 0 for g in thr["generation"])
    reasons = " ".join(s["reason"] for s in report["skipped_steps"])
    assert "Ray" in reasons and "vLLM" in reasons


def test_dry_run_fails_when_the_folder_misses_a_needed_wheel(folder, tmp_path):
    """The same folder without gguf (transformers' GGUF loader, absent from the GPU image): the install alone
    succeeds, the import check fails, and the report says which module is missing."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in folder.iterdir():
        if not f.name.startswith("gguf-"):
            (broken / f.name).symlink_to(f)
    (broken / "requirements.txt").unlink()
    reqs = (folder / "requirements.txt").read_text().splitlines()
    (broken / "requirements.txt").write_text("\n".join(r for r in reqs if not r.startswith("gguf==")) + "\n")
    r = _dry_run(tmp_path / "out", broken, "--install-only")
    assert r.returncode != 0
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["install"]["rc"] == 0 and report["imports"]["rc"] != 0
    assert "No module named 'gguf'" in report["imports"]["last_line"]
