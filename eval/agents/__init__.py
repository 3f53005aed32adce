"""Agents for the benchmark: the simulated agent and LangChain chat models."""

from eval.agents.simulated import SIMULATED_AGENT_LABEL, NeedView, SimAgentConfig, SimulatedAgent, TaskView

__all__ = ["SIMULATED_AGENT_LABEL", "NeedView", "SimAgentConfig", "SimulatedAgent", "TaskView"]
