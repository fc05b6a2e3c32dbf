"""The docs site against the code: every metric key the code logs is in docs/metrics.md (and nothing else is),
the configuration reference lists every field of ``tba train --help`` with the same default, and the README's
test command is the one .ci/run runs.

Metric keys are collected the way a run makes them, in one process without Ray (as tests/test_reference_loop.py
builds the pieces): a real searcher batch and trainer step on the 2-layer SmolLM2, the buffer's batch and
gauges, the buffer actor's searcher counters, every objective of ``tba.losses.LOSSES`` on hand-made inputs,
and the evals of reasoning-gym (greedy accuracy) and known_optimum (exact); plus a static scan of the string
literals in src/tba for keys the driver adds, and the keys of the dicts the red-teaming and summarisation
evals return (their scorers are models of the extras, so they are read, not run).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PREFIXES = ("loss", "train", "buffer", "searcher", "perf", "eval", "sync")
KEY = re.compile(rf"(?:{'|'.join(PREFIXES)})/[\w<>]+")


def _hooks():
    """docs/hooks.py (the mkdocs hooks) as a module."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _eval_keys(result: dict) -> set[str]:
    """The keys the driver logs for a task's eval result (numbers only), one per-prompt family as ``<i>``."""
    return {re.sub(r"_\d+$", "_<i>", f"eval/{k}") for k, v in result.items() if isinstance(v, (int, float))}


def _returned_dict_keys(path: Path, function: str) -> set[str]:
    """String keys of the dict literals that ``function`` (a method or function in ``path``) returns."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Dict):
                    keys |= {k.value for k in ret.value.keys if isinstance(k, ast.Constant)}
    assert keys, f"{path.name}: {function} returns no dict literal"
    return keys


def static_keys() -> set[str]:
    """Every string literal in src/tba that is a whole metric key (f-string templates such as ``loss/{name}``
    are not: their keys come from running the code)."""
    keys = set()
    for path in (ROOT / "src" / "tba").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY.fullmatch(node.value):
                keys.add(node.value)
    return keys


def loss_keys() -> set[str]:
    """The metrics of every objective on B=2 x K=2 hand-made responses (a tied group too, for online DPO)."""
    from tba.config import LossConfig
    from tba.losses import LOSSES, LossInputs

    def inputs(reward):
        logp = torch.tensor([[-1.0, -2.0], [-0.5, -1.0], [-1.5, -0.2], [-0.7, -0.9]], requires_grad=True)
        return LossInputs(logp=logp, ref_logp=logp.detach() - 0.1, behaviour_logp=logp.detach() + 0.05,
                          mask=torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]]),
                          reward=torch.tensor(reward), group_size=2, beta=0.5)

    keys = set()
    for fn in LOSSES.values():
        for hp in (LossConfig(), LossConfig(is_cap=2.0)):
            for reward in ([1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]):
                keys |= set(fn(inputs(reward), hp)[1])
    return keys


@pytest.fixture(scope="module")
def run_keys(model_path, tmp_path_factory) -> dict[str, set[str]]:
    """Keys of one real searcher batch -> buffer -> trainer step, and of the two evals that run cheaply."""
    from tba.buffer import ReplayBuffer
    from tba.config import Config, load_config
    from tba.models import load_causal_lm, load_tokenizer
    from tba.runtime.build import build_searcher, build_trainer
    from tba.runtime.exchange import SearcherMetrics
    from tba.tasks import build_task

    cfg = Config.model_validate({
        "model": {"num_hidden_layers": 2, "dtype": "float32", "device": "cpu"},
        "task": {"options": {"min_terms": 2, "max_terms": 2, "max_digits": 1}, "train_size": 2, "eval_size": 2},
        "searcher": {"prompts_per_batch": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
        "trainer": {"prompts_per_step": 2, "group_size": 2}, "buffer": {"min_fill": 1}})
    searcher = build_searcher(cfg, model_path, model_path, searcher_id=0)
    trainer, _ = build_trainer(cfg, model_path)
    buffer, counters = ReplayBuffer(cfg.buffer, cfg.run.seed), SearcherMetrics()
    samples, searcher_metrics = searcher.step()
    buffer.add(samples)
    counters.add(len(samples), searcher_metrics, searcher.searcher_id, searcher.version)  # BufferActor.add
    buffer.sync(0)
    step = trainer.step(buffer.sample(cfg.trainer.prompts_per_step, cfg.trainer.group_size, step=0))
    stats = {**buffer.stats(), **counters.summary(True)}  # BufferActor.stats, logged with every step
    greedy = searcher.task.evaluate(searcher.engine, searcher.tokenizer, 2, 4)

    ko_cfg = load_config(ROOT / "configs" / "known_optimum.yaml",
                         {"model.cache_dir": str(tmp_path_factory.mktemp("ko"))})
    task = build_task(ko_cfg)
    path = task.own_model()
    exact = task.evaluate(None, load_tokenizer(path), policy=load_causal_lm(path, torch.float32))
    return {"searcher": set(searcher_metrics), "trainer": set(step), "stats": set(stats),
            "eval": _eval_keys(greedy) | _eval_keys(exact)}


def emitted_keys(run_keys: dict[str, set[str]]) -> set[str]:
    """Every key the code emits: run, objectives, static literals, and the extras' eval dicts."""
    tasks = ROOT / "src" / "tba" / "tasks"
    extras = _returned_dict_keys(tasks / "redteam.py", "evaluate") | _returned_dict_keys(tasks / "summarize.py",
                                                                                         "evaluate")
    extras.discard("examples")  # a list, not logged
    return set().union(*run_keys.values(), loss_keys(), static_keys(), {f"eval/{k}" for k in extras})


