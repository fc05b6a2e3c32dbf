"""GSM8K answer extraction and the binary correctness reward of the TBA paper.

The TBA paper (Bartoldson et al., 2025, arXiv 2503.18929, section 5 of ``docs/algorithm.md``) scores
GSM8K responses with a 0/1 reward: 1 if the final number of the response equals the gold answer.
Gold answers follow the GSM8K format of Cobbe et al. (2021), "Training Verifiers to Solve Math Word
Problems": a worked solution whose last line is ``#### <final answer>``.

Public API:

* :func:`extract_final_answer` - the final answer of a response or a gold solution, normalised;
* :func:`normalize_number` - canonical string of one number (``"$1,200.00"`` -> ``"1200"``);
* :func:`answers_match` - numeric comparison with a ``math-verify`` fallback (fractions, LaTeX);
* :func:`gold_final_answer` - the final answer of a gold solution (``#### x``) or a bare gold answer;
* :func:`gsm8k_reward` - the paper's reward.

``math-verify`` is imported lazily and always called with its signal-based timeouts disabled
(``parsing_timeout=None`` / ``timeout_seconds=None``), because those timeouts raise outside the main
thread; whoever calls these functions (a reward worker) is responsible for enforcing a time limit.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

__all__ = ["extract_final_answer", "normalize_number", "answers_match", "gold_final_answer", "gsm8k_reward"]

# One number as written in prose: optional sign, optional ``$``/``\$``, digits with optional
# thousands separators and decimals, or a bare leading-dot decimal (``.5``).
_NUM_BODY = r"(?:\d{1,3}(?:,\d{3})+(?!\d)(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUM_RE = re.compile(
    r"(?P<sign>[-\u2212]\s?)?(?:\\?\$\s?)?(?P<sign2>[-\u2212])?(?P<body>" + _NUM_BODY + r")"
)
_ANSWER_IS_RE = re.compile(
    r"answer(?:\s+(?:is|was)\s*[:=]?|\s*[:=])\s*(?=[-\u2212$\\.\d])",
    re.IGNORECASE,
)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# Decorations removed from a boxed answer or gold answer before testing whether it is one number.
_DECORATION_RE = re.compile(
    r"\\(?:text|mathrm|textbf|mbox)\{[^{}]*\}|\\[,!;: ]|\\?\$|\\?%|\^\s*\{?\\circ\}?|\\left|\\right"
)


def normalize_number(text: str) -> str | None:
    """Return the canonical form of ``text`` if it is exactly one number, else ``None``.

    Strips surrounding whitespace, ``$``/``\\$``, ``%``, thousands separators (``,`` and LaTeX
    ``{,}``), a trailing sentence period, and trailing zeros of the fraction part.

    Examples::

        normalize_number("$1,200")   -> "1200"
        normalize_number("18.00")    -> "18"
        normalize_number(".5")       -> "0.5"
        normalize_number("-0")       -> "0"
        normalize_number("50%")      -> "50"
        normalize_number("3/4")      -> None   (not a single number; see answers_match)
    """
    s = text.replace("{,}", ",")
    s = _DECORATION_RE.sub("", s).strip()
    s = s.rstrip(".").strip() if re.search(r"\d\.$", s) else s
    m = re.fullmatch(r"(?P<sign>[-\u2212+])?\s*(?P<body>" + _NUM_BODY + r")", s)
    if m is None:
        return None
    return _canonical(m.group("body"), negative=m.group("sign") in ("-", "\u2212"))


def _canonical(body: str, negative: bool) -> str:
    """Canonical string of an unsigned number ``body`` (commas allowed) with a sign."""
    body = body.replace(",", "")
    if "." in body:
        int_part, frac_part = body.split(".", 1)
        frac_part = frac_part.rstrip("0")
    else:
        int_part, frac_part = body, ""
    int_part = int_part.lstrip("0") or "0"
    out = int_part + ("." + frac_part if frac_part else "")
    if negative and out != "0":
        out = "-" + out
    return out


def _is_sign(text: str, pos: int) -> bool:
    """Whether the ``-`` at ``text[pos]`` is a sign (``= -3``, ``is -3``) not a minus (``16-3``)."""
    before = text[:pos].rstrip()
    if not before:
        return True
    prev = before[-1]
    if prev.isdigit() or prev in ")]}%.":
        return False  # ``16-3``, ``20 - 5``, ``(a+b)-c``: subtraction
    if prev.isalpha() or prev == "_":
        return len(before) < pos  # ``is -3`` is negative, ``x-3`` is a subtraction
    return True  # ``= -3``, ``(-3)``, ``: -3``, ``$-3``


def _iter_numbers(text: str):
    """Yield ``(start, end, canonical)`` for every number in ``text``, left to right."""
    for m in _NUM_RE.finditer(text):
        sign = m.group("sign")
        negative = bool(m.group("sign2"))
        if sign and _is_sign(text, m.start()):
            negative = True
        yield m.start(), m.end(), _canonical(m.group("body"), negative)


def _boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in ``text`` (balanced braces), in order."""
    out = []
    for m in _BOXED_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            out.append(text[m.end() : i - 1].strip())
    return out


