"""make bench-guard's instrument: the guard's in-graph time is read by part, the metered run included."""

from eval import bench_guard


def test_bench_guard_reads_every_part_of_the_guards_time_in_the_graph():
    result = bench_guard.run(calls=3, episodes=1, repeats=1)
    parts = {k[len("in_graph_"):-len("_ms")]: v for k, v in result.items() if k.startswith("in_graph_")}
    # Each hook that runs per call, and the metered run inside the tool handler, has its own reading.
    assert {"wrap_model_call", "wrap_tool_call", "metered_run"} <= set(parts)
    assert all(v > 0 for k, v in parts.items() if k != "after_agent")
    assert abs(sum(parts.values()) - result["guard_hooks_in_graph_ms_per_call"]) < 1e-9


def test_bench_plumbing_runs_every_arm_and_subtracts_the_bare_agent():
    from eval import bench_plumbing

    result = bench_plumbing.run(calls=2, episodes=1, repeats=1)
    assert set(bench_plumbing.ARMS) <= set(result)
    assert result["no middleware"] == 0.0 and result["no middleware (ms per call)"] > 0


def test_the_minimal_gate_floor_really_gates_reserves_and_charges_through_graph_state():
    # The floor is only a floor if it does the work it claims: decisions and reservations written
    # from the model call, each call run once, committed, and the charge in graph state.
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage

    from eval import bench_plumbing
    from intent import BudgetLedger
    from intent.testing import scripted

    calls = 4
    script = [AIMessage("", tool_calls=[{"name": "echo", "args": {"x": i}, "id": f"c{i}", "type": "tool_call"}])
              for i in range(calls)]
    gate = bench_plumbing.MinimalGate()
    gate.budget = 2.5  # two calls of 1.0 fit, the third does not
    agent = create_agent(scripted([*script, AIMessage("done")]), [bench_plumbing._ECHO], middleware=[gate])
    state = agent.invoke({"messages": [HumanMessage("go")]})
    channel = state["intent_ledger"]
    assert sorted(d["accept"] for d in channel["decisions"].values()) == [False, False, True, True]
    ledger = BudgetLedger.from_state(channel)
    assert ledger.spent == 2.0 and ledger.reserved == 0.0
    refused = [m for m in state["messages"] if getattr(m, "status", "") == "error"]
    assert len(refused) == 2


def test_hook_tracing_is_taken_out_only_inside_the_block_and_put_back_after_an_error():
    import langchain.agents.factory as factory
    import pytest

    from eval import bench_plumbing

    original = factory.traceable
    with pytest.raises(RuntimeError):
        with bench_plumbing._without_hook_tracing():
            assert factory.traceable is not original
            fn = lambda: None  # noqa: E731
            assert factory.traceable(name="x")(fn) is fn  # no span wrapped around the hook
            raise RuntimeError("boom")
    assert factory.traceable is original


def test_langsmith_spans_around_the_guards_hooks_do_not_recompute_their_signatures(monkeypatch):
    # create_agent wraps each wrap_* hook in a LangSmith span that calls inspect.signature on every
    # call; the guard's hooks carry a precomputed __signature__, so nothing of the guard is
    # introspected per call (sync and async).
    import asyncio
    import inspect

    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage

    from intent import AcceptAll, BudgetGuard, Market, PricedTool
    from intent.testing import scripted

    computed: list[str] = []
    original = inspect._signature_from_function

    def counting(cls, func, *args, **kwargs):
        computed.append(getattr(func, "__qualname__", ""))
        return original(cls, func, *args, **kwargs)

    monkeypatch.setattr(inspect, "_signature_from_function", counting)
    script = [AIMessage("", tool_calls=[{"name": "echo", "args": {"x": i}, "id": f"c{i}", "type": "tool_call"}])
              for i in range(3)]
    for run in ("sync", "async"):
        guard = BudgetGuard(AcceptAll(), Market([PricedTool("echo", 1.0)]), 10.0)
        agent = create_agent(scripted([*script, AIMessage("done")]), [bench_guard._ECHO], middleware=[guard.middleware()])
        start = len(computed)
        state = (agent.invoke({"messages": [HumanMessage("go")]}) if run == "sync" else
                 asyncio.run(agent.ainvoke({"messages": [HumanMessage("go")]})))
        assert guard.ledger(state).spent == 3.0  # the hooks ran
        assert len(computed) > start  # the counter sees LangChain's own introspection
        assert not [q for q in computed[start:] if q.startswith("BudgetGuardMiddleware.")], run


def test_bench_instructions_reads_the_counted_dump_and_refuses_bad_counts(tmp_path, capsys):
    # callgrind writes one file per dump; the counted one is named by its trigger, and its "summary" line
    # (0 with instrumentation toggled) comes before the "totals" line that holds the count.
    import pytest

    from eval import bench_instructions

    (tmp_path / "cg.1").write_text("desc: Trigger: Program termination\nsummary: 0\ntotals: 0\n")
    (tmp_path / "cg.1.1").write_text("desc: Trigger: dump counted\nsummary: 0\ntotals: 30125773\n")
    assert bench_instructions._counted(tmp_path) == 30125773
    (tmp_path / "cg.1.1").unlink()
    with pytest.raises(RuntimeError, match="no dump named 'counted'"):
        bench_instructions._counted(tmp_path)
    with pytest.raises(SystemExit):
        bench_instructions.main(["--episodes", "0"])
    assert "--episodes must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_instructions.main(["--arms", "guarded,nope"])
    assert "--arms: unknown arm(s) ['nope']" in capsys.readouterr().err


def test_the_opcode_profile_counts_the_guards_own_functions_and_refuses_bad_counts(capsys):
    import pytest

    from eval import profile_opcodes

    result = profile_opcodes.profile(calls=2)
    per_call = result["bytecodes_per_call"]
    assert per_call["guarded"] > per_call["noop_presigned"] > 0
    guard_fns = {name: n for name, (n, _) in result["functions"].items() if "/intent/" in name}
    assert any(name.endswith(":gate_batch") for name in guard_fns), "the gate runs in the guarded arm"
    # the guard's functions run in the model step and in the tool step's thread: both are counted
    assert any(name.endswith("CallRun.execute") for name in guard_fns)
    with pytest.raises(SystemExit):
        profile_opcodes.main(["--top", "0"])
    assert "--top must be at least 1" in capsys.readouterr().err
