"""The benchmark: markets, tool environments, agents, judges, metrics, runner and reports."""
