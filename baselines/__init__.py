"""Baseline oracles that plug into the same BudgetGuard: Raw, Prompt, BTP, BATS, DFSDT."""
