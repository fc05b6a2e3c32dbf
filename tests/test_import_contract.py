"""The import contract of docs/architecture.md ("Which module may import which"), checked on the source.

A stdlib ``ast`` walk over every ``import`` in ``src/tba``: top-level, inside functions (lazy imports) and
relative ones. Dynamic imports (``importlib.import_module``, the task table in ``tba.tasks``) are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

L1 = ("tba.types", "tba.config")
L2 = ("tba.losses", "tba.buffer", "tba.rewards", "tba.engines", "tba.models", "tba.scoring", "tba.placement",
      "tba.weights", "tba.adapters", "tba.parallel")
L3 = ("tba.tasks", "tba.checkpoint", "tba.logger")
L4 = ("tba.searcher", "tba.trainer")
PURE_RUNTIME = ("tba.runtime.cadence", "tba.runtime.state", "tba.runtime.exchange")
# importer (a module, or a package and all its modules) -> the tba modules it may import, besides its own
# package's; the one importer not listed, the package's __init__ (its lazy re-exports), may import any
MAY_IMPORT = {
    **dict.fromkeys(L1, ()),  # rule 1: types and config import nothing from the package
    **dict.fromkeys(L2, L1),  # rule 2: only types and config ...
    # ... engines what an engine's load_weights unpacks, and the scoring an engine's score runs
    "tba.engines": L1 + ("tba.weights", "tba.adapters", "tba.scoring"),
    "tba.adapters": L1 + ("tba.weights",),  # ... and adapters the packing they extend
    "tba.tasks": L1 + L2,  # rule 3: tasks build on layer 2; checkpoint and logger import nothing
    "tba.checkpoint": (), "tba.logger": (),
    "tba.searcher": L1 + L2 + L3,  # rule 4: layers 1-3, never each other
    "tba.trainer": L1 + L2 + L3,
    # rule 5: no Ray, and so no runtime module that imports it
    **dict.fromkeys(PURE_RUNTIME, L1 + L2 + L3 + L4 + PURE_RUNTIME),
    "tba.runtime": L1 + L2 + L3 + L4,  # rule 6: runtime/ never imports the API or the CLI above it ...
    "tba.api": L1 + L2 + L3 + L4 + ("tba.runtime",),  # ... the API calls into runtime/ ...
    "tba.cli": L1 + L2 + L3 + L4 + PURE_RUNTIME + ("tba.api",),  # ... and the CLI runs through the API only
}
# third-party package -> (the importers allowed, except these): rules 2 and 5
ONLY_IN = {"vllm": (("tba.engines.vllm",), ()), "ray": (("tba.runtime",), PURE_RUNTIME)}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _imports(tree: ast.AST, module: str, is_pkg: bool):
    """(line, dotted name) of every import in ``tree``, at any depth; relative ones resolved."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = module.split(".")
            base = parts[: len(parts) - node.level + is_pkg] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            if name == module.split(".")[0]:  # from tba import x: the module tba.x
                yield from ((node.lineno, f"{name}.{a.name}") for a in node.names)
            else:
                yield node.lineno, name


def violations(src: Path) -> list[str]:
    """Every import under ``src/tba`` that breaks a rule, as 'path:line: importer imports name'."""
    out: list[tuple[str, int, str]] = []
    for path in sorted((src / "tba").rglob("*.py")):
        rel = path.relative_to(src)
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        key = next((k for k in sorted(MAY_IMPORT, key=len, reverse=True) if _within(module, [k])), None)
        for line, name in _imports(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            top, bad = name.split(".")[0], False
            if top == "tba":
                bad = key is not None and name != "tba" and not _within(name, (key, *MAY_IMPORT[key]))
            elif top in ONLY_IN:
                allowed, excluded = ONLY_IN[top]
                bad = not _within(module, allowed) or _within(module, excluded)
            if bad:
                out.append((rel.as_posix(), line, f"{module} imports {name}"))
    return [f"{path}:{line}: {what}" for path, line, what in sorted(out)]


def test_source_keeps_the_import_contract():
    assert violations(SRC) == []


def test_planted_violations_are_reported_with_file_and_line(tmp_path):
    planted = {
        "losses.py": "import torch\nfrom tba.config import LossConfig\n\n\ndef f():\n    from tba.trainer import T\n",
        "buffer.py": "from . import searcher\nfrom .types import Sample\n",
        "engines/hf.py": "from tba.engines.base import Generation\nfrom ..weights import pack\nimport ray\n",
        "rewards/math.py": "from tba.rewards.diversity import d\nfrom tba import weights\n",
        "models.py": "import vllm.inputs\n",
        "scoring.py": "import torch\nfrom tba.types import Sample\nfrom tba.models import load_causal_lm\n",
        "runtime/cadence.py": "from tba.config import Config\nfrom tba.runtime.driver import RayRuntime\n",
        "runtime/state.py": "def f():\n    import ray\n",
        "runtime/actors.py": "import ray\nfrom tba.trainer import Trainer\n",
        "trainer.py": "from tba.searcher import Searcher\n",
        "runtime/driver.py": "import ray\nfrom tba.trainer import Trainer\nfrom tba.api import train\n",
        "api.py": "from tba.runtime import RayRuntime\nfrom tba.cli import main\n",
        "cli.py": "from tba.api import train\nfrom tba.runtime.cadence import NoSamples\n"
                  "from tba.runtime import RayRuntime\n",
        "__init__.py": "def __getattr__(name):\n    from tba.api import train\n",
    }
    for name, text in planted.items():
        (tmp_path / "tba" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tba" / name).write_text(text)
    assert violations(tmp_path) == [
        "tba/api.py:2: tba.api imports tba.cli",
        "tba/buffer.py:1: tba.buffer imports tba.searcher",
        "tba/cli.py:3: tba.cli imports tba.runtime",
        "tba/engines/hf.py:3: tba.engines.hf imports ray",
        "tba/losses.py:6: tba.losses imports tba.trainer",
        "tba/models.py:1: tba.models imports vllm.inputs",
        "tba/rewards/math.py:2: tba.rewards.math imports tba.weights",
        "tba/runtime/cadence.py:2: tba.runtime.cadence imports tba.runtime.driver",
        "tba/runtime/driver.py:3: tba.runtime.driver imports tba.api",
        "tba/runtime/state.py:2: tba.runtime.state imports ray",
        "tba/scoring.py:3: tba.scoring imports tba.models",
        "tba/trainer.py:1: tba.trainer imports tba.searcher",
    ]
