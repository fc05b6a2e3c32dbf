#!/usr/bin/env bash
# The GPU check, for a bare CUDA machine: CUDA torch, transformers, peft and pytest preinstalled, no package
# index, and only the repository plus the wheel folder carried along (benchmarks/gpu_wheels/, built here by
# `python benchmarks/gpu_wheels.py`; see benchmarks/README.md, "GPU check"). Ray and vLLM cannot travel (their
# wheels exceed the 64 MiB carry), so what needs them is skipped, each with its reason. Steps, each recorded even
# when an earlier one failed, in under 8 minutes on one H200 (timeouts: tests 300 s, benchmark 150 s):
#   1. install the folder's wheels into a fresh target folder (pip --no-index --no-deps --find-links: the folder
#      only, pip's config ignored), put it and src/ on PYTHONPATH; the preinstalled CUDA torch is used;
#   2. the GPU-marked tests (every tests/test_*.py holding a `pytest.mark.gpu`) on the folder's 2-layer SmolLM2
#      (TBA_TEST_MODEL): a trainer step under bf16 autocast, the hf engine generating, LoRA, packing GPU tensors,
#      the trainer's MFU and the engine's tokens/s, the data-parallel trainer with N = 1 on NCCL; the Ray/vLLM
#      ones skip with their reason;
#   3. the throughput benchmark without Ray or vLLM: the bf16 matmul peak, tba's engine vs model.generate
#      (tokens/s), the trainer's MFU against the peak.
# All figures, versions, per-test outcomes and skip reasons go to ONE file, OUT_DIR/gpu_check.json (beside it, 6
# more: install.log, gpu_tests.log/.xml, throughput.log/.json/.md; a device call returns at most 8 files).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]            # on the GPU machine; default OUT_DIR benchmarks/results/gpu
#   bash benchmarks/gpu_check.sh --dry-run [OUT_DIR]  # here, on a CPU: the same steps in a venv that holds only
#                                                     # the GPU image's packages (gpu_wheels.py --sim-env); the GPU
#                                                     # tests skip, the benchmark runs tiny on the CPU
# Environment: PYTHON (default python3; in a dry run, the stand-in venv's), WHEELS (default benchmarks/gpu_wheels).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0 install_only=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1; shift ;;
        --install-only) install_only=1; shift ;;  # steps 1 and 1b only (the CI test's check of a broken folder)
        *) break ;;
    esac
done
out=${1:-benchmarks/results/gpu}
wheels=${WHEELS:-benchmarks/gpu_wheels}
mkdir -p "$out"
out=$(cd "$out" && pwd)
wheels=$(cd "$wheels" 2>/dev/null && pwd) || { echo "error: no wheel folder ${WHEELS:-benchmarks/gpu_wheels}" \
    "(build it: python benchmarks/gpu_wheels.py)" >&2; exit 2; }
start=$(date +%s)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tba-gpu-check.XXXXXX")
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # never an index, only the folder

if [ $dry = 1 ]; then
    py=$("${PYTHON:-python3}" benchmarks/gpu_wheels.py --sim-env "$tmp/image") || exit 2
else
    py=${PYTHON:-python3}
fi
model="$wheels/$(sed -n 's/.*"model": "\(.*\)".*/\1/p' "$wheels/manifest.json")"

# 1. install from the folder only
"$py" -m pip install -q --no-index --no-deps --no-compile --find-links "$wheels" --target "$tmp/site" \
    -r "$wheels/requirements.txt" > "$out/install.log" 2>&1
install_rc=$?
export PYTHONPATH="$tmp/site:$PWD/src" TBA_TEST_MODEL="$model" TBA_CACHE="$tmp/cache"

# 1b. what the tests and the benchmark import, the lazy imports too (the GPU tests skip on a CPU, so a dry run
#     learns of a missing wheel here): tba's modules, the GGUF loader, math-verify's parse and verify
"$py" - > "$out/imports.log" 2>&1 <<'EOF'
import importlib
for name in ("tba.config", "tba.runtime.build", "tba.adapters", "tba.engines.hf", "tba.tasks.gsm8k", "tba.weights",
             "peft", "gguf"):
    importlib.import_module(name)
from math_verify import parse, verify
assert verify(parse("$\\frac{1}{2}$"), parse("0.5"))
print("imports ok")
EOF
imports_rc=$?
tests_rc=0 throughput_rc=0
if [ $install_only = 0 ]; then

# 2. the GPU-marked tests
tests=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
timeout 300 "$py" -m pytest -q -rs -m gpu -p no:cacheprovider $tests --junitxml "$out/gpu_tests.xml" \
    > "$out/gpu_tests.log" 2>&1
tests_rc=$?

# 3. throughput without Ray or vLLM: the folder's 2-layer model, gsm8k prompts from the repository's sample
common=(--config configs/gsm8k.yaml --set "model.policy=$model" --set task.source=tests/data/gsm8k
        --set trainer.prompts_per_step=4 --set trainer.group_size=8 --set trainer.micro_batch_size=32
        --engines engine generate --skip publish --out "$out/throughput.md")
if [ $dry = 1 ]; then
    sizes=(--device cpu --threads 1 --batch-sizes 4 --max-new-tokens 4 --repeats 1 --refill-batches 1
           --train-steps 1 --matmul-n 256 --matmul-repeats 1)
