"""One reader of the guard's JSONL logs and one extraction of a call's label z, used everywhere."""

from __future__ import annotations

import json
import math

import pytest

from baselines.btp.experience import ExperienceStore
from intent.logs import JsonlLogSink, LogFormatError, StepRecord, label_of, read_log, read_log_rows


def rec(i: int, **extra) -> StepRecord:
    return StepRecord(task_id="t1", step=i, call_id=f"c{i}", query="weather in oslo", tool="w", decision="accept",
                      status="ok", spent=0.0, remaining=10.0, budget=10.0, observation="5C", **extra)


# ------------------------------------------------------------------------------------ label z
@pytest.mark.parametrize("record,z", [
    ({"artifact": {"z": 1}}, 1),
    ({"artifact": {"z": 0}}, 0),
    ({"z": "0", "artifact": {"z": 1}}, 0),  # the annotation wins over the environment's label
    ({"useful": True, "z": 0}, 1),  # BTP's name for the annotation comes first
    ({"z": "false"}, 0),
    ({"z": "yes"}, 1),
    ({"z": 1.0}, 1),
    ({"z": math.nan, "artifact": {"z": 0}}, 0),  # NaN: an empty cell, i.e. unlabelled
    ({"artifact": None}, None),
    ({"artifact": {"satisfied": []}}, None),
    ({}, None),
])
def test_label_of_reads_the_annotation_then_the_ground_truth(record, z):
    assert label_of(record) == z


def test_label_of_reads_step_records_and_their_extra_fields():
    assert label_of(rec(0, artifact={"z": 1})) == 1
    assert label_of(rec(1, z=0, artifact={"z": 1})) == 0  # extra field from `intent train annotate`
    assert label_of(rec(2, z=0, artifact={"z": 1}), ground_truth_only=True) == 1
    assert label_of(rec(3)) is None


@pytest.mark.parametrize("record,field", [
    ({"z": "maybe"}, "z"), ({"useful": 2}, "useful"), ({"artifact": {"z": [1]}}, r"artifact\['z'\]"),
    ({"artifact": "z=1"}, "artifact"),
])
def test_an_unreadable_label_is_an_error_naming_the_field(record, field):
    with pytest.raises(LogFormatError, match=field):
        label_of(record)


def test_every_consumer_uses_the_one_label_function():
    """The string "0" is a 0 for all of them (the world model's old copy read it as 1, and
    BTP's old copy read "maybe" as unlabelled): one function, one answer."""
    import training.data
    from worldmodel.predictors import HashedLogisticPredictor  # noqa: F401 - imports replay's label_of
    from worldmodel.replay import label_of as replay_label_of

    records = [{"z": "0", "artifact": {"z": 1}}, {"useful": "1"}, {"artifact": {"z": True}}, {"z": None}]
    assert replay_label_of is label_of  # a name kept for importers, not a second wrapper
    assert [replay_label_of(r) for r in records] == [label_of(r) for r in records] == [0, 1, 1, None]
    assert training.data.triples.__defaults__[0] is label_of
    with pytest.raises(LogFormatError, match="z='maybe'"):
        replay_label_of({"z": "maybe"})
    rows = [{"task_id": "t", "query": "q", "tool": "a", "decision": "accept", "status": "ok", **r} for r in records]
    store = ExperienceStore.from_records(rows)
    assert sorted(u.useful for u in store.usages) == [0, 1, 1]
    with pytest.raises(LogFormatError, match="z='maybe'"):
        ExperienceStore.from_records([{**rows[0], "z": "maybe"}])


def test_annotate_ground_truth_reads_the_environment_label_only(tmp_path):
    from training.annotate import annotate

    records = [rec(0, artifact={"z": 1}, z=0), rec(1, artifact={"z": 0}), rec(2)]
    counts = annotate(records, tmp_path / "z.jsonl")
    assert counts == {"labelled": 2, "unlabelled": 1}
    assert [r.get("z") for r in read_log_rows(tmp_path / "z.jsonl")] == [1, 0, None]


# ------------------------------------------------------------------------------------ reader
def test_btp_reads_guard_logs_through_the_one_reader_and_its_schema_check(tmp_path):
    path = tmp_path / "logs.jsonl"
    sink = JsonlLogSink(path)
    sink.write(rec(0, artifact={"z": 1}))
    sink.write(rec(1, artifact={"z": 0}))
    assert [u.useful for u in ExperienceStore.from_jsonl(path).usages] == [1, 0]
    assert [r.call_id for r in read_log(path)] == ["c0", "c1"]

    future = json.loads(rec(2, artifact={"z": 1}).model_dump_json()) | {"schema_version": 99}
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(future) + "\n")
    # A log written by another version of intent is refused by every reader, BTP's included,
    # with the file and line; never misread.
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:3: schema_version 99"):
        ExperienceStore.from_jsonl(path)
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:3: schema_version 99"):
        list(read_log(path))


