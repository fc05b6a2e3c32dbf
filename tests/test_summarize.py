"""Summarisation: data loading (bad rows), the stand-in and reward-model scorers, the missing-EOS penalty,
win rate and perplexity worked by hand, the task's reward and eval, and its e2e run through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("sentence_transformers", reason="pip install 'tba[summarize]'")

from tba.config import Config, TaskConfig, load_config  # noqa: E402
from tba.rewards.diversity import default_embedding_model  # noqa: E402
from tba.rewards.preference import (  # noqa: E402
    RewardModelScorer,
    StandInSummaryScorer,
    apply_missing_eos_penalty,
    build_scorer,
    win_rate,
)
from tba.tasks import build_task  # noqa: E402
from tba.tasks.data import DataError  # noqa: E402
from tba.tasks.summarize import SAMPLE_PATH, load_tldr, perplexity  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "summarize.yaml"
POST = ("My roommate keeps eating the groceries I label and buy every week, and laughs when I ask her to stop. "
        "I am on a tight budget. How do I bring it up again without making work awkward?")


def _summarize(**fields):
    """The summarize task built as a run builds it (the default Config around this task section)."""
    return build_task(Config(task=TaskConfig(name="summarize", **fields)))


# -- data ----------------------------------------------------------------------------------------------
def test_bundled_sample_loads_and_splits():
    rows = [json.loads(line) for line in SAMPLE_PATH.read_text().splitlines()]
    assert len(rows) == 30 and all(r["prompt"].endswith("TL;DR:") and r["reference"] for r in rows)
    train, evals = load_tldr("sample", train_size=100, eval_size=6)
    assert len(train) == 24 and len(evals) == 6
    assert evals[-1] == (rows[-1]["prompt"], rows[-1]["reference"])  # the last rows are held out
    assert load_tldr(None, 5, 6)[0] == train[:5]


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"prompt": "POST: a\n\nTL;DR:", "reference": "b"})


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "p"}', "missing field 'reference' (or 'completion')"),
    ('{"reference": "r"}', "missing field 'prompt'"),
    ('{"prompt": "p", "reference": 3}', "field 'reference' must be a string, got int"),
    ('{"prompt": "  ", "reference": "r"}', "empty 'prompt'"),
    ('{"prompt": "p", "reference": ', "invalid JSON"),
    ('["p", "r"]', "expected a JSON object"),
])
def test_bad_rows_name_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path / "d.jsonl", [GOOD, "", bad, GOOD])
    with pytest.raises(DataError) as err:
        load_tldr(str(path), 10, 1)
    assert str(err.value).startswith(f"{path}:3: ") and message in str(err.value)


def test_local_sources(tmp_path):
    alias = _write(tmp_path / "c.jsonl", [json.dumps({"prompt": f"p{i}", "completion": f" r{i}"}) for i in range(3)])
    assert load_tldr(str(alias), 10, 1) == ([("p0", "r0"), ("p1", "r1")], [("p2", "r2")])  # completion = reference
    with pytest.raises(DataError, match="one file needs more than task.eval_size=3"):
        load_tldr(str(alias), 10, 3)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_tldr(str(tmp_path / "missing.jsonl"), 10, 1)
    folder = tmp_path / "split"
    folder.mkdir()
    _write(folder / "train.jsonl", [GOOD] * 3)
    with pytest.raises(FileNotFoundError, match="validation.jsonl"):
        load_tldr(str(folder), 10, 1)
    _write(folder / "test.jsonl", [GOOD] * 2)
    train, evals = load_tldr(str(folder), 2, 5)
    assert len(train) == 2 and len(evals) == 2
    with pytest.raises(DataError, match=r"d\.jsonl:1: "):
        _summarize(source=str(_write(tmp_path / "d.jsonl", ["{}"])), eval_size=1)


def test_empty_file_and_skipped_rows(tmp_path, caplog):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError) as err:
        _summarize(source=str(empty), eval_size=1)
    assert str(err.value) == f"{empty}: no rows (the file is empty)"
    rows = _write(tmp_path / "mixed.jsonl", [GOOD, "{}", GOOD, GOOD])
    with caplog.at_level("WARNING", logger="tba.tasks.data"):
        task = _summarize(source=str(rows), eval_size=1, options={"skip_bad_rows": True})
    assert (len(task.train), len(task.eval)) == (2, 1)  # the same bad-row policy as every data task
    assert f"{rows}:2: missing field 'prompt'" in caplog.text


# -- worked metrics ----------------------------------------------------------------------------------
def test_win_rate_table_by_hand():
    #            policy  reference  outcome
    table = [(0.9, 0.1, 1.0),   # win
             (0.2, 0.3, 0.0),   # loss
             (0.5, 0.5, 0.5),   # tie counts one half
             (0.7, 0.6, 1.0)]   # win
    rate, stderr = win_rate([p for p, _, _ in table], [r for _, r, _ in table])
    assert rate == sum(o for _, _, o in table) / 4 == 0.625
    assert stderr == pytest.approx(math.sqrt(0.625 * 0.375 / 4))  # 0.2421
    assert win_rate([], []) == (0.0, 0.0)
    with pytest.raises(ValueError):
        win_rate([1.0], [])


def test_perplexity_by_hand():
    # token log-probs [-1, -2] and [-3]: mean -2 nats per token -> perplexity e^2
    assert perplexity(-6.0, 3) == pytest.approx(math.exp(2.0))
    assert perplexity(0.0, 4) == 1.0
    assert math.isnan(perplexity(0.0, 0))


def test_missing_eos_penalty():
    assert apply_missing_eos_penalty(0.4, True, 1.0) == 0.4
    assert apply_missing_eos_penalty(0.4, False, 1.0) == pytest.approx(-0.6)
    assert apply_missing_eos_penalty(0.4, False, 1.0, "replace") == -1.0
    with pytest.raises(ValueError):
        apply_missing_eos_penalty(0.4, False, 1.0, "drop")


def test_standin_scorer():
    scorer = StandInSummaryScorer(target_words=10, length_coef=0.5)
    assert scorer.length_penalty("w " * 10) == 0.0
    assert scorer.length_penalty("w " * 14) == pytest.approx(0.5 * 4 / 10)
    on_topic = "Roommate eats my labelled groceries; how do I raise it without workplace awkwardness?"
    off_topic = "The best way to repot a cactus is to wear thick gloves."
    s_on, s_off, s_copy, s_empty = scorer.score([POST] * 4, [on_topic, off_topic, POST, "  "])
    assert s_on > s_off + 0.3
    assert s_empty == -1.0
    # copying the post is the most similar text (cos 1), but its 37 words cost 0.5 * 27 / 10 = 1.35
    assert len(POST.split()) == 37
    assert s_copy == pytest.approx(1.0 - 1.35, abs=1e-4) and s_copy < s_on
    assert isinstance(build_scorer(None), StandInSummaryScorer)
    assert isinstance(build_scorer("standin"), StandInSummaryScorer)


@pytest.fixture(scope="module")
def local_reward_model(tmp_path_factory):
    """A real local HF reward model: MiniLM's encoder with a seeded, untrained one-logit head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    src = default_embedding_model()
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1)
    out = tmp_path_factory.mktemp("rm")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return str(out)


