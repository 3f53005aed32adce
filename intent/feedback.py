"""Every message the guard shows the agent, in one place so the wording stays consistent.

Oracles write their own rejection feedback (see ``intent.oracles``); these are the
guard's messages for calls it answers itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from intent.market import Market
from intent.oracle import PlannedStep


def _money(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".")


def over_budget(tool: str, price: float, remaining: float, budget: float) -> str:
    return (
        f"Budget guard: the call to {tool} was not executed and cost nothing. It costs {_money(price)} "
        f"but only {_money(remaining)} of the budget {_money(budget)} is left. "
        "Use a cheaper tool, or give your final answer with what you have."
    )


def banned_tool(tool: str) -> str:
    return f"Budget guard: {tool} is no longer available on the market; the call cost nothing. Use another tool."


def unpriced_tool(tool: str, detail: str) -> str:
    return f"Budget guard: the call to {tool} was refused and cost nothing: {detail}"


def unpriced_offered_tool(tool: str, available: Sequence[str] = ()) -> str:
    # Spoken to the agent: the tool exists but this budget cannot pay for it (no price is known).
    listed = f" The tools you can use are: {', '.join(available)}." if available else ""
    return (f"Error: {tool} cannot be used under this budget (it has no price); the call was not made and "
            f"cost nothing.{listed}")


def unknown_tool(tool: str, available: Sequence[str] = ()) -> str:
    # Spoken to the agent (not the developer): an invented name needs the real list.
    listed = f" The available tools are: {', '.join(available)}." if available else ""
    return f"Error: there is no tool named {tool}; the call was not made and cost nothing.{listed}"


def merged_call(tool: str, kept_id: str) -> str:
    return (f"Budget guard: an identical call to {tool} (same arguments) is already in this message as "
            f"{kept_id!r}; it runs once and is charged once.")


def invalid_call(tool: str | None, problem: str) -> str:
    return f"Error: the call to {tool or 'an unnamed tool'} is malformed and was not executed (no charge): {problem}"


def not_gated(tool: str) -> str:
    return (
        f"Budget guard: the call to {tool} was not executed because the guard never approved it "
        "(no reservation). Place the guard's gate (guard.node() or the middleware) before the tools."
    )


def duplicate_call(tool: str, shared_id: str) -> str:
    return (
        f"Budget guard: this call to {tool} reused the id {shared_id!r} of another call in the same message, "
        "so it was not executed and cost nothing. Call it again if you still need it."
    )


def retry_over_budget(tool: str, price: float, remaining: float, budget: float, run: int) -> str:
    return (
        f"Budget guard: run {run} of the call to {tool} (a retry) was not executed and cost nothing. It costs "
        f"{_money(price)} but only {_money(remaining)} of the budget {_money(budget)} is left."
    )


def repriced_over_budget(tool: str, quoted: float, price: float, remaining: float, budget: float) -> str:
    return (
        f"Budget guard: the call to {tool} was not executed and cost nothing. Its price changed from "
        f"{_money(quoted)} to {_money(price)} before it ran, and only {_money(remaining)} of the budget "
        f"{_money(budget)} is left."
    )


def overrun_stop(tool: str, overrun: float) -> str:
    return (
        f"Budget guard: the call to {tool} was not executed: an earlier call was billed {_money(overrun)} above "
        "its quoted price, so no further spending is allowed. Give your final answer with what you have."
    )


def no_room(tool: str, price: float, remaining: float, ledger: Any) -> str:
    """Why a call the budget cannot pay is refused: the overrun that halted all spending, else the money left."""
    if ledger.halted:
        return overrun_stop(tool, ledger.blocking_overrun)
    return over_budget(tool, price, remaining, ledger.budget)


def cancelled(tool: str) -> str:
    return f"Error: {tool} was cancelled while running. The call was charged."


def billed_after_cancel(tool: str, billed: float) -> str:
    return (f"{tool} went on after its run was cancelled and reported a bill of {billed:g}, above what was "
            "charged: the rest was charged as an overrun.")


def tool_raised(tool: str, exc: BaseException, charged: float | None = None) -> str:
    """A tool's run raised. ``charged``: what its runs of this call cost (``None``: not said)."""
    text = f"Error: {tool} failed ({type(exc).__name__}: {exc})."
    if charged is None:
        return text
    return f"{text} The call was charged {charged:g}." if charged > 0 else f"{text} It cost nothing."