def test_read_log_rows_accepts_hand_made_records_only_when_asked(tmp_path):
    path = tmp_path / "hand.jsonl"
    path.write_text('{"task_id": "t", "tool": "a", "useful": 1}\n\n{"schema_version": 2, "tool": "b"}\n')
    assert [r["tool"] for r in read_log_rows(path, require_version=False)] == ["a", "b"]
    with pytest.raises(LogFormatError, match=r"hand\.jsonl:1: not a guard log record \(no schema_version"):
        list(read_log_rows(path))
    path.write_text('{"schema_version": 2}\n[1]\n')
    with pytest.raises(LogFormatError, match=r"hand\.jsonl:2: expected a JSON object"):
        list(read_log_rows(path, require_version=False))
    path.write_text('{"schema_version": 2}\n{"torn')
    assert len(list(read_log_rows(path))) == 1  # a torn last line (a crash mid-write) is skipped
    with pytest.raises(LogFormatError, match=r"hand\.jsonl:2: not valid JSON"):
        list(read_log_rows(path, skip_torn_tail=False))


def test_a_complete_bad_last_line_is_an_error_not_a_torn_write(tmp_path):
    # Was: any unparsable last line was dropped as a torn write, also one ending in its newline (a complete
    # line: JsonlLogSink writes record and newline at once, so a crash cannot leave that).
    good = json.dumps({"schema_version": 2, "task_id": "t"})
    path = tmp_path / "logs.jsonl"
    path.write_text(f"{good}\nhello world\n")
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:2: not valid JSON"):
        list(read_log_rows(path))
    path.write_text("hello world\n")
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:1: not valid JSON"):
        list(read_log_rows(path))
    path.write_text(f"{good}\nhello world\n\n")  # trailing blank lines do not make it a torn write either
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:2: not valid JSON"):
        list(read_log_rows(path))
    path.write_text(f"{good}\n{good[:9]}")  # no newline at the end: torn, skipped
    assert len(list(read_log_rows(path))) == 1


def test_read_log_names_the_field_of_an_invalid_record(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"schema_version": 2, "task_id": "t"}) + "\n")
    with pytest.raises(LogFormatError, match=r"(?s)bad\.jsonl:1: not a StepRecord.*\nstep\n"):
        list(read_log(path))


def test_a_record_holding_unicode_line_separators_reads_back(tmp_path):
    # Was: the reader cut lines with str.splitlines, which also splits at U+2028, \x1c, \x85 ...: a tool
    # observation holding one made the whole log unreadable ("not valid JSON ... Unterminated string").
    path = tmp_path / "logs.jsonl"
    sink = JsonlLogSink(path)
    for obs in ("a\u2028b", "c\x1cd\x85e\u2029f", "crlf\r\nin text"):
        sink.write(StepRecord(task_id="t", step=0, call_id="c", tool="a", decision="accept", status="ok", spent=1.0,
                              remaining=1.0, budget=2.0, observation=obs))
    assert [r.observation for r in read_log(path)] == ["a\u2028b", "c\x1cd\x85e\u2029f", "crlf\r\nin text"]
    path.write_text(path.read_text().replace("\n", "\r\n"))  # a log whose lines end in CRLF still reads
    assert len(list(read_log(path))) == 3


def test_a_log_is_read_a_record_at_a_time(tmp_path):
    # Was: the whole file was read and parsed before the first record came back, so a production log larger
    # than memory could not be read, and a consumer that stops early paid for all of it. A corrupt line
    # later in the file now stops the reader only when it gets there.
    path = tmp_path / "logs.jsonl"
    sink = JsonlLogSink(path)
    for i in range(3):
        sink.write(rec(i))
    with path.open("a", encoding="utf-8") as fh:
        fh.write("not json\n")
    records = read_log(path)
    assert [next(records).step for _ in range(3)] == [0, 1, 2]
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:4: not valid JSON"):
        next(records)


def test_a_write_torn_inside_a_utf8_character_is_a_torn_tail(tmp_path):
    # Was: a crash in the middle of a record holding "é" (JsonlLogSink writes UTF-8) left bytes that are not
    # UTF-8 at the end, and the whole log was refused as "not a text log" instead of its torn last line skipped.
    path = tmp_path / "logs.jsonl"
    JsonlLogSink(path).write(rec(0))
    whole = (rec(1, reasoning="café").model_dump_json() + "\n").encode("utf-8")
    cut = whole.index("é".encode()) + 1  # between the two bytes of "é"
    with path.open("ab") as fh:
        fh.write(whole[:cut])
    assert [r.step for r in read_log(path)] == [0]
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:2: .* is not a text log"):
        list(read_log(path, skip_torn_tail=False))
    # Bytes that are not UTF-8 anywhere else are not a torn write: the file is not a log.
    path.write_bytes(whole[:cut] + b"\n" + whole)
    with pytest.raises(LogFormatError, match=r"logs\.jsonl:1: .* is not a text log"):
        list(read_log(path))
    path.write_bytes(b"\xb9\x00\xff")
    with pytest.raises(LogFormatError, match=r"is not a text log"):
        list(read_log(path))
