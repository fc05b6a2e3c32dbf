"""Reward functions: math answers, toxicity, preference scorers and diversity (one module each)."""
