"""A run directory records the code that wrote its episodes, and a resume by other code is refused unless told.

A resumed run keeps the episodes a directory holds and runs only the missing ones, so a fix re-run into the same
``--out`` reported the old code's episodes as its own (it happened: a market v2 re-run after a change to INTENT's
last-call cache took 8 s and printed the earlier table).
"""

from __future__ import annotations

import json
import subprocess

import pytest

import eval.code_version as code_version_module
import eval.runner as runner
from eval.runner import BenchConfig, run_benchmark
from intent.errors import UsageError


def _config(out, **options):
    return BenchConfig(tasks=2, methods=["raw"], out=str(out), reference="raw", options=options)


def test_a_run_directory_made_by_other_code_is_refused_unless_allowed(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "code_version", lambda: "aaaa")
    run_benchmark(_config(out), progress=False)
    assert json.loads((out / "run_config.json").read_text())["code"] == ["aaaa"]
    run_benchmark(_config(out), progress=False)  # the same code resumes
    monkeypatch.setattr(runner, "code_version", lambda: "bbbb+1234")
    with pytest.raises(UsageError, match=r"episodes made by other code \(aaaa; this is bbbb\+1234\).*--allow-code-change"):
        run_benchmark(_config(out), progress=False)
    run_benchmark(_config(out, allow_code_change=True), progress=False)
    assert json.loads((out / "run_config.json").read_text())["code"] == ["aaaa", "bbbb+1234"]
    run_benchmark(_config(out), progress=False)  # now the latest code that wrote it
    monkeypatch.setattr(runner, "code_version", lambda: "aaaa")
    with pytest.raises(UsageError, match="other code"):
        run_benchmark(_config(out), progress=False)