def oracle_failed(tool: str, exc: BaseException, *, accepted: bool) -> str:
    what = "accepted because it fits the remaining budget" if accepted else "rejected"
    return f"Budget guard: the planning oracle failed ({type(exc).__name__}); the call to {tool} was {what}."


def oracle_bug(tool: str, exc: BaseException) -> str:
    return (f"Budget guard: the call to {tool} was not run: the budget oracle crashed checking it "
            f"({type(exc).__name__}).")


SHORT_FEEDBACK_CHARS = 240


def check_feedback_chars(value: Any) -> int | None:
    """``BudgetGuard(feedback_chars=...)``: ``None`` (no cap) or an int with room for a short note."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < SHORT_FEEDBACK_CHARS):
        from intent.errors import GuardConfigError

        raise GuardConfigError(f"feedback_chars must be None (no cap) or an int >= {SHORT_FEEDBACK_CHARS} "
                               f"(characters of refusal notes per turn), got {value!r}")
    return value


def shortened(tool: str, text: str, *, why: str) -> str:
    """A refusal's note cut to its first lines (``SHORT_FEEDBACK_CHARS`` at most): what the agent
    is shown once the turn's feedback budget is spent, or for a refusal of an earlier turn."""
    head = " ".join(line.strip() for line in text.strip().splitlines()[:2] if line.strip())
    if len(head) > SHORT_FEEDBACK_CHARS:
        head = head[: SHORT_FEEDBACK_CHARS - 3].rstrip() + "..."
    return f"{head} [{tool}: {why}]"


def cut_to(text: str, chars: int) -> str:
    """``text``'s whole lines that fit in ``chars`` (the first line cut if it alone does not), marked as cut."""
    mark = " [cut to fit the feedback cap]"
    room = max(0, chars - len(mark))
    kept: list[str] = []
    used = 0
    for line in text.splitlines():
        if used + len(line) + 1 > room:
            break
        kept.append(line)
        used += len(line) + 1
    body = "\n".join(kept) if kept else text[:room]
    return body + mark


def generic_rejection(tool: str) -> str:
    return f"Budget guard: the call to {tool} was rejected and cost nothing. Revise your plan."


BUDGET_STATUS_MARK = "[Budget status]"
# Notes a method appends to a tool's result on a line of its own: the budget status above
# (Prompt, MCO, INTENT) and BATS's ``<budget>used/remaining</budget>`` tracker block.
_RESULT_NOTE_MARKS = ("\n" + BUDGET_STATUS_MARK, "\n<budget>")


def budget_status(spent: float, remaining: float, budget: float) -> str:
    return f"{BUDGET_STATUS_MARK} spent {_money(spent)} of {_money(budget)}; {_money(remaining)} left."


def without_result_note(text: str) -> str:
    """A tool result as the tool returned it, without the budget note a method appended to it
    (what a world model learns, an agent parses and a judge of observations reads)."""
    for mark in _RESULT_NOTE_MARKS:
        text = text.split(mark, 1)[0]
    return text


def trace_table(trace: Sequence[PlannedStep]) -> str:
    """The predicted tool trace as the INTENT paper's Appendix E shows it: no arguments, no contents."""
    lines = ["step | tool | price | p_success | expected_cost"]
    for i, s in enumerate(trace, start=1):
        lines.append(f"{i} | {s.tool} | {_money(s.price)} | {s.p_success:.2f} | {_money(s.expected_cost or 0.0)}")
    return "\n".join(lines)


