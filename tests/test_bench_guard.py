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
