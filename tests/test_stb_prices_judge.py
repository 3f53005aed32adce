"""Seeded prices, the proxy judge and SoPR aggregation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eval.stabletoolbench import (
    PROXY_LABEL,
    StbApi,
    answer_given,
    assign_prices,
    price_meta,
    proxy_pass,
    read_prices,
    sopr_aggregate,
    write_prices,
)

NAMES = [f"api_{i}_for_tool_{i % 7}" for i in range(300)]


def test_prices_deterministic_and_order_independent() -> None:
    a = assign_prices(NAMES, seed=3)
    shuffled = NAMES[:]
    random.Random(0).shuffle(shuffled)
    assert assign_prices(shuffled, seed=3) == a
    assert assign_prices(NAMES + NAMES[:10], seed=3) == a  # duplicates collapse
    assert assign_prices(NAMES, seed=4) != a
    assert list(a) == sorted(NAMES)


def test_prices_range() -> None:
    a = assign_prices(NAMES, seed=0)
    assert all(isinstance(v, int) and 5 <= v <= 50 for v in a.values())
    assert min(a.values()) == 5 and max(a.values()) == 50  # 300 draws cover the ends
    b = assign_prices(NAMES, seed=0, low=1, high=3)
    assert set(b.values()) == {1, 2, 3}
    assert set(assign_prices(NAMES, seed=0, low=7, high=7).values()) == {7}


def test_prices_accept_apis() -> None:
    api = StbApi("Data", "My Tool", "Get Thing", "", (), ())
    assert list(assign_prices([api, "other_for_x"], seed=1)) == ["get_thing_for_my_tool", "other_for_x"]


@pytest.mark.parametrize(
    ("seed", "low", "high"),
    [(1.5, 5, 50), ("1", 5, 50), (True, 5, 50), (1, 0, 50), (1, 51, 50), (1, 5.0, 50), (1, -3, 2)],
)
def test_prices_bad_args(seed, low, high) -> None:
    with pytest.raises(ValueError):
        assign_prices(NAMES, seed=seed, low=low, high=high)


def test_prices_file_roundtrip(tmp_path: Path) -> None:
    prices = assign_prices(NAMES, seed=11)
    path = write_prices(tmp_path / "sub" / "prices.json", prices, price_meta(11))
    pf = read_prices(path)
    assert pf.prices == prices
    assert pf.meta["seed"] == 11 and pf.meta["range"] == [5, 50] and pf.meta["budget"] == 50
    raw = json.loads(path.read_text())
    raw["prices"][NAMES[0]] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="expected an integer in"):
        read_prices(path)


def test_prices_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="missing"):
        write_prices(tmp_path / "p.json", {"a": 5}, {"seed": 1})
    with pytest.raises(ValueError, match="not found"):
        read_prices(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="malformed"):
        read_prices(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        price_meta(1, budget=0)


# ------------------------------------------------------------------ proxy judge


def test_answer_given() -> None:
    assert not answer_given(None)
    assert not answer_given("   ")
    assert not answer_given('{"return_type": "give_up_and_restart"}')
    assert not answer_given('{"return_type": "give_answer", "final_answer": ""}')
    assert answer_given('{"return_type": "give_answer", "final_answer": "It is 42."}')
    assert answer_given("It is 42.")


def test_proxy_pass() -> None:
    rel = ["a_for_t", "b_for_t"]
    assert proxy_pass("answer", rel, ["a_for_t", "b_for_t", "c_for_t"])
    assert not proxy_pass("answer", rel, ["a_for_t"])
    assert not proxy_pass(None, rel, rel)
    assert not proxy_pass("", rel, rel)
    assert not proxy_pass('{"return_type": "give_up_and_restart", "final_answer": ""}', rel, rel)
    assert proxy_pass("answer", [], [])
    assert "not SoPR" in PROXY_LABEL


def test_sopr_aggregate() -> None:
    runs = [["Solved", "Unsure", "Unsolved", "Solved"], ["Solved", "Solved", "Unsolved", "Unsolved"]]
    mean, std = sopr_aggregate(runs)
    assert mean == pytest.approx(56.25) and std == pytest.approx(6.25)
    mean, std = sopr_aggregate([["AnswerStatus.Solved", "AnswerStatus.Unsure"]] * 3)
    assert mean == pytest.approx(75.0) and std == pytest.approx(0.0)
    with pytest.raises(ValueError):
        sopr_aggregate([["Maybe"]])
    with pytest.raises(ValueError):
        sopr_aggregate([])
