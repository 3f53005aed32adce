"""User mistakes get one clear line naming the field and the fix, before anything long runs."""

from __future__ import annotations

import pytest

from intent import AcceptAll, BudgetGuard, GuardConfigError, IntentError, Market, PricedTool, UsageError
from intent.market import InvalidPriceError
from intent.cli import main


def test_an_oracle_class_instead_of_an_instance_is_refused_at_construction():
    # It passed (the class has a decide attribute) and failed at run time: "start() missing 1 required ...".
    with pytest.raises(GuardConfigError, match=r"pass an instance: AcceptAll\(...\)"):
        BudgetGuard(AcceptAll, Market([PricedTool("a", 1.0)]), 10.0)


def _guard(**kwargs):
    return BudgetGuard(AcceptAll(), Market([PricedTool("a", 1.0)]), kwargs.pop("budget", 10.0), **kwargs)


@pytest.mark.parametrize("kwargs,says", [
    # Each was taken: a path as log_sink failed after the tool ran and was charged (no .write); "no" read as
    # True; a list of model names and an int too large for a float failed with a bare AttributeError /
    # OverflowError.
    ({"log_sink": "log.jsonl"}, r"log_sink must have a write\(record\).*JsonlLogSink\(path\)"),
    ({"enforce": "no"}, "enforce must be True or False"),
    ({"merge_identical_calls": "False"}, "merge_identical_calls must be True or False"),
    ({"max_episodes": True}, "max_episodes must be a positive int"),
    ({"model_prices": ["gpt-4o-mini"]}, "model_prices must map model names to prices"),
    ({"budget": 10**400}, "budget is too large"),
])
def test_a_guard_built_with_a_bad_argument_names_it(kwargs, says):
    with pytest.raises((GuardConfigError, InvalidPriceError), match=says):
        _guard(**kwargs)


def test_any_real_number_is_a_price_or_budget():
    from decimal import Decimal
    from fractions import Fraction

    import numpy as np

    guard = _guard(budget=Decimal("2.5"))
    assert guard.budget == 2.5 and type(guard.budget) is float
    for price in (Fraction(1, 2), np.int64(3), np.float32(0.5)):
        assert PricedTool("a", price).price == float(price)
    with pytest.raises(InvalidPriceError, match="sNaN"):  # float() raised a bare ValueError
        PricedTool("a", Decimal("sNaN"))