def documented_keys(text: str) -> set[str]:
    """The metric keys docs/metrics.md names in code spans."""
    return {m for span in re.findall(r"`([^`]+)`", text) for m in [span] if KEY.fullmatch(m)}


def test_metrics_doc_lists_every_emitted_key(run_keys):
    emitted = emitted_keys(run_keys)
    # each source contributes, so a broken collection cannot pass silently
    assert {"searcher/reward_mean", "loss/tb", "train/grad_norm", "buffer/staleness_max"} <= run_keys["searcher"] \
        | run_keys["trainer"]
    assert {"buffer/size", "buffer/samples_added", "searcher/max_version"} <= run_keys["stats"]
    assert {"eval/accuracy", "eval/kl", "eval/kl_prompt_<i>"} <= run_keys["eval"]
    assert {"searcher/restarts", "perf/elapsed_s", "perf/trainer_idle_frac"} <= static_keys()
    assert {f"loss/{name}" for name in ("tb", "rloo", "grpo", "dr_grpo", "ppo_clip", "online_dpo")} <= loss_keys()
    documented = documented_keys((ROOT / "docs" / "metrics.md").read_text())
    assert not emitted - documented, f"keys the code logs but docs/metrics.md does not list: {emitted - documented}"
    assert not documented - emitted, f"keys docs/metrics.md lists but the code never logs: {documented - emitted}"


def _help_defaults(text: str) -> dict[tuple[str, str], str]:
    """``{(section, field): default}`` from ``tba train --help`` laid out unwrapped: ``config`` for the config
    fields (``--section.field V  doc [default: X]``), the task's name for its ``task.options``."""
    out, section, entry = {}, "config", None
    for line in text.splitlines() + [""]:
        head = re.match(r"  (--[\w.]+) V(?:\s{2,}(.*))?$" if section == "config" else r"  (\w+): \S+(?:\s{2,}(.*))?$",
                        line)
        if entry and not head and line.startswith(" " * 24):
            entry[1].append(line.strip())
            continue
        if entry:  # a finished entry; the short flags (--max-steps: "same as --trainer.max_steps") have no default
            if m := re.fullmatch(r".*\[default: (.*)\]", " ".join(entry[1])):
                out[(section, entry[0])] = m.group(1)
            entry = None
        if m := re.fullmatch(r"task\.options of (\S+):", line):
            section = m.group(1)
        elif head:
            entry = (head.group(1).removeprefix("--"), [head.group(2) or ""])
    return out


def _reference_defaults(markdown: str) -> dict[tuple[str, str], str]:
    """``{(section, field): default}`` from the generated reference's tables, keyed as :func:`_help_defaults`."""
    out, section = {}, "config"
    for line in markdown.splitlines():
        if m := re.fullmatch(r"### `(.+)`", line):
            section = m.group(1)
        elif m := re.match(r"\| `([^`]+)` \| `[^`]*` \| `([^`]*)` \| ", line):
            out[(section, m.group(1).removeprefix("task.options."))] = m.group(2)
    return out


def test_configuration_reference_matches_help(monkeypatch):
    from tba.cli import _train_parser
    from tba.config import iter_fields

    monkeypatch.setenv("COLUMNS", "1000")  # argparse and the task options wrap nothing: one entry a line
    helped = _help_defaults(_train_parser().format_help())
    assert len([k for k in helped if k[0] == "config"]) == len(list(iter_fields()))
    assert ("redteam", "victim") in helped and ("known_optimum", "symbols") in helped
    reference = _reference_defaults(_hooks().config_reference())
    assert reference == helped


def test_config_reference_is_in_the_site_nav():
    """The hook is wired: mkdocs.yml runs docs/hooks.py and its nav has the generated page."""
    text = (ROOT / "mkdocs.yml").read_text()
    assert "- docs/hooks.py" in text and "configuration.md" in text
    assert not (ROOT / "docs" / "configuration.md").exists()  # generated, never committed (and so never stale)


def test_readme_test_command_is_ci_run():
    readme = (ROOT / "README.md").read_text().split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert commands[1] == ci[-1]
    assert "ruff check . && mkdocs build --strict && python -m pytest -q -n 2 --dist loadfile" in ci[-1]