else
    sizes=(--device cuda --batch-sizes 32 128 --max-new-tokens 64 --repeats 3 --train-steps 5 --matmul-n 8192)
fi
timeout 150 "$py" benchmarks/throughput.py "${common[@]}" "${sizes[@]}" > "$out/throughput.log" 2>&1
throughput_rc=$?
fi

"$py" - "$out" "$wheels" "$dry" "$install_only" "$install_rc" "$imports_rc" "$tests_rc" "$throughput_rc" "$start" \
    <<'EOF'
import json, platform, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, wheels = Path(sys.argv[1]), Path(sys.argv[2])
dry, install_only, install_rc, imports_rc, tests_rc, thr_rc, start = map(int, sys.argv[3:])


def versions():
    """Installed version of each distribution the check uses or skips (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for name in ("torch", "transformers", "peft", "pytest", "pydantic", "gguf", "math-verify", "ray", "vllm"):
        try:
            got[name] = version(name)
        except PackageNotFoundError:
            got[name] = None
    return got


def test_cases(path):
    """Per test: outcome and, for a skip or failure, its message (pytest's JUnit XML)."""
    if not path.is_file():
        return None
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, msg = "passed", None
        for tag in ("skipped", "failure", "error"):
            el = case.find(tag)
            if el is not None:
                outcome, msg = tag if tag != "failure" else "failed", (el.get("message") or "")[:500]
        cases.append({"test": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), **({"reason": msg} if msg else {})})
    return cases


def throughput(path):
    """The benchmark's figures that answer the check: bf16 peak, trainer MFU, engine and generate tokens/s."""
    if not path.is_file():
        return None
    r = json.loads(path.read_text())
    t = r.get("trainer") or {}
    return {"bf16_peak_flops_per_s": r["peak"]["bf16"]["flops_per_s"], "fp32_peak_flops_per_s": r["peak"]["fp32"]["flops_per_s"],
            "model_params": r["meta"]["params"], "device": r["meta"]["device"],
            "trainer": {k: {"mfu": t[k]["mfu"], "step_s": t[k]["step_s"], "tokens_per_s": t[k]["tokens_per_s"]}
                        for k in ("shared", "full") if k in t} | ({"batch": t["batch"]} if t else {}),
            "generation": [{k: g.get(k) for k in ("batch", "mode", "max_new_tokens", "engine_tokens_per_s",
                                                   "generate_tokens_per_s", "speedup", "engine_frac_peak")}
                           for g in r.get("generation", [])],
            "raw": str(path)}


cases = test_cases(out / "gpu_tests.xml")
v = versions()
skipped_steps = [
    {"step": "quickstart run with vLLM searchers (tba train ... --searcher.engine vllm)",
     "reason": "needs Ray and vLLM: their wheels (79 MB, and far larger) exceed the 64 MiB a device call carries"},
    {"step": "throughput section d (weight publication over Ray)", "reason": "needs Ray (not installed)"}
    if not v["ray"] else None,
    {"step": "throughput: vLLM tokens/s", "reason": "needs vLLM (not installed)"} if not v["vllm"] else None,
    {"step": "the full 30-layer SmolLM2", "reason": "its GGUF is 98 MB; the folder carries the first 2 layers"},
]
if dry:
    skipped_steps.append({"step": "every GPU test and CUDA figure", "reason": "dry run on a CPU (no CUDA)"})
if install_only:
    skipped_steps.append({"step": "GPU tests and throughput", "reason": "--install-only"})


def last_line(path):
    lines = path.read_text().strip().splitlines() if path.is_file() else []
    return lines[-1] if lines else None


def nvidia_smi():
    """nvidia-smi's name, memory and driver of each GPU, or None where it is absent."""
    import subprocess

    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def cuda_device():
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"{type(e).__name__}: {e}"


report = {
    "dry_run": bool(dry),
    "gpu": nvidia_smi(),
    "cuda_device": cuda_device(),
    "python": platform.python_version(), "versions": v,
    "install": {"rc": install_rc, "folder": str(wheels),
                "wheels": json.loads((wheels / "manifest.json").read_text())["wheels"],
                **({"error": last_line(out / "install.log")} if install_rc else {})},
    "imports": {"rc": imports_rc, "last_line": last_line(out / "imports.log")},
    "gpu_tests": {"rc": tests_rc, **({k: sum(c["outcome"] == k for c in cases)
                                     for k in ("passed", "failed", "error", "skipped")} if cases else {}),
                  "cases": cases},
    "throughput": {"rc": thr_rc, "results": throughput(out / "throughput.json")},
    "skipped_steps": [s for s in skipped_steps if s],
    "wall_s": round(time.time() - start),
}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
brief = {k: report[k] for k in ("gpu", "python", "install", "wall_s")}
brief["install"] = {"rc": install_rc}
brief["imports_rc"] = imports_rc
brief["gpu_tests"] = {k: v for k, v in report["gpu_tests"].items() if k != "cases"}
brief["throughput_rc"] = thr_rc
print(json.dumps(brief))
EOF
report_rc=$?
cat "$out/imports.log" >> "$out/install.log" && rm -f "$out/imports.log"  # at most 8 files come back from a device
rm -rf "$tmp"
exit $(( install_rc || imports_rc || tests_rc || throughput_rc || report_rc ))