def test_a_run_directory_from_before_the_code_was_recorded_is_refused_unless_allowed(tmp_path, monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setattr(runner, "code_version", lambda: "aaaa")
    run_benchmark(_config(out), progress=False)
    recorded = json.loads((out / "run_config.json").read_text())
    del recorded["code"]
    (out / "run_config.json").write_text(json.dumps(recorded))
    with pytest.raises(UsageError, match="code older than this check, not recorded"):
        run_benchmark(_config(out), progress=False)
    run_benchmark(_config(out, allow_code_change=True), progress=False)
    assert json.loads((out / "run_config.json").read_text())["code"] == ["unrecorded", "aaaa"]


def test_the_cli_flag_reaches_the_run(tmp_path, monkeypatch):
    from intent.cli import main

    out = tmp_path / "run"
    monkeypatch.setattr(runner, "code_version", lambda: "aaaa")
    args = ["bench", "--tasks", "2", "--methods", "raw", "--no-progress", "--out", str(out)]
    assert main(args) == 0
    monkeypatch.setattr(runner, "code_version", lambda: "cccc")
    assert main(args) == 2  # a UsageError: one line, exit 2
    assert main([*args, "--allow-code-change"]) == 0


def _git(root, *args):
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def test_the_code_version_is_the_commit_with_a_digest_of_uncommitted_source_changes(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    (root / "intent").mkdir(parents=True)
    (root / "intent" / "a.py").write_text("x = 1\n")
    (root / "README.md").write_text("docs\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    monkeypatch.setattr(code_version_module, "ROOT", root)

    def version():
        code_version_module.code_version.cache_clear()
        return code_version_module.code_version()

    clean = version()
    assert len(clean) == 12 and "+" not in clean
    (root / "README.md").write_text("other docs\n")
    assert version() == clean  # docs do not shape results
    (root / "intent" / "a.py").write_text("x = 2\n")
    edited = version()
    assert edited.startswith(clean + "+")
    (root / "intent" / "a.py").write_text("x = 3\n")
    assert version() not in (edited, clean)  # another edit, another digest
    (root / "intent" / "a.py").write_text("x = 1\n")
    (root / "intent" / "new.py").write_text("y = 1\n")
    assert version().startswith(clean + "+")  # an untracked source file counts too
    monkeypatch.setattr(code_version_module, "ROOT", tmp_path / "not-a-checkout")
    assert version().startswith("intent ")  # the installed package's version
    code_version_module.code_version.cache_clear()


def _repo(root):
    (root / "intent").mkdir(parents=True)
    (root / "intent" / "a.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(root, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")


def _version_at(root, monkeypatch):
    monkeypatch.setattr(code_version_module, "ROOT", root)
    code_version_module.code_version.cache_clear()
    try:
        return code_version_module.code_version()
    finally:
        code_version_module.code_version.cache_clear()


def test_untracked_sources_with_a_space_or_a_non_ascii_name_count(tmp_path, monkeypatch):
    # (Review: `git ls-files` split at whitespace made every run crash on "intent/a copy.py", and its quoting of
    # "café.py" hid that file, so a resume by other code went through.)
    root = tmp_path / "checkout"
    _repo(root)
    clean = _version_at(root, monkeypatch)
    (root / "intent" / "a copy.py").write_text("x = 2\n")
    spaced = _version_at(root, monkeypatch)
    assert spaced.startswith(clean + "+")
    (root / "intent" / "a copy.py").unlink()
    (root / "intent" / "caf\u00e9.py").write_text("x = 2\n")
    assert _version_at(root, monkeypatch) not in (clean, spaced)


def test_an_install_inside_another_projects_repository_reports_the_package_version(tmp_path, monkeypatch):
    # A venv kept (and git-ignored) inside the user's own project: that project's commit says nothing of intent's
    # code (every commit of theirs refused a resume, and an upgrade of intent never did).
    project = tmp_path / "project"
    project.mkdir()
    (project / ".gitignore").write_text(".venv/\n")
    (project / "app.py").write_text("print(1)\n")
    _git(project, "init", "-q")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(project, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    site = project / ".venv" / "lib" / "site-packages"
    (site / "intent").mkdir(parents=True)
    (site / "intent" / "guard.py").write_text("x = 1\n")
    assert _version_at(site, monkeypatch).startswith("intent ")


def test_llm_bench_and_the_loop_take_the_flag_their_refusal_names(tmp_path, monkeypatch):
    # (Review: scripts/bench_llm.sh and intent loop resume run directories, and the refusal told the user to pass
    # --allow-code-change, which neither accepted.)
    from eval.agents import llm_bench
    from eval.loop import _bench, LoopConfig

    import eval.agents.chat as chat

    class Reached(Exception):
        pass

    def run_benchmark(config, progress=True, **kw):
        raise Reached(config.options)  # the run's options, as the run would get them

    monkeypatch.setattr(runner, "run_benchmark", run_benchmark)
    monkeypatch.setattr(chat, "check_model", lambda *a, **k: None)  # no server here: the options are what is checked
    with pytest.raises(Reached) as reached:
        llm_bench.main(["--base-url", "http://127.0.0.1:9/v1", "--model", "m", "--markets", "synthetic",
                        "--allow-code-change", "--no-progress", "--out", str(tmp_path / "llm")])
    assert reached.value.args[0].get("allow_code_change") is True
    cfg = LoopConfig(logs=["x"], out=str(tmp_path / "loop"), allow_code_change=True)
    with pytest.raises(Reached) as reached:
        _bench(cfg, tmp_path / "bench", tmp_path / "labelled.jsonl", tmp_path / "pred", {"chosen": "hashed"},
               tmp_path / "wm")
    assert reached.value.args[0].get("allow_code_change") is True


def test_intent_loop_parses_the_flag(tmp_path, capsys):
    from intent.cli import main

    try:
        main(["loop", "--logs", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "loop"), "--allow-code-change"])
    except SystemExit:
        pass  # the missing logs stop it; the flag must have been parsed first
    assert "unrecognized arguments" not in capsys.readouterr().err
