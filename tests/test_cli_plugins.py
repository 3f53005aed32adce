"""`intent`'s subcommands beyond demo, report and store come from the entry-point group ``intent.commands``.

intent.cli names no package above it; the commands of eval (bench, compare, seeds, loop, probe) and training
(train, serve) register themselves through ``[project.entry-points."intent.commands"]`` in pyproject.toml.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import intent.cli as cli

REPO = Path(__file__).resolve().parents[1]
BUILT_IN = {"demo", "report", "store"}
PROJECT_COMMANDS = {"bench", "compare", "seeds", "loop", "probe", "train", "serve"}


def _commands(parser) -> set[str]:
    sub = next(a for a in parser._actions if a.dest == "command")
    return set(sub.choices)


def _declared() -> dict[str, str]:
    with (REPO / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)["project"]["entry-points"][cli.COMMANDS_GROUP]


def test_the_project_declares_its_commands_as_entry_points():
    assert _declared() == {"eval": "eval.cli:register", "training": "training.cli:register"}


def test_a_source_checkout_has_every_command():
    # This tree's pyproject.toml is read even when the installed metadata predates the group.
    assert _commands(cli.build_parser()) == BUILT_IN | PROJECT_COMMANDS


def test_installed_metadata_alone_gives_the_same_commands(monkeypatch):
    """An installed wheel: no source tree beside the package, the entry points of the metadata."""
    eps = md.EntryPoints(md.EntryPoint(name, value, cli.COMMANDS_GROUP) for name, value in _declared().items())
    monkeypatch.setattr(cli, "_source_tree_commands", lambda: None)
    monkeypatch.setattr(md, "entry_points", lambda **kw: eps.select(**kw))
    assert _commands(cli.build_parser()) == BUILT_IN | PROJECT_COMMANDS


def test_metadata_without_the_group_says_to_reinstall(monkeypatch, capsys):
    """An install whose metadata predates ``intent.commands`` (and no source table): one line naming the fix,
    and never a fallback that imports eval by name."""
    monkeypatch.setattr(cli, "_source_tree_commands", lambda: None)
    monkeypatch.setattr(md, "entry_points", lambda **kw: md.EntryPoints(()))
    assert cli.main(["bench", "--tasks", "2"]) == 2
    err = capsys.readouterr().err
    assert "no command 'bench'" in err and "re-run `make install`" in err and "intent.commands" in err
    assert _commands(cli.build_parser()) == BUILT_IN  # the built-in commands still work
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    assert "--budget" in capsys.readouterr().out


def test_a_plugin_whose_package_is_absent_is_skipped_and_a_broken_one_is_not(monkeypatch):
    monkeypatch.setattr(cli, "_source_tree_commands", lambda: {"gone": "no_such_package.cli:register"})
    monkeypatch.setattr(md, "entry_points", lambda **kw: md.EntryPoints(()))
    assert cli._extensions() == []
    monkeypatch.setattr(cli, "_source_tree_commands", lambda: {"broken": "intent.cli:no_such_function"})
    with pytest.raises(AttributeError):
        cli._extensions()


def test_python_m_intent_cli_from_a_checkout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for argv in (["bench", "--help"], ["train", "predictor", "--help"], ["serve", "worldmodel", "--help"]):
        done = subprocess.run([sys.executable, "-m", "intent.cli", *argv], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"usage: intent {' '.join(argv[:-1])}")


def test_every_option_of_every_command_says_what_it_is_in_its_help():
    # `intent train annotate --help` listed --method, --votes, --judge-url... with no word on what they are
    # or their defaults; so did bench's --workers, --seed, --out and serve's dir, --host, --port.
    import argparse

    def parsers(parser, path):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from parsers(child, f"{path} {name}")

    bare = [f"{path} {action.option_strings[-1] if action.option_strings else action.dest}"
            for path, parser in parsers(cli.build_parser(), "intent") for action in parser._actions
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and not action.help]
    assert bare == []
