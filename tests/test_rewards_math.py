"""GSM8K answer extraction, matching and reward (tba.rewards.math)."""

from __future__ import annotations

import threading

import pytest

from tba.rewards.math import answers_match, extract_final_answer, gold_final_answer, gsm8k_reward, normalize_number

JANET_GOLD = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\n"
    "She makes 9 * 2 = $<<9*2=18>>18 every day at the farmer\u2019s market.\n#### 18"
)

# (text, expected extraction)
EXTRACTION_CASES = [
    ("#### 18", "18"),
    (JANET_GOLD, "18"),
    ("Total is 70 + 2.\n#### 72", "72"),
    ("It costs $1,200 in total", "1200"),
    ("The temperature dropped to -3", "-3"),
    ("Each slice is 0.5 of a cup", "0.5"),
    ("Each slice is .5 of a cup", "0.5"),
    ("So she has 18.", "18"),
    ("The final answer is \\boxed{42}.", "42"),
    ("\\boxed{42} because 6 * 7 = 42 and 3 + 4 = 7", "42"),  # boxed beats later numbers
    ("Half is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces kept whole
    ("\\boxed{\\$1{,}200}", "1200"),
    ("\\boxed{18 \\text{ dollars}}", "18"),
    ("The answer is 42", "42"),
    ("The answer is 42. Next, 3 more friends came.", "42"),  # stated answer beats a later number
    ("Answer: $1,200.", "1200"),
    ("The answer is -$3.", "-3"),
    ("He pays 42 dollars", "42"),
    ("The discount is 50%", "50"),
    ("First 3 apples, then 5 pears, finally 12 plums", "12"),  # multiple numbers -> last
    ("The population is 1,234,567 people", "1234567"),
    ("The change is -0.5 degrees", "-0.5"),
    ("She earned 18.00 dollars", "18"),
    ("16-3-4=9", "9"),  # subtraction signs are not negative numbers
    ("20 - 5", "5"),
    ("x = -5", "-5"),
    ("I do not know", None),
    ("", None),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTION_CASES)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


# (pred, gold, expected match)
MATCH_CASES = [
    ("18", "18", True),
    ("18", "18.00", True),
    ("1200", "1,200", True),
    ("0.75", "3/4", True),
    ("3/4", "0.75", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\sqrt{4}", "2", True),  # non-numeric -> math-verify
    ("\\sqrt{2}", "1.41", False),
    ("17", "18", False),
    ("-3", "3", False),
    ("1000000.0000001", "1000000", True),  # within 1e-6 relative
    ("0.5", "0.51", False),
    (None, "18", False),
    ("", "18", False),
]


@pytest.mark.parametrize(("pred", "gold", "expected"), MATCH_CASES)
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


# (response, gold answer, expected reward)
REWARD_CASES = [
    ("She makes 9 * 2 = $18 every day.", JANET_GOLD, 1.0),
    ("She makes 9 * 2 = $18 every day.", "18", 1.0),
    ("She makes 9 * 2 = $19 every day.", JANET_GOLD, 0.0),
    ("So the answer is \\boxed{72}, not 70.", "Some work.\n#### 72", 1.0),
    ("The total is $1,200.", "#### 1,200", 1.0),
    ("Each gets 3/4 of a pie, i.e. 0.75", "0.75", 1.0),
    ("Each gets \\boxed{\\frac{3}{4}} of a pie", "0.75", 1.0),
    ("I cannot solve this.", "18", 0.0),
    ("", JANET_GOLD, 0.0),
]


@pytest.mark.parametrize(("response", "gold", "expected"), REWARD_CASES)
def test_gsm8k_reward(response, gold, expected):
    assert gsm8k_reward(response, gold) == expected


def test_gold_without_answer_is_an_error():
    with pytest.raises(ValueError, match="gold answer"):
        gsm8k_reward("18", "   ")


@pytest.mark.parametrize(
    ("gold", "expected"),
    [(JANET_GOLD, "18"), ("work\n#### 1,200", "1200"), ("work\n#### $1,200 dollars", "1200"), ("#### -47", "-47"),
     ("18.00", "18"), ("3/4", "3/4"), ("\\frac{1}{2}", "\\frac{1}{2}"), ("work\n####  ", None), ("   ", None)],
)
def test_gold_final_answer(gold, expected):
    """The one parser of gold answers (GSM8K's loader uses it too): the ``####`` tail or a bare answer."""
    assert gold_final_answer(gold) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("$1,200.00", "1200"), ("-0", "0"), ("007", "7"), ("50%", "50"), ("3/4", None), ("abc", None)],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_reward_in_worker_thread():
    """math-verify's signal-based timeout raises outside the main thread; ours must not."""
    results: dict[str, object] = {}

    def work():
        try:
            results["numeric"] = gsm8k_reward("The answer is 18.", JANET_GOLD)
            # Forces the math-verify path (non-numeric LaTeX on one side).
            results["latex"] = gsm8k_reward("\\boxed{\\sqrt{4}}", "2")
            results["latex_wrong"] = answers_match("\\sqrt{2}", "2")
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread below
            results["error"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive()
    assert "error" not in results, repr(results.get("error"))
    assert results == {"numeric": 1.0, "latex": 1.0, "latex_wrong": False}
