"""tba: Trajectory Balance with Asynchrony (arXiv 2503.18929) for LLM post-training.

Searchers generate and score responses off-policy, a replay buffer keeps them per prompt, and one
trainer learns from the buffer with the trajectory balance loss.
"""

__version__ = "0.1.0"