def alternatives_table(alternatives: Sequence[PlannedStep]) -> str:
    """INTENT's optional hint on rejection: other tools taking the same arguments, least expected cost first."""
    lines = ["Alternatives for the rejected call (same arguments; predicted, least expected cost first):",
             "rank | tool | price | p_success | expected_cost"]
    for i, s in enumerate(alternatives, start=1):
        lines.append(f"{i} | {s.tool} | {_money(s.price)} | {s.p_success:.2f} | {_money(s.expected_cost or 0.0)}")
    return "\n".join(lines)


def price_list(market: Market) -> str:
    """The tool price block shown to the agent (one ``- name: price`` line per available tool)."""
    lines = [f"- {t.name}: {_money(t.price)}" for t in market.tools if t.name not in market.banned]
    return "Tool prices (cost per call):\n" + "\n".join(lines)


def market_notes(market: Market, spent: float, remaining: float, budget: float) -> str:
    """Budget, prices and status for the system prompt (Prompt, INTENT, MCO show the market)."""
    return (
        f"You have a hard budget of {_money(budget)} for tool calls in this task; every call is charged its price.\n"
        f"{price_list(market)}\n{budget_status(spent, remaining, budget)}"
    )


def plan_rejection(remaining: float, risk_cost: float, gamma: float, trace: Sequence[PlannedStep] | None,
                   plan_price: float | None = None) -> str:
    """INTENT's rejection (paper, Appendix E): the predicted tool trace without arguments or contents.

    ``plan_price``: the plan's cost if every call works the first time, when it is more than is
    left (``IntentOracle(ideal_plan_must_fit=True)``): the rejection says so first."""
    risk = f"risk-adjusted cost of your current plan (gamma={gamma:g}): {risk_cost:.2f}"
    if plan_price is not None and plan_price > remaining + 1e-9:
        why = f"even if every call works the first time, your current plan costs {_money(plan_price)}"
        why += f"; {risk}, which would exceed it too." if risk_cost > remaining + 1e-9 else ", which would exceed it."
    else:
        why = f"{risk}, which would exceed it."
    head = (
        "Budget check failed: the call was not executed and cost nothing.\n"
        f"Remaining budget: {_money(remaining)}; {why}"
    )
    # Appendix E's wording: the trace's success probabilities are the point of INTENT's feedback.
    body = ("\nPay attention to the predicted success probabilities: some tools may have a much lower chance than "
            f"you expected; try to avoid them in your next attempt.\nPredicted tool trace:\n{trace_table(trace)}"
            if trace else "")
    return f"{head}{body}\nPlease revise your plan (fewer calls / different tools / answer directly)."


def rollout_rejection(remaining: float, total: float, actions: Sequence[Mapping[str, Any]]) -> str:
    """MCO's rejection: the simulated future actions that led to the budget violation."""
    lines = [
        "Budget check failed: the call was not executed and cost nothing.",
        f"A simulated continuation of your plan costs {_money(total)} but only {_money(remaining)} is left:",
    ]
    for i, a in enumerate(actions, start=1):
        lines.append(f"{i}. {a['tool']}({a.get('args', '')}) price {_money(a['price'])}")
    lines.append("Please revise your plan (fewer calls / different tools / answer directly).")
    return "\n".join(lines)


def model_over_budget(model: str, worst_case: float, remaining: float, budget: float) -> str:
    """The agent's final message when its next model call does not fit (model costs are small: 4 digits)."""
    return (f"I have to stop here: my next model call ({model}) may cost up to {worst_case:.4g}, but only "
            f"{remaining:.4g} of the budget {budget:.4g} is left.")


def model_unpriced(model: str, detail: str) -> str:
    return f"I have to stop here: the model {model or '(unnamed)'} has no price, so its calls cannot be budgeted. {detail}"


def model_refused(detail: str) -> str:
    return f"I have to stop here: the budget does not cover another model call ({detail})."