def test_guard_ledger_reads_a_snapshot_a_thread_id_and_refuses_what_is_not_a_state():
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver

    from intent.testing import ai, call, scripted

    guard = _guard()
    agent = create_agent(scripted([ai(call("a")), AIMessage("done")]),
                         [StructuredTool.from_function(lambda: "a", name="a", description="a")],
                         middleware=[guard.middleware()], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t"}}
    chunks = list(agent.stream({"messages": [("user", "go")]}, config, stream_mode="updates"))
    # graph.get_state(config) (a StateSnapshot) read as a state with no ledger: spent 0
    assert guard.ledger(agent.get_state(config)).spent == 1.0
    # guard.ledger({}, thread) once the thread's run has ended (or for a typo): it said spent 0; now refused
    for thread in ("t", {"configurable": {"thread_id": "t"}}, "no-such-thread"):
        with pytest.raises(GuardConfigError, match="no run of thread .* is going on in this process"):
            guard.ledger({}, thread)
    for extra in ((), (config,), ("t",)):
        with pytest.raises(GuardConfigError, match="got a run config as the state"):
            guard.ledger(config, *extra)  # the config where the state goes: it said spent 0
    fresh = {"configurable": {"thread_id": "never-ran"}}
    assert agent.get_state(fresh).values == {}  # a thread never run: its checkpoint is empty, and spent nothing
    assert (guard.ledger(agent.get_state(fresh)).spent, guard.ledger(agent.get_state(fresh)).budget) == (0.0, 10.0)
    assert guard.ledger({}).budget == 10.0  # no thread: a new thread's ledger
    with pytest.raises(GuardConfigError, match="stream chunk"):
        guard.ledger(next(c for c in chunks if any("intent_ledger" in (v or {}) for v in c.values())))
    with pytest.raises(GuardConfigError, match=r"state\['intent_ledger'\] is a str"):
        guard.ledger({"intent_ledger": "x"})
    for bad in (None, 7):
        with pytest.raises(GuardConfigError, match="top_up needs the thread's config"):
            guard.top_up(bad, 1.0)
    with pytest.raises(GuardConfigError, match="ledger needs the thread's config"):
        guard.ledger({}, 7)


@pytest.mark.parametrize("over", ["tool", "model"])
@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_asking_a_human_without_a_checkpointer_is_a_config_error_naming_the_fix(over, use_async):
    # The run paused at an interrupt nobody could answer: the caller got `__interrupt__` back, and the
    # Command(resume=...) it then sent failed in LangGraph ("Cannot use Command(resume=...) without checkpointer").
    import asyncio

    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage
    from langchain_core.tools import StructuredTool
    from langgraph.checkpoint.memory import InMemorySaver

    from intent import ModelPrice
    from intent.testing import RunCounter, ai, call, scripted

    runs = RunCounter()
    tools = [StructuredTool.from_function(lambda: runs.update(["a"]) or "a", name="a", description="a")]
    prices = {"scripted-model": ModelPrice(input_per_mtok=1e6, output_per_mtok=0.0)} if over == "model" else None

    def agent(**kwargs):
        guard = BudgetGuard(AcceptAll(), Market([PricedTool("a", 5.0 if over == "tool" else 0.0)]), 2.0,
                            on_over_budget="ask", model_prices=prices)
        model = scripted([ai(call("a"), usage=(1, 1)), AIMessage("done", usage_metadata={
            "input_tokens": 1, "output_tokens": 1, "total_tokens": 2})])
        return create_agent(model, tools, middleware=[guard.middleware()], **kwargs)

    inp, config = {"messages": [("user", "go")]}, {"configurable": {"thread_id": "t"}}

    def run(graph):
        return asyncio.run(graph.ainvoke(inp, config)) if use_async else graph.invoke(inp, config)

    with pytest.raises(GuardConfigError, match=r"on_over_budget='ask'.*needs a checkpointer.*checkpointer=InMemorySaver"):
        run(agent())
    assert runs["a"] == 0
    assert run(agent(checkpointer=InMemorySaver()))["__interrupt__"]  # with one, the human is asked


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_a_top_up_written_to_a_graph_without_a_checkpointer_names_the_fix(use_async):
    # It was LangGraph's bare ValueError "No checkpointer set" out of get_state.
    import asyncio

    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage

    from intent.testing import scripted

    guard = _guard()
    agent = create_agent(scripted([AIMessage("done")]), [], middleware=[guard.middleware()])
    config = {"configurable": {"thread_id": "t"}}
    agent.invoke({"messages": [("user", "go")]}, config)
    with pytest.raises(GuardConfigError, match=r"top_up graph= has no checkpointer.*checkpointer=InMemorySaver"):
        asyncio.run(guard.atop_up(config, 1.0, graph=agent)) if use_async else guard.top_up(config, 1.0, graph=agent)


@pytest.mark.parametrize("content", ['{"gpt-4o-mini": {"input_per_mtok": 0.15, "output_per_mtok": 0.6}}', "[]"])
def test_a_price_file_in_another_shape_is_refused_with_the_shape_spelled_out(tmp_path, content):
    # It said "expected {'currency': 'USD', 'models': {name: price}}", leaving what a price is to guess.
    from intent import ModelPrices

    path = tmp_path / "prices.json"
    path.write_text(content)
    with pytest.raises(GuardConfigError, match=r'prices.json: expected .*"models": \{"gpt-4o-mini": \{"input_per_mtok"'):
        ModelPrices.from_file(path)


@pytest.mark.parametrize("make,says", [
    (lambda: __import__("intent.stores").stores.open_store("team.db"), r"unknown store URL 'team.db'; use memory://"),
    (lambda: __import__("intent.stores").stores.open_store(5), r"store URL must be a str.*sqlite:///PATH"),
    (lambda: __import__("intent.stores").stores.period_key("c", "week"), "period must be 'day' or 'month'"),
    (lambda: __import__("intent.stores").stores.period_key("a/b"), "scope 'a/b' must be a non-empty string"),
    (lambda: _guard(store="sqlite:///budgets.db", budget_key="k"), r"got str 'sqlite:///budgets.db'.*open_store\("),
])
def test_a_wrong_store_argument_is_a_usage_error_naming_it(make, says):
    # They were StoreError alone (a RuntimeError: `except ValueError` missed them), open_store(5) a bare
    # AttributeError, and a store URL given as store= was not told to go through open_store.
    from intent.stores import StoreError

    with pytest.raises((UsageError, GuardConfigError), match=says) as raised:
        make()
    assert isinstance(raised.value, (StoreError, GuardConfigError)) and isinstance(raised.value, ValueError)


def test_a_top_up_that_would_make_the_budget_infinite_is_refused():
    from intent.ledger import BudgetLedger

    ledger = BudgetLedger(1e308)
    with pytest.raises(InvalidPriceError, match="makes it infinite"):
        ledger.top_up("t1", 1e308)
    assert ledger.budget == 1e308


@pytest.mark.parametrize("flag,value", [("--epochs", "0"), ("--batch-size", "0"), ("--lr", "-1"),
                                        ("--max-steps", "-1")])
def test_training_numbers_must_be_positive(flag, value, capsys, tmp_path):
    # --epochs 0 exported an untrained predictor and exited 0; --batch-size 0 failed in range().
    with pytest.raises(SystemExit) as raised:
        main(["train", "predictor", "--logs", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o"), flag, value])
    assert raised.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["train", "predictor"], ["train", "worldmodel", "--max-steps", "1"],
                                     ["train", "report"], ["loop"], ["bench", "study", "--quick"]])
def test_an_out_directory_that_is_a_file_is_refused_before_any_work(command, logs, tmp_path, capsys):
    # Was: FileExistsError's traceback; `intent train predictor` only at its export, after the whole training (and
    # with its checkpoint left in OUT.checkpoint).
    taken = tmp_path / "notes.txt"
    taken.write_text("mine\n")
    argv = [*command, "--out", str(taken)] + ([] if command[0] == "bench" else ["--logs", str(logs)])
    assert main(argv) == 2
    assert f"--out {taken} is a file; give a directory to write into" in capsys.readouterr().err
    assert taken.read_text() == "mine\n" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_annotate_refuses_a_directory_as_its_output_file(logs, tmp_path, capsys):
    # Was: IsADirectoryError's traceback.
    assert main(["train", "annotate", "--logs", str(logs), "--out", str(tmp_path)]) == 2
    assert f"--out {tmp_path} is a directory; give the labelled log's file name" in capsys.readouterr().err


def test_a_log_given_as_a_directory_names_the_file_to_pass(tmp_path, capsys):
    from eval.log_summary import main as summary

    with pytest.raises(SystemExit, match=r"is a directory; pass its log file .*logs.jsonl"):
        summary([str(tmp_path)])
    binary = tmp_path / "b.jsonl"
    binary.write_bytes(b"\xb9\x00\xff")
    with pytest.raises(SystemExit, match="is not a text log"):
        summary([str(binary)])


def test_judge_runs_zero_is_refused_not_replaced_by_three(tmp_path, capsys):
    # The CLI copied only truthy options: --judge-runs 0 became the default 3.
    # (on the market where the flag applies: the synthetic markets refuse --judge-runs whatever its value)
    assert main(["bench", "--market", "stabletoolbench", "--judge", "sopr", "--judge-url", "http://127.0.0.1:9/v1",
                 "--judge-model", "m", "--tasks", "1", "--methods", "raw", "--judge-runs", "0", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 2
    assert "--judge-runs is 0" in capsys.readouterr().err


def test_intent_loop_checks_its_agent_before_training(tmp_path):
    # --agent foo was found out at the last stage, after minutes of training.
    from eval.loop import LoopConfig, run_loop

    with pytest.raises(ValueError, match="--agent 'foo'"):
        run_loop(LoopConfig(logs=[str(tmp_path / "x.jsonl")], out=str(tmp_path / "loop"), agent="foo"))
    assert not (tmp_path / "loop").exists()


def test_serve_refuses_a_predictor_and_a_missing_vllm_environment(tmp_path, monkeypatch):
    # It exec'd whatever `python` was on PATH ("No module named 'vllm'"), from a .venv-vllm looked up in the
    # current directory only, and printed a serve command for the predictor's classifier.
    import json

    from training.serve import serve

    predictor = tmp_path / "predictor"
    predictor.mkdir()
    (predictor / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"]}))
    with pytest.raises(ValueError, match="a classifier .*intent serve worldmodel"):
        serve(predictor)
    generator = tmp_path / "worldmodel"
    generator.mkdir()
    (generator / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.delenv("INTENT_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("training.serve.Path.exists", lambda self: self.name == "config.json")
    with pytest.raises(FileNotFoundError, match="scripts/vllm_venv.sh"):
        serve(generator)


@pytest.mark.parametrize("flags,says", [
    (["--judge", "sopr"], "--judge apply to --market stabletoolbench"),
    (["--groups", "G1_tool"], "--groups apply to --market stabletoolbench"),
    (["--base-url", "http://127.0.0.1:9/v1"], "the 'sim' agent is simulated"),
    (["--paired-with", "nope"], "--paired-with nope: not among --methods"),
    (["--quick"], "--quick is the study's"),
    # Each of these was accepted, ignored, and recorded in run_config.json (locking the directory).
    (["--retriever", "minilm"], "--retriever apply to --market stabletoolbench"),
    (["--no-solvability"], "--no-solvability apply to --market stabletoolbench"),
    (["--stb-env-url", "http://x"], "--stb-env-url apply to --market stabletoolbench"),
    (["--stb-env-model", "m"], "--stb-env-model apply to --market stabletoolbench"),
    (["--judge-runs", "5"], "--judge-runs apply to --market stabletoolbench"),
    (["--max-turns", "5"], "--max-turns limits a real LLM agent's"),
    (["--agent", "sim-llm", "--max-turns", "5"], "the 'sim-llm' agent is simulated"),
    (["--market", "stabletoolbench", "--event-rate", "0.5"], "--event-rate 0.5: market events are the synthetic"),
    (["--market", "stabletoolbench", "--judge-runs", "2"], "--judge-runs is the SoPR judge's"),
    # On StableToolBench these were accepted and ignored (schema environment, proxy judge), exit 0:
    (["--market", "stabletoolbench", "--stb-env-url", "http://127.0.0.1:9/v1"], "--stb-env-url is the mirror"),
    (["--market", "stabletoolbench", "--stb-env-model", "m"], "--stb-env-model is the mirror"),
    (["--market", "stabletoolbench", "--judge-url", "http://127.0.0.1:9/v1"], "--judge-url is the SoPR judge's"),
    (["--market", "stabletoolbench", "--judge-model", "m"], "--judge-model is the SoPR judge's"),
    (["--market", "stabletoolbench", "--stb-env", "server", "--stb-env-url", "http://127.0.0.1:9",
      "--stb-env-model", "m"], "--stb-env-model is the mirror"),
    # Run every query of the group twice (122 episodes for 61 queries) and change --tasks' subset:
    (["--market", "stabletoolbench", "--groups", "G3_instruction,G3_instruction"],
     "--groups names G3_instruction more than once"),
    (["--market", "stabletoolbench", "--groups", "G9_x"], "--groups: unknown group(s) ['G9_x']"),
    (["--encoder-epochs", "2"], "--encoder-epochs trains the encoder predictor"),
    # The planning oracles' flags with no planning oracle among --methods (raw):
    (["--world-model", "replay"], "--world-model shape the planning oracles"),
    (["--max-depth", "3", "--gamma", "0.4"], "--max-depth, --gamma shape the planning oracles"),
    (["--predictor-dir", "p"], "--predictor-dir shape the planning oracles"),
    # (with a served model's agent, which the flag is for: a simulated one is refused for writing no tokens)
    (["--agent", "openai:m", "--base-url", "http://127.0.0.1:9/v1", "--rollout-max-tokens", "64"],
     "--rollout-max-tokens shape the planning oracles"),
    (["--oracle-tasks", "5"], "--oracle-tasks feed the methods built from logs"),
    (["--methods", "raw,tracker,optimal", "--oracle-logs", "l.jsonl"], "--methods raw,tracker,optimal runs none"),
])
def test_a_flag_this_comparison_would_ignore_is_refused(flags, says, tmp_path, capsys):
    # Each was dropped without a word (and --paired-with foo also dropped the default paired table).
    assert main(["bench", "--tasks", "1", "--methods", "raw", "--no-progress", "--out", str(tmp_path / "r"),
                 *flags]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("argv,says", [
    (["eval.bench_throughput", "--workers", "0"], "every worker count must be >= 1"),
    (["eval.bench_throughput", "--methods", "foo"], "unknown ['foo']"),
    (["eval.bench_stores", "--procs", "0"], "argument --procs: must be an integer >= 1"),
])
def test_bench_commands_name_a_bad_flag(argv, says, capsys):
    # Each was a ValueError traceback (max() of an empty sequence, an unknown method deep in the runner).
    import importlib

    with pytest.raises(SystemExit) as raised:
        importlib.import_module(argv[0]).main(argv[1:])
    assert raised.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("bug", [lambda: max([]), lambda: _raise(ValueError("bug"))],
                         ids=["out-of-an-expression", "raised-on-purpose"])
def test_a_plain_value_error_is_a_bug_with_its_traceback(bug, monkeypatch, capsys):
    # The CLI printed one line for a ValueError whose last traceback line started with `raise`, so a bug that
    # raises ValueError on purpose read as a user mistake. Only an IntentError (a UsageError for the user's
    # input) gets one line now; any plain ValueError propagates with its traceback.
    import eval.cli

    monkeypatch.setattr(eval.cli, "_bench", lambda args: bug())
    with pytest.raises(ValueError) as raised:
        main(["bench", "--methods", "raw"])
    assert not isinstance(raised.value, IntentError)
    assert "error:" not in capsys.readouterr().err


def test_a_usage_error_is_one_line_and_exit_2(monkeypatch, capsys):
    import eval.cli

    def wrong_input(args):
        raise UsageError("--tasks is 0; give 1 or more")

    monkeypatch.setattr(eval.cli, "_bench", wrong_input)
    assert main(["bench", "--methods", "raw"]) == 2
    assert capsys.readouterr().err == "intent bench: error: --tasks is 0; give 1 or more\n"


def test_the_harness_errors_about_user_data_are_usage_errors(tmp_path, capsys):
    # StbDataError, EndpointError, ResultsFormatError, PromptDoesNotFitError name a path, a URL or a setting the
    # user gave: one line, like before (they were ValueErrors caught by the "raised on purpose" heuristic).
    from eval.agents.chat import EndpointError
    from eval.agents.context_full import PromptDoesNotFitError
    from eval.results import ResultsFormatError
    from eval.stabletoolbench.loader import StbDataError

    assert all(issubclass(cls, UsageError) and issubclass(cls, ValueError)
               for cls in (EndpointError, PromptDoesNotFitError, ResultsFormatError, StbDataError))
    assert main(["bench", "--market", "stabletoolbench", "--stb-path", str(tmp_path / "none"), "--tasks", "1",
                 "--methods", "raw", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    assert "StableToolBench data not found" in capsys.readouterr().err


# The plain `raise ValueError(...)` left in the packages: each is a programming error (an embedder returning
# the wrong shape, a model's reply retried in place), not the user's input. A new one must be one of those,
# or a UsageError naming the input and the fix.
_PLAIN_VALUE_ERRORS = {("baselines/embeddings.py", "l2_normalize"), ("baselines/btp/experience.py", "estimate"),
                       ("eval/stabletoolbench/retrieval.py", "encode_batched"), ("eval/judges.py", "_ask")}


def test_every_value_error_raised_on_purpose_is_a_usage_error_or_a_known_bug_check():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = set()
    for package in ("intent", "eval", "training", "baselines", "worldmodel", "intent_vllm"):
        for path in sorted((root / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for func in ast.walk(tree):
                if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(func):
                    if (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                            and getattr(node.exc.func, "id", None) == "ValueError"):
                        found.add((path.relative_to(root).as_posix(), func.name))
    assert found == _PLAIN_VALUE_ERRORS


def _raise(exc: BaseException):
    raise exc


@pytest.mark.parametrize("flags", [["--predictor", "encoder", "--methods", "intent"],
                                   ["--predictor", "auto", "--methods", "raw,intent"], ["--methods", "intent-minilm"]])
def test_encoder_epochs_is_accepted_where_the_encoder_is_trained(flags):
    import argparse

    from eval.cli import _refuse_flags_that_do_not_apply, register

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    args = sub.choices["bench"].parse_args(["--encoder-epochs", "1", *flags])
    _refuse_flags_that_do_not_apply(args, [m for m in args.methods.split(",")])  # no error


@pytest.mark.parametrize(("flags", "said"), [(["--max-turns", "5"], "--max-turns limits a real LLM agent's"),
                                             (["--max-tokens", "64"], "--base-url and --max-tokens are a served model's"),
                                             (["--base-url", "http://127.0.0.1:9/v1"], "--base-url and --max-tokens")])
def test_the_study_refuses_a_served_models_flags_with_a_simulated_agent(tmp_path, capsys, flags, said):
    # --max-tokens and --base-url were taken by the study (and ignored by the simulated agent), though the one
    # comparison (intent bench run) refuses them.
    assert main(["bench", "study", "--quick", *flags, "--out", str(tmp_path / "s")]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("typed,meant", [("MCO", "mco"), ("Intent", "intent"), ("intnet", "intent"),
                                         ("trakcer", "tracker")])
def test_a_near_miss_method_name_is_named(typed, meant, tmp_path, capsys):
    # `--methods MCO` (the paper's spelling) was refused with the whole list only; names are matched exactly
    # (they name result rows and files), so the error names the method the user meant.
    assert main(["bench", "--tasks", "1", "--methods", typed, "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert f"unknown method {typed!r}; did you mean {meant!r}?" in err
    assert not (tmp_path / "r").exists()


def test_a_name_far_from_every_method_gets_no_guess(tmp_path, capsys):
    assert main(["bench", "--tasks", "1", "--methods", "zzz", "--no-progress", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "unknown method 'zzz'" in err and "did you mean" not in err and "Choose from" in err


def test_the_librarys_input_errors_are_usage_errors_so_the_cli_prints_one_line(tmp_path, capsys):
    # The README: "a wrong input ... is a UsageError". A bad market, guard argument or log line was an
    # IntentError and a ValueError but no UsageError, so `except UsageError` missed them.
    from intent import GuardConfigError, Market, MarketError, PricedTool
    from intent.errors import LogFormatError
    from intent.market import InvalidPriceError, UnpricedToolError

    for cls in (MarketError, InvalidPriceError, UnpricedToolError, GuardConfigError, LogFormatError):
        assert issubclass(cls, UsageError) and issubclass(cls, ValueError), cls
    assert issubclass(UnpricedToolError, KeyError) and issubclass(GuardConfigError, TypeError)  # as before
    with pytest.raises(UsageError, match="price"):
        Market([PricedTool("t", -1.0)])
    log = tmp_path / "log.jsonl"
    log.write_text('{"not": "a step record"}\n')
    assert main(["report", str(log)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("intent report: error: ") and err.count("\n") == 1


def test_a_demo_budget_that_is_not_a_positive_number_names_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--budget", "-5"])
    assert exc.value.code == 2
    assert "argument --budget: must be a number > 0, got -5.0" in capsys.readouterr().err
