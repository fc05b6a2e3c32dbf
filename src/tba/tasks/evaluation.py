"""Greedy eval accuracy on a task's held-out problems: the default of :meth:`tba.tasks.Task.evaluate`.

Tasks with other eval metrics override ``evaluate`` (red-teaming samples attacks and reports the attack
success rate; summarisation reports the win rate over reference summaries).
"""

from __future__ import annotations

import math


def greedy_accuracy(engine, task, tokenizer, problems, max_new_tokens: int = 64, num_examples: int = 3) -> dict:
    """Fraction of ``problems`` whose greedy response gets full reward.

    Args:
        engine: generation engine (:class:`tba.engines.base.Engine`) holding the policy to evaluate; it
            batches all of ``problems`` as it was built to (``run.eval_batch_size`` decoding at once).
        task: the task (prompt encoding, ``is_correct``).
        tokenizer: the policy's tokenizer.
        problems: held-out problems.
        max_new_tokens: response cap, tokens.
        num_examples: first responses returned verbatim, for the run's log.

    Returns:
        ``{"accuracy", "stderr", "n", "examples"}``; stderr = sqrt(p(1-p)/n), the eval's sampling noise.
    """
    correct = 0
    examples = []
    gens = engine.generate([task.encode(tokenizer, p) for p in problems], 1, max_new_tokens, greedy=True)
    for p, (g,) in zip(problems, gens):
        text = tokenizer.decode(g.response_ids, skip_special_tokens=True)
        ok = task.is_correct(text, p)
        correct += ok
        if len(examples) < num_examples:
            examples.append({"question": p.question, "answer": p.answer, "response": text, "correct": ok})
    n = len(problems)
    acc = correct / max(1, n)
    return {"accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / max(1, n)), "n": n, "examples": examples}
