"""Greedy eval accuracy on a task's held-out problems: the default of :meth:`tba.tasks.Task.evaluate`.

Tasks with other eval metrics override ``evaluate`` (red-teaming samples attacks and reports the attack
success rate; summarisation reports the win rate over reference summaries).
"""

from __future__ import annotations

import math


def greedy_accuracy(engine, task, tokenizer, problems, batch_size: int = 32, max_new_tokens: int = 64,
                    num_examples: int = 3) -> dict:
    """Fraction of ``problems`` whose greedy response gets full reward.

    Args:
        engine: generation engine (``HFEngine``) holding the policy to evaluate.
        task: the task (prompt encoding, ``is_correct``).
        tokenizer: the policy's tokenizer.
        problems: held-out problems.
        batch_size: responses decoded at once (continuous batching over all of ``problems``).
        max_new_tokens: response cap, tokens.
        num_examples: first responses returned verbatim, for the run's log.

    Returns:
        ``{"accuracy", "stderr", "n", "examples"}``; stderr = sqrt(p(1-p)/n), the eval's sampling noise.
    """
    correct = 0
    examples = []
    # one call, batch_size responses decoding at once: a finished one's row goes to the next problem
    gens = engine.generate([task.encode(tokenizer, p) for p in problems], 1, max_new_tokens, greedy=True,
                           max_num_seqs=batch_size)
    for p, (g,) in zip(problems, gens):
        text = tokenizer.decode(g.response_ids, skip_special_tokens=True)
        ok = task.is_correct(text, p)
        correct += ok
        if len(examples) < num_examples:
            examples.append({"question": p.question, "answer": p.answer, "response": text, "correct": ok})
    n = len(problems)
    acc = correct / max(1, n)
    return {"accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / max(1, n)), "n": n, "examples": examples}