def extract_final_answer(text: str) -> str | None:
    """Return the final answer of a model response or a GSM8K gold solution, or ``None``.

    Rules, in order of precedence:

    1. ``\\boxed{...}`` (the last one, nested braces allowed): its content, normalised to a number
       when it is one (``\\boxed{\\$1,200}`` -> ``"1200"``), else returned as written
       (``\\boxed{\\frac{1}{2}}`` -> ``"\\frac{1}{2}"``, compared later by :func:`answers_match`).
    2. ``#### x`` (GSM8K gold format, Cobbe et al. 2021): the first number after the last ``####``.
    3. "The answer is x" / "Answer: x": the number after the last such phrase.
    4. Otherwise the last number in the text (the paper's rule: "the last number in the response").

    Numbers are normalised: commas, ``$`` and ``%`` dropped, a trailing sentence period ignored,
    trailing fractional zeros removed (``18.00`` -> ``"18"``, ``.5`` -> ``"0.5"``); units after a
    number are ignored (``42 dollars`` -> ``"42"``).  Returns ``None`` when there is no number.

    Examples::

        extract_final_answer("She makes $18 a day.\\n#### 18")  -> "18"
        extract_final_answer("It costs $1,200.")                 -> "1200"
        extract_final_answer("The answer is 42 dollars")         -> "42"
        extract_final_answer("no numbers here")                  -> None
    """
    if not text:
        return None
    boxed = [b for b in _boxed_contents(text) if b]
    if boxed:
        content = boxed[-1]
        return normalize_number(content) or content
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        for _, _, num in _iter_numbers(tail):
            return num
    answer_is = list(_ANSWER_IS_RE.finditer(text))
    if answer_is:
        start = answer_is[-1].end()
        for pos, _, num in _iter_numbers(text[start : start + 64]):
            if pos <= 2:  # the number follows the phrase directly (allowing "$" / "\\$")
                return num
            break
    last = None
    for _, _, num in _iter_numbers(text):
        last = num
    return last


def _to_float(text: str) -> float | None:
    """``text`` as a float if it is one number or a simple fraction (``3/4``, ``\\frac{3}{4}``)."""
    num = normalize_number(text)
    if num is not None:
        try:
            return float(Decimal(num))
        except InvalidOperation:  # pragma: no cover - normalize_number only returns decimals
            return None
    s = _DECORATION_RE.sub("", text).strip()
    m = re.fullmatch(r"(-?)\s*\\[dt]?frac\{\s*(\d+)\s*\}\{\s*(\d+)\s*\}", s) or re.fullmatch(
        r"(-?)\s*(\d+)\s*/\s*(\d+)", s
    )
    if m and int(m.group(3)) != 0:
        value = int(m.group(2)) / int(m.group(3))
        return -value if m.group(1) else value
    return None


