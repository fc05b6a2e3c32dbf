"""Greedy eval accuracy on a task's held-out problems."""

from __future__ import annotations

import math


def greedy_accuracy(engine, task, tokenizer, problems, batch_size: int = 32, max_new_tokens: int = 64,
                    num_examples: int = 3) -> dict:
    """Fraction of ``problems`` whose greedy response gets full reward.

    Returns:
        ``{"accuracy", "stderr", "n", "examples"}``; stderr = sqrt(p(1-p)/n), the eval's sampling noise.
    """
    correct = 0
    examples = []
    for s in range(0, len(problems), batch_size):
        chunk = problems[s : s + batch_size]
        gens = engine.generate([task.encode(tokenizer, p) for p in chunk], 1, max_new_tokens, greedy=True)
        for p, (g,) in zip(chunk, gens):
            text = tokenizer.decode(g.response_ids, skip_special_tokens=True)
            ok = task.is_correct(text, p)
            correct += ok
            if len(examples) < num_examples:
                examples.append({"question": p.question, "answer": p.answer, "response": text, "correct": ok})
    n = len(problems)
    acc = correct / max(1, n)
    return {"accuracy": acc, "stderr": math.sqrt(acc * (1 - acc) / max(1, n)), "n": n, "examples": examples}