def test_reward_model_scores_the_templated_pair(local_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    scorer = build_scorer(local_reward_model, template="{prompt} {summary}", batch_size=1)
    assert isinstance(scorer, RewardModelScorer)
    got = scorer.score(["POST: x\n\nTL;DR:", "POST: y\n\nTL;DR:"], [" short one", "another "])
    tok = AutoTokenizer.from_pretrained(local_reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(local_reward_model).eval()
    with torch.no_grad():
        want = [model(**tok(t, return_tensors="pt")).logits[0, 0].item()
                for t in ["POST: x\n\nTL;DR: short one", "POST: y\n\nTL;DR: another"]]
    assert got == pytest.approx(want, abs=1e-4)
    with pytest.raises(ValueError, match="summary"):
        RewardModelScorer(local_reward_model, template="{prompt}")


# -- the task --------------------------------------------------------------------------------------
def test_task_reward_penalises_cut_off_summaries(model_path, tokenizer):
    task = _summarize(options={"max_new_tokens": 8, "tokenizer": model_path}, train_size=3, eval_size=2)
    p = task.train[0]
    assert p.entry["post"] == p.question[: -len("TL;DR:")].rstrip()
    cut = tokenizer.decode(tokenizer(p.answer * 3, add_special_tokens=False)["input_ids"][:8])
    short = tokenizer.decode(tokenizer(p.answer, add_special_tokens=False)["input_ids"][:5])
    assert task.cut_off([cut, short]) == [True, False]
    raw = task.scorer.score([p.entry["post"]] * 2, [cut, short])
    assert task.reward_batch([cut, short], [p, p]) == pytest.approx([raw[0] - 1.0, raw[1]])
    assert task.reward(short, p) == pytest.approx(raw[1])
    with pytest.raises(ValueError, match=r"^task\.options\.judje: Extra inputs are not permitted \(allowed: "):
        _summarize(options={"judje": "x"})
    with pytest.raises(ValueError, match="^task.options.missing_eos_mode: Input should be 'subtract' or 'replace'"):
        _summarize(options={"missing_eos_mode": "drop"})


def test_evaluate_win_rate_and_perplexity(model_path, tokenizer, tiny_model):
    from tba.engines.hf import HFEngine
    from tba.scoring import token_logprobs

    task = _summarize(options={"reference_model": model_path, "reference_layers": 2, "num_examples": 2,
                               "dtype": "float32"}, train_size=4, eval_size=3)
    engine = HFEngine(tiny_model, tokenizer)
    result = task.evaluate(engine, tokenizer, batch_size=2, max_new_tokens=6)
    assert result["n"] == 3 and 0 <= result["win_rate"] <= 1 and len(result["examples"]) == 2
    ex = result["examples"][0]
    ours, ref = task.judge.score([task.eval[0].entry["post"]] * 2, [ex["summary"], ex["reference"]])
    assert (ex["judge_policy"], ex["judge_reference"]) == pytest.approx((ours, ref))
    # perplexity cross-check: the reference model here is the same 2-layer float32 weights as the policy
    gens = engine.generate([task.encode(tokenizer, p) for p in task.eval], 1, 6, greedy=True)
    with torch.no_grad():
        lp, mask = token_logprobs(tiny_model, [task.encode(tokenizer, p) for p in task.eval],
                                  [g.response_ids for (g,) in gens], 1.0, tokenizer.pad_token_id)
    assert result["perplexity"] == pytest.approx(perplexity(float(lp.sum()), float(mask.sum())), rel=1e-4)
    assert result["perplexity"] >= 1.0


def test_build_task_passes_model_settings_as_default_options(tmp_path):
    cfg = load_config(CONFIG, {"model.num_hidden_layers": 2, "searcher.max_new_tokens": 12,
                               "model.dtype": "float32", "model.cache_dir": str(tmp_path),
                               "task.options.judge_template": "{prompt} -> {summary}"})
    o = build_task(cfg).options
    assert (o.reference_model, o.tokenizer, o.reference_layers, o.max_new_tokens) == (
        cfg.model.policy, cfg.model.policy, 2, 12)
    assert (o.dtype, o.cache_dir) == ("float32", str(tmp_path))
    assert o.judge_template == "{prompt} -> {summary}" and o.reward_model == "standin"
    cfg = load_config(CONFIG, {"model.reference": "some/reference", "task.options.max_new_tokens": 99})
    o = build_task(cfg).options
    assert o.max_new_tokens == 99  # the user's task.options win
    assert o.reference_model == "some/reference"  # model.reference, when set, is the perplexity model
    assert "reference_model" not in cfg.task.options  # the config itself is left as it was


# -- e2e ------------------------------------------------------------------------------------------
def test_summarize_end_to_end_through_the_cli(tmp_path, cli, model_path):
    """Continuous stand-in rewards give every step a gradient: the saved final policy has moved."""
    out = tmp_path / "summarize"
    r = cli.run([str(CONFIG), "--model.num_hidden_layers", "2", "--task.eval_size", "4",
              "--searcher.prompts_per_batch", "2", "--searcher.samples_per_prompt", "4",
              "--searcher.max_new_tokens", "8", "--trainer.prompts_per_step", "2", "--trainer.group_size", "4",
              "--buffer.min_fill", "8", "--trainer.sync_period", "1", "--max-steps", "2",
              "--run.eval_before", "false", "--run.eval_batch_size", "4",
              "--run.tensorboard", "false", "--output-dir", str(out)])
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "summarize" and summary["trainer_steps"] == 2
    from transformers import AutoModelForCausalLM

    final = AutoModelForCausalLM.from_pretrained(out / "final")
    init = AutoModelForCausalLM.from_pretrained(model_path, num_hidden_layers=2)
    assert not torch.allclose(init.model.layers[0].mlp.up_proj.weight, final.model.layers[0].mlp.up_proj.weight)
    after = summary["eval_after"]
    assert after["n"] == 4 and 0 <= after["win_rate"] <= 1 and after["perplexity"] >= 1
    assert summary["reward_failures"] == 0 and len(summary["eval_examples"]) == 3
    assert "eval win_rate" in r.stdout