def _math_verify_match(pred: str, gold: str) -> bool:
    """Symbolic equality via math-verify, with its signal-based timeouts disabled."""
    from math_verify import parse, verify

    def _parse(s: str):
        candidates = [s]
        if "$" not in s and "\\" in s:
            candidates.insert(0, f"${s}$")  # bare LaTeX is extracted more reliably when delimited
        for c in candidates:
            parsed = parse(c, parsing_timeout=None)
            if parsed:
                return parsed
        return []

    try:
        gold_parsed, pred_parsed = _parse(gold), _parse(pred)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - math-verify/sympy failures on odd input mean "no match", not a crash
        return False


def answers_match(pred: str | None, gold: str) -> bool:
    """Return True if the extracted answer ``pred`` equals the gold final answer ``gold``.

    Both sides are compared as numbers when both parse as one (plain numbers, ``$1,200``, ``50%``,
    or simple fractions ``3/4`` / ``\\frac{3}{4}``): equal within a relative tolerance of 1e-6.
    When either side is not numeric (general LaTeX such as ``\\sqrt{2}``), Hugging Face
    ``math-verify`` decides (``parse``/``verify`` with timeouts disabled, so this works in any
    thread; the caller enforces time limits).  ``pred=None`` (nothing extracted) never matches.

    Examples::

        answers_match("18", "18.00")                 -> True
        answers_match("0.75", "3/4")                 -> True
        answers_match("\\frac{1}{2}", "0.5")          -> True
        answers_match("17", "18")                    -> False
        answers_match(None, "18")                    -> False
    """
    if pred is None or gold is None:
        return False
    pred, gold = pred.strip(), gold.strip()
    if not pred or not gold:
        return False
    a, b = _to_float(pred), _to_float(gold)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return _math_verify_match(pred, gold)


def gold_final_answer(gold_answer: str) -> str | None:
    """The final answer of a gold string: a full GSM8K solution (``#### x``) or just ``x``, or ``None``.

    After the last ``####``: the number there, normalised (``"#### 1,200"`` -> ``"1200"``), else
    :func:`extract_final_answer` of that text, else the text as written. A bare gold string: its number
    when it is one, a one-word expression as written (``"3/4"``, ``"\\frac{1}{2}"``), else
    :func:`extract_final_answer` of it. ``None`` when nothing is left (an empty string, or nothing after
    ``####``). Never raises. GSM8K's loader (:mod:`tba.tasks.gsm8k`) parses gold answers with it too.

    Examples::

        gold_final_answer("Janet sells ...\\n#### 18")  -> "18"
        gold_final_answer("#### 1,200")                  -> "1200"
        gold_final_answer("3/4")                         -> "3/4"
        gold_final_answer("work\\n####  ")               -> None
    """
    if "####" in gold_answer:
        tail = gold_answer.rsplit("####", 1)[1].strip()
        return normalize_number(tail) or extract_final_answer(tail) or (tail or None)
    s = gold_answer.strip()
    if not s:
        return None
    num = normalize_number(s)
    if num is not None:
        return num
    if len(s.split()) == 1 and "\\boxed" not in s:
        return s  # a bare expression such as "3/4" or "\frac{1}{2}": compare it as written
    return extract_final_answer(s)


def gsm8k_reward(response: str, gold_answer: str) -> float:
    """The GSM8K reward of the TBA paper: 1.0 if the response's final answer equals the gold answer.

    ``gold_answer`` may be a full GSM8K solution ending in ``#### x`` (Cobbe et al. 2021 format) or
    just the final answer ``x``.  The response's answer is :func:`extract_final_answer` (a boxed
    answer, ``#### x``, "the answer is x", else the last number) and is compared with
    :func:`answers_match`.  Returns 0.0 for a response with no number.  Safe to call from any
    thread (math-verify runs without its signal-based timeout).

    Raises ``ValueError`` if ``gold_answer`` holds no answer at all (a data bug, not a wrong
    response).

    Examples::

        gsm8k_reward("... so she makes $18 every day.", "Janet sells ... \\n#### 18")  -> 1.0
        gsm8k_reward("The answer is 17.", "18")                                       -> 0.0
    """
    gold = gold_final_answer(gold_answer)
    if gold is None:
        raise ValueError(f"gold answer has no final answer: {gold_answer!r}")
    return 1.0 if answers_match(extract_final_answer(response), gold) else 0.0
