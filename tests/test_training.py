"""Training: datasets and splits, annotation, one tiny step of each trainer, export and reload."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fakes import count_open_progress, judge_server

from intent.feedback import without_result_note
from intent.logs import LogFormatError, read_log_rows
from training.data import load_records, pairs, parse_fraction, split_by_task, subsample, triples

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def test_datasets_and_task_disjoint_split(logs):
    records = load_records(logs)
    tri, prs = triples(records), pairs(records)
    assert tri and len(prs) >= len(tri) and {t.z for t in tri} == {0, 1}
    assert all(p.z == 1 for p in pairs(records, only_z=1))
    splits, manifest = split_by_task(tri, seed=3)
    tasks = {k: {t.task_id for t in v} for k, v in splits.items()}
    assert not (tasks["train"] & tasks["dev"]) and not (tasks["train"] & tasks["test"]) and not (tasks["dev"] & tasks["test"])
    assert sum(manifest["sizes"].values()) == len(tri)
    assert split_by_task(tri, seed=3)[1] == manifest  # seeded
    assert parse_fraction("1/32") == 1 / 32 and len({t.task_id for t in subsample(tri, 0.25, seed=0)}) < len(tasks["train"])
    with pytest.raises(ValueError, match="fraction"):
        parse_fraction("2")


def test_malformed_and_empty_logs_name_the_file(tmp_path):
    from intent.logs import StepRecord

    good = StepRecord(task_id="t", step=0, call_id="c", tool="a", decision="accept", status="ok", spent=1.0,
                      remaining=1.0, budget=2.0).model_dump_json()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{good}\n{{oops\n{good}\n")  # a torn line in the middle: not skipped
    with pytest.raises(LogFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        load_records(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(LogFormatError, match="no executed"):
        load_records(empty)


def test_annotate_ground_truth_and_llm_judge(logs, tmp_path):
    from training.annotate import LLMJudge, annotate

    counts = annotate(load_records(logs), tmp_path / "z.jsonl")
    assert counts["labelled"] > 0
    rows = list(read_log_rows(tmp_path / "z.jsonl"))
    assert any(r.get("z") == 1 for r in rows) and any(r.get("z") == 0 for r in rows)

    class Judge(BaseHTTPRequestHandler):
        n = 0

        def log_message(self, *a):
            pass

        def _send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"data": [{"id": "j"}]})

        def do_POST(self):
            type(self).n += 1
            self.rfile.read(int(self.headers["Content-Length"]))
            answer = "NO" if type(self).n % 3 == 0 else "YES, it did"  # votes: YES, YES, NO -> YES
            self._send({"choices": [{"message": {"content": answer}}]})

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        judge = LLMJudge(f"http://127.0.0.1:{srv.server_address[1]}/v1", "j", votes=3)
        record = next(r for r in load_records(logs) if r.decision == "accept")
        assert judge.label(record) == 1 and Judge.n == 3
    finally:
        srv.shutdown()
    with pytest.raises(ValueError, match="odd"):
        LLMJudge("http://127.0.0.1:9/v1", "j", votes=2)


@pytest.mark.ml
def test_a_directory_without_calibration_is_not_taken_for_a_trained_predictor(tmp_path):
    # A base encoder's directory loaded with an untrained head and temperature 1 (p about 0.5 for every call).
    from intent.errors import UsageError
    from worldmodel.predictors import EncoderIntentionPredictor

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="no calibration.json.*intent train predictor"):
        EncoderIntentionPredictor(tmp_path)


@pytest.mark.slow
@pytest.mark.ml
def test_predictor_one_step_export_reload_and_calibrated_output(logs, tmp_path):
    from training.train_intention import train_predictor
    from worldmodel.predictors import EncoderIntentionPredictor

    tri = triples(load_records(logs))
    report = train_predictor(tri, tmp_path / "pred", max_steps=2, batch_size=8, max_length=64, progress=False)
    for key in ("accuracy", "auroc", "nll", "brier", "ece"):
        assert key in report["test_calibrated"] and key in report["test_uncalibrated"]
    assert (tmp_path / "pred" / "reliability.png").stat().st_size > 1000
    cal = json.loads((tmp_path / "pred" / "calibration.json").read_text())
    calibrated = EncoderIntentionPredictor(tmp_path / "pred")
    raw = EncoderIntentionPredictor(tmp_path / "pred", calibrated=False)
    assert calibrated.temperature == pytest.approx(cal["temperature"]) and raw.temperature == 1.0
    item = (tri[0].reasoning, tri[0].tool, tri[0].args)
    p_cal, p_raw = calibrated.predict(*item), raw.predict(*item)
    assert 0 <= p_cal <= 1 and (abs(p_cal - p_raw) > 1e-6 or abs(cal["temperature"] - 1) < 1e-3)

    # ... and the oracle uses the calibrated output: INTENT's trace carries exactly that p.
    from langchain_core.messages import AIMessage, HumanMessage

    from fakes import ScriptedToolModel
    from intent import DecisionContext, Market, PricedTool, Proposal
    from intent.oracles import IntentOracle
    from intent.policy import AgentPolicy
    from worldmodel.replay import ReplayWorldModel

    call = {"name": item[1], "args": item[2], "id": "c1", "type": "tool_call"}
    proposal = Proposal("c1", item[1], item[2], item[0])
    market = Market([PricedTool(item[1], 5)])
    ctx = DecisionContext("e", "q", proposal, 5.0, 100.0, 0.0, 100.0, market, step=0,
                          history=[HumanMessage("q"), AIMessage(item[0], tool_calls=[call])], batch=(proposal,))
    oracle = IntentOracle(AgentPolicy(ScriptedToolModel(messages=iter([AIMessage("done")]), bound=[])),
                          ReplayWorldModel([]), calibrated)
    decision = oracle.decide(ctx)
    assert decision.trace[0].p_success == pytest.approx(max(p_cal, 1e-3))


def test_predictor_bad_input_fails_before_training(logs, tmp_path):
    from training.train_intention import train_predictor

    tri = triples(load_records(logs))
    with pytest.raises(ValueError, match="one class"):
        train_predictor([t for t in tri if t.z == 1], tmp_path / "a")
    with pytest.raises(ValueError, match="too small"):
        train_predictor(tri[:6], tmp_path / "b")
    causal = tmp_path / "causal"
    causal.mkdir()
    (causal / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="causal LM"):
        train_predictor(tri, tmp_path / "c", base_model=str(causal))


@pytest.fixture()
def tiny_lm(tmp_path) -> Path:
    """A tiny random Llama with the MiniLM tokenizer: one training step takes a second."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from training.train_intention import default_encoder

    tok = AutoTokenizer.from_pretrained(default_encoder())
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id)
    path = tmp_path / "tiny"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.ml
def test_world_model_one_step_loss_mask_export_and_reload(logs, tiny_lm, tmp_path):
    from transformers import AutoTokenizer

    from training.train_worldmodel import _examples, train_world_model
    from worldmodel.conformance import check_world_model
    from worldmodel.transformers_lm import TransformersWorldModel, render_prompt

    prs = pairs(load_records(logs))
    tok = AutoTokenizer.from_pretrained(tiny_lm)
    ids, labels = _examples(tok, prs[:1], True, 512)[0]
    n_prompt = len(tok(render_prompt(tok, prs[0].tool, prs[0].args, True), add_special_tokens=False)["input_ids"])
    assert all(x == -100 for x in labels[:n_prompt]) and all(x != -100 for x in labels[n_prompt:])
    report = train_world_model(prs, tmp_path / "wm", base_model=str(tiny_lm), conditional=True, max_steps=1,
                               batch_size=2, max_length=96, progress=False, samples=1)
    assert report["steps"] == 1 and report["perplexity"] > 1 and report["samples"]
    wm = TransformersWorldModel(tmp_path / "wm", max_new_tokens=8)
    assert isinstance(wm.simulate("t", {"a": 1}, satisfied=True), str)
    check_world_model(wm)
    with pytest.raises(ValueError, match="not a causal LM"):
        enc = tmp_path / "enc"
        enc.mkdir()
        (enc / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
        train_world_model(prs, tmp_path / "x", base_model=str(enc))


def test_vllm_command():
    from training.serve import vllm_command

    cmd = vllm_command("runs/wm", port=8123)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--port" in cmd and "8123" in cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "wm"
    from intent.errors import UsageError

    for port in (0, 99999):  # was printed (and run) as given
        with pytest.raises(UsageError, match=f"--port must be a TCP port, 1 to 65535, got {port}"):
            vllm_command("runs/wm", port=port)


def test_serving_the_current_directory_names_the_model_and_the_printed_command_can_be_pasted(tmp_path, monkeypatch,
                                                                                             capsys):
    # Was: `intent serve worldmodel .` gave `--served-model-name ` (an empty name, which `intent loop
    # --world-model-url` does not ask for), and --print printed the command unquoted (a path with a space or an
    # empty argument did not survive a paste into a shell).
    import shlex

    from training.serve import serve, vllm_command

    model = tmp_path / "my model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    monkeypatch.chdir(model)
    cmd = vllm_command(".")
    assert cmd[cmd.index("--served-model-name") + 1] == "my model"
    assert serve(".", print_only=True, python="python") == 0
    assert shlex.split(capsys.readouterr().out) == cmd


@pytest.mark.slow
@pytest.mark.ml
def test_interrupted_predictor_training_resumes_from_its_checkpoint(logs, tmp_path):
    from training.train_intention import train_predictor

    tri = triples(load_records(logs))
    first = train_predictor(tri, tmp_path / "p", epochs=2, max_steps=1, batch_size=8, max_length=64, progress=False)
    state = json.loads((tmp_path / "p.checkpoint" / "state.json").read_text())
    assert first["steps"] == 1 and state["epoch"] == 0  # --max-steps reached in epoch 1 of 2: the run is done
    resumed = train_predictor(tri, tmp_path / "p", epochs=2, max_steps=1, batch_size=8, max_length=64,
                              progress=False)
    # Found again in its checkpoint, the finished run trains nothing more (was: one more step per re-run, so the
    # same command run twice gave another model). A real interruption's resume: tests/test_training_artifacts.py.
    assert resumed["steps"] == 1
    assert json.loads((tmp_path / "p.checkpoint" / "state.json").read_text())["epoch"] == 0


def test_synthetic_checker_accepts_real_answers_and_rejects_others(logs):
    from eval.loop import observation_answers
    from intent.logs import label_of

    records = [r for r in load_records(logs) if r.decision == "accept" and isinstance(r.args, dict)]
    good = [r for r in records if label_of(r) == 1]
    assert good and all(observation_answers(r.tool, r.args, without_result_note(r.observation))
                        for r in good[:30])
    # One call of one provider (not a bundle), in canonical order: the log's line order follows thread timing.
    r = min((r for r in good if "results" not in r.observation), key=lambda r: (r.task_id, r.step, r.call_id))
    body = json.loads(without_result_note(r.observation))
    assert not observation_answers(r.tool, r.args, json.dumps({**body, **{k: "somewhere else" for k in r.args}}))
    assert not observation_answers(r.tool, r.args, "503 Service Unavailable")
    assert not observation_answers(r.tool, r.args, json.dumps({**body, "error": "400"}))


@pytest.mark.ml
@pytest.mark.slow
def test_loop_end_to_end_with_a_tiny_generator_and_resume(logs, tiny_lm, tmp_path):
    from eval.loop import LoopConfig, run_loop

    cfg = LoopConfig(logs=[str(logs)], out=str(tmp_path / "loop"), encoder_epochs=0, wm_steps=3, wm_base=str(tiny_lm),
                     wm_batch_size=2, wm_max_length=96, fidelity_calls=3, bench_tasks=3, workers=1, progress=False)
    result = run_loop(cfg)
    out = tmp_path / "loop"
    assert (out / "worldmodel" / "loss_curve.png").stat().st_size > 1000
    assert result["world_model"]["steps"] == 3 and len(json.loads((out / "worldmodel" / "loss_curve.json").read_text())) >= 2
    assert result["fidelity"]["models"]["environment (logged observations)"] == 1.0  # the checker accepts the truth
    assert set(result["bench"]) == {"tracker", "intent-empirical", "intent", "intent-trained-wm"}
    assert all(m["FR"] == 100.0 for m in result["bench"].values())
    assert any("trained generator" in n for n in result["bench_config"]["oracle_notes"])
    assert "## World model" in (out / "loop.md").read_text()
    stamp = (out / "worldmodel" / "report.json").stat().st_mtime
    run_loop(cfg)  # every stage is complete: nothing is retrained
    assert (out / "worldmodel" / "report.json").stat().st_mtime == stamp


@pytest.mark.slow
@pytest.mark.ml
def test_world_model_exports_the_best_validation_step(logs, tiny_lm, tmp_path, monkeypatch):
    import training.train_worldmodel as twm

    prs = pairs(load_records(logs))
    # Scripted validation losses (step 0, then after each of 8 steps, then the final test loss): best at step 3.
    losses = iter([2.0, 1.5, 1.0, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 0.9])
    monkeypatch.setattr(twm, "_mean_loss", lambda *a, **k: next(losses))
    report = twm.train_world_model(prs, tmp_path / "wm", base_model=str(tiny_lm), conditional=True, max_steps=8,
                                   batch_size=2, max_length=96, progress=False, samples=0, eval_every=1)
    assert report["exported_step"] == 3
    losses = iter([2.0, 1.5, 1.0, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 0.9])
    off = twm.train_world_model(prs, tmp_path / "wm2", base_model=str(tiny_lm), conditional=True, max_steps=8,
                                batch_size=2, max_length=96, progress=False, samples=0, eval_every=1,
                                keep_best=False)
    assert off["exported_step"] == 8


VLLM_PY = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


@pytest.mark.ml
@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PY.exists(), reason="needs vLLM in .venv-vllm (scripts/vllm_venv.sh)")
def test_loop_benches_its_world_model_served_by_vllm(logs, tmp_path):
    """The loop's served path, for real: the generator it trains (SmolLM2-135M, a few steps) is
    served by vLLM (the CPU build here) and the loop's bench runs intent-trained-wm against that
    server through --world-model-url; each INTENT decision's world-model tokens come from it."""
    import socket
    import subprocess
    import time
    import urllib.request

    from eval.loop import LoopConfig, run_loop
    from training.serve import vllm_command
    from training.train_worldmodel import train_world_model

    out = tmp_path / "loop"
    wm_dir = out / "worldmodel"
    # The loop's own world-model stage, run ahead so that the server can start on its output; the
    # loop then finds the stage complete and goes on (as a resumed loop does).
    train_world_model(pairs(load_records(logs)), wm_dir, base_model=None, conditional=True, max_steps=2,
                      batch_size=2, max_length=96, progress=False, samples=0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = vllm_command(wm_dir, port=port, python=str(VLLM_PY), gpu_memory_utilization=0.4)
    log = (tmp_path / "vllm.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while True:
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline, "vLLM did not start in 15 minutes"
                time.sleep(5)
        cfg = LoopConfig(logs=[str(logs)], out=str(out), encoder_epochs=0, wm_steps=2, fidelity_calls=2,
                         bench_tasks=2, workers=1, progress=False,
                         world_model_url=f"http://127.0.0.1:{port}/v1", world_model_name=wm_dir.name)
        result = run_loop(cfg)
    finally:
        server.terminate()
        server.wait(timeout=60)
    bench = result["bench"]
    assert all(m["FR"] == 100.0 for m in bench.values())
    notes = " ".join(result["bench_config"]["oracle_notes"])
    assert f"127.0.0.1:{port}" in notes  # intent-trained-wm used the served model, not an in-process one
    served = (tmp_path / "vllm.log").read_text()
    assert served.count("POST /v1/chat/completions") > 0  # ... and its rollouts reached the server


def test_the_loop_asks_a_served_world_model_by_the_name_intent_serve_gives_it(tmp_path, monkeypatch):
    # `intent serve worldmodel DIR` serves the model under DIR's name; the loop's bench must ask for that
    # name by default (was: the whole path, which the endpoint check refused).
    import eval.runner
    from eval import loop
    from training.serve import vllm_command

    seen: dict = {}
    monkeypatch.setattr(eval.runner, "run_benchmark", lambda bc, progress=None: seen.setdefault("options", bc.options))
    wm_dir = tmp_path / "runs" / "loop" / "worldmodel"
    cfg = loop.LoopConfig(logs=[], out=str(tmp_path), world_model_url="http://127.0.0.1:9/v1")
    loop._bench(cfg, tmp_path / "bench", tmp_path / "labelled.jsonl", tmp_path / "pred", {"chosen": "counting"}, wm_dir)
    served = vllm_command(wm_dir, port=8000, python="python")
    assert seen["options"]["trained_world_model_name"] == served[served.index("--served-model-name") + 1]


def test_annotate_by_llm_without_its_endpoint_is_a_one_line_error(tmp_path, capsys):
    # Was: AttributeError from deep inside the judge's client ('NoneType' object has no attribute 'rstrip').
    from intent.cli import main

    logs = tmp_path / "logs.jsonl"
    logs.write_text("")
    assert main(["train", "annotate", "--logs", str(logs), "--out", str(tmp_path / "l.jsonl"), "--method", "llm"]) == 2
    err = capsys.readouterr().err
    assert "--judge-url" in err and "--judge-model" in err and "Traceback" not in err


# --- Resuming only the same run; --max-length that fits no example; logs without labels (found by a probe) ---


@pytest.fixture()
def tiny_encoder(tmp_path) -> Path:
    """A tiny random BERT classifier with the MiniLM tokenizer: a training step takes well under a second."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from training.train_intention import default_encoder

    tok = AutoTokenizer.from_pretrained(default_encoder())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=128, num_labels=2)
    path = tmp_path / "tiny-encoder"
    BertForSequenceClassification(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _two_task_halves(items):
    tasks = sorted({t.task_id for t in items})
    first = set(tasks[: len(tasks) * 3 // 4])
    return [t for t in items if t.task_id in first], [t for t in items if t.task_id not in first]


@pytest.mark.ml
def test_a_checkpoint_of_another_predictor_run_is_refused_not_resumed(logs, tiny_encoder, tmp_path):
    # Was: --out holding another run's checkpoint was "resumed": with other logs zero steps ran and the
    # exported model was the old one, while split.json / report.json described the new data.
    from intent.errors import UsageError
    from training.train_intention import train_predictor

    tri = triples(load_records(logs))
    other = [t for t in tri if t.task_id != tri[0].task_id]
    kw = dict(base_model=str(tiny_encoder), epochs=2, max_steps=1, batch_size=8, max_length=32, progress=False)
    first = train_predictor(tri, tmp_path / "p", **kw)  # "interrupted" after epoch 1 of 2
    assert first["steps"] == 1
    with pytest.raises(UsageError, match=r"has a checkpoint of another training run \(logs differ\).*delete .*p\.checkpoint"):
        train_predictor(other, tmp_path / "p", **kw)
    with pytest.raises(UsageError, match=r"\(--lr differs\)"):
        train_predictor(tri, tmp_path / "p", **{**kw, "lr": 1e-3})
    with pytest.raises(UsageError, match=r"\(--seed differs\)"):
        train_predictor(tri, tmp_path / "p", **{**kw, "seed": 1})
    resumed = train_predictor(tri, tmp_path / "p", **kw)  # the same run: resumed (finished: --max-steps 1 reached)
    assert resumed["steps"] == 1 and json.loads((tmp_path / "p.checkpoint" / "state.json").read_text())["epoch"] == 0
    fresh = train_predictor(other, tmp_path / "p", resume=False, **kw)  # resume=False starts over
    assert fresh["steps"] == 1
    state = tmp_path / "p.checkpoint" / "state.json"
    state.write_text(json.dumps({"epoch": 0}))  # a checkpoint that records no run (older version)
    with pytest.raises(UsageError, match="records no fingerprint of its run"):
        train_predictor(other, tmp_path / "p", **kw)


@pytest.mark.ml
def test_train_report_encoder_into_an_out_of_other_logs_is_refused(logs, tiny_encoder, tmp_path):
    # `intent train report --encoder` trains through train_predictor (resuming by default): the same rule.
    from intent.errors import UsageError
    from training.predictor_report import predictor_report

    records = load_records(logs)
    encoder = {"base_model": str(tiny_encoder), "max_steps": 1, "epochs": 2, "batch_size": 8, "max_length": 32,
               "progress": False}
    predictor_report(records, out=tmp_path / "rep", encoder=encoder, min_test_examples=10)
    # Other logs with the same tasks (the same split): one call's reasoning differs.
    i = next(i for i, r in enumerate(records) if r.decision == "accept" and r.status == "ok")
    edited = records[:i] + [records[i].model_copy(update={"reasoning": "something else"})] + records[i + 1:]
    with pytest.raises(UsageError, match=r"encoder has a checkpoint of another training run \(logs differ\)"):
        predictor_report(edited, out=tmp_path / "rep", encoder=encoder, min_test_examples=10)


@pytest.mark.ml
def test_a_checkpoint_of_another_world_model_run_is_refused_not_resumed(logs, tiny_lm, tmp_path):
    from intent.errors import UsageError
    from training.train_worldmodel import train_world_model

    prs = pairs(load_records(logs))
    tasks = sorted({p.task_id for p in prs})
    other = [p for p in prs if p.task_id != tasks[0]]
    kw = dict(base_model=str(tiny_lm), conditional=True, epochs=2, max_steps=1, batch_size=2, max_length=96,
              progress=False, samples=0)
    assert train_world_model(prs, tmp_path / "wm", **kw)["steps"] == 1
    with pytest.raises(UsageError, match=r"has a checkpoint of another training run \(logs differ\)"):
        train_world_model(other, tmp_path / "wm", **kw)
    with pytest.raises(UsageError, match=r"\(--max-length differs\)"):
        train_world_model(prs, tmp_path / "wm", **{**kw, "max_length": 128})
    again = train_world_model(prs, tmp_path / "wm", **kw)  # the same (finished) run: nothing more to train
    assert again["steps"] == 1


@pytest.mark.ml
def test_a_world_model_max_length_shorter_than_every_prompt_is_refused(logs, tiny_lm, tmp_path):
    # Was: 0 usable examples, 0 steps, exit 0, held-out loss 0.0 and perplexity 1.0 (a perfect score).
    from transformers import AutoTokenizer

    from intent.errors import UsageError
    from training.train_worldmodel import train_world_model
    from worldmodel.transformers_lm import render_prompt

    prs = [p for p in pairs(load_records(logs)) if p.z == 1]
    tok = AutoTokenizer.from_pretrained(tiny_lm)
    lengths = sorted(len(tok(render_prompt(tok, p.tool, p.args, True), add_special_tokens=False)["input_ids"])
                     for p in prs)
    kw = dict(base_model=str(tiny_lm), conditional=True, max_steps=1, batch_size=2, progress=False, samples=0)
    with pytest.raises(UsageError, match=rf"--max-length {lengths[0] - 1} leaves no training example.*"
                                         rf"{lengths[0]}\.\.{lengths[-1]} tokens.*raise --max-length above {lengths[-1]}"):
        train_world_model(prs, tmp_path / "wm", max_length=lengths[0] - 1, **kw)
    with pytest.raises(UsageError, match=r"--wm-max-length \d+ leaves .*raise --wm-max-length above"):  # intent loop's flag
        train_world_model(prs, tmp_path / "wm", max_length=lengths[0] - 1, flag_prefix="wm-", **kw)
    assert not (tmp_path / "wm" / "report.json").exists()
    if lengths[0] < lengths[-1]:  # some fit, some do not: trained, with a warning and the count in report.json
        with pytest.warns(UserWarning, match="pairs left out"):
            report = train_world_model(prs, tmp_path / "wm2", max_length=lengths[-1], **kw)
        assert report["steps"] == 1 and report["dropped_examples"]["max_length"] == lengths[-1]
        assert sum(v for k, v in report["dropped_examples"].items() if k != "max_length") > 0


def test_training_the_predictor_on_logs_without_labels_points_to_annotate(logs, tmp_path, capsys):
    # Was: "the intention labels are all one class".
    from intent.cli import main

    rows = list(read_log_rows(logs))
    for row in rows:
        if isinstance(row.get("artifact"), dict):
            row["artifact"].pop("z", None)
    unlabelled = tmp_path / "unlabelled.jsonl"
    unlabelled.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["train", "predictor", "--logs", str(unlabelled), "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "no executed call carries a label z" in err and "intent train annotate" in err and "one class" not in err
    from intent.errors import UsageError
    from training.train_intention import train_predictor

    with pytest.raises(UsageError, match="intent train annotate"):
        train_predictor([], tmp_path / "q")


def test_a_loop_with_a_bad_seed_or_base_is_refused_before_its_training_stages(logs, tmp_path):
    # Was: annotated, trained the predictor and the generator, then the bench stage refused --seed -1.
    from eval.loop import LoopConfig, run_loop
    from intent.errors import UsageError

    with pytest.raises(UsageError, match=r"--seed must be an integer >= 0, got -1"):
        run_loop(LoopConfig(logs=[str(logs)], out=str(tmp_path / "loop"), seed=-1, progress=False))
    assert not (tmp_path / "loop").exists()
    # Was: a missing --wm-base was found by the generator's stage, after the annotate and predictor stages.
    with pytest.raises(UsageError, match=r"--wm-base: base model .*nowhere is not a Hugging Face model directory"):
        run_loop(LoopConfig(logs=[str(logs)], out=str(tmp_path / "loop"), wm_base=str(tmp_path / "nowhere"),
                            progress=False))
    assert not (tmp_path / "loop").exists()
    # Was: OUT and its loop_config.json were written before the annotate stage found the log missing.
    with pytest.raises(LogFormatError, match=r"nowhere\.jsonl"):
        run_loop(LoopConfig(logs=[str(tmp_path / "nowhere.jsonl")], out=str(tmp_path / "loop"), progress=False))
    assert not (tmp_path / "loop").exists()


def test_a_loop_over_other_logs_into_the_same_out_is_refused(logs, tmp_path, monkeypatch):
    # Was: the annotate stage was skipped whenever labelled.COMPLETE existed, so everything downstream
    # trained on the old logs while loop_config.json named the new ones.
    import training.predictor_report as pr
    from eval.loop import LoopConfig, run_loop
    from intent.errors import UsageError

    class Stop(Exception):
        pass

    seen = []

    def stop(records, **kw):
        seen.append(len(records))
        raise Stop

    monkeypatch.setattr(pr, "predictor_report", stop)
    lines = logs.read_text().splitlines(keepends=True)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(lines[: len(lines) // 2]))
    out = tmp_path / "loop"
    with pytest.raises(Stop):
        run_loop(LoopConfig(logs=[str(logs)], out=str(out), progress=False))
    config = (out / "loop_config.json").read_text()
    with pytest.raises(UsageError, match=r"holds a loop over other logs .*use a new --out"):
        run_loop(LoopConfig(logs=[str(other)], out=str(out), progress=False))
    assert (out / "loop_config.json").read_text() == config  # still names the logs it was run on
    with pytest.raises(Stop):  # the same logs: the annotate stage is done, the loop resumes after it
        run_loop(LoopConfig(logs=[str(logs)], out=str(out), progress=False))
    assert seen[0] == seen[1]
    # The same logs with other settings: each finished stage would be skipped and the setting ignored.
    with pytest.raises(UsageError, match=r"--seed 0 \(now 1\), --wm-steps 300 \(now 5\); .*resumes only with the "
                                         r"same settings"):
        run_loop(LoopConfig(logs=[str(logs)], out=str(out), seed=1, wm_steps=5, progress=False))
    assert (out / "loop_config.json").read_text() == config
    with pytest.raises(Stop):  # what does not shape an output may change: workers, progress
        run_loop(LoopConfig(logs=[str(logs)], out=str(out), workers=1, progress=False))
    (out / "labelled.COMPLETE").write_text("ok\n")  # written by an older version: inputs unknown
    with pytest.raises(UsageError, match="not recorded"):
        run_loop(LoopConfig(logs=[str(logs)], out=str(out), progress=False))


@pytest.mark.ml
def test_the_reports_encoder_scores_each_test_call_once_under_a_progress_reporter(logs, tiny_encoder, tmp_path,
                                                                                 monkeypatch):
    # Was: two predictors loaded and the test calls scored twice (calibrated, then uncalibrated) after the
    # trainer's bars had ended: minutes without a line for the report's ~2,000 test calls on a busy CPU.
    from transformers import BertForSequenceClassification

    from training.predictor_report import predictor_report

    import training.train_intention

    scored_outside, scored = [], [0]
    real_forward = BertForSequenceClassification.forward
    open_bars = count_open_progress(monkeypatch, (training.train_intention, "progress_reporter"))

    def forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        if not self.training and not open_bars[0]:
            scored_outside.append(len(out.logits))
        scored[0] += 0 if self.training else len(out.logits)
        return out

    monkeypatch.setattr(BertForSequenceClassification, "forward", forward)
    encoder = {"base_model": str(tiny_encoder), "max_steps": 1, "batch_size": 8, "max_length": 32}
    report = predictor_report(load_records(logs), out=tmp_path / "rep", encoder=encoder, min_test_examples=10)
    sizes = report["encoder"]["examples"]
    assert scored_outside == []
    assert scored[0] == sizes["dev"] + 2 * sizes["test"]  # the trainer's calibration, then the report's, once


def _a_call():
    from intent.logs import StepRecord

    return StepRecord(task_id="t", step=0, call_id="c", tool="weather", args={"city": "Oslo"}, decision="accept",
                      status="ok", spent=1.0, remaining=1.0, budget=2.0, reasoning="I need Oslo's weather",
                      observation='{"city": "Oslo", "temperature_c": 3}')


def test_a_judge_failing_for_a_moment_is_asked_again_and_one_that_stays_down_is_a_one_line_error():
    # Was: one 503 (or a dropped connection) while labelling thousands of calls ended `intent train annotate` with an
    # httpx traceback, and a reply without choices[0].message.content with a KeyError.
    from intent.errors import IntentError
    from training.annotate import LLMJudge

    yes = (200, {"choices": [{"message": {"content": "YES"}}]})
    srv, server, url = judge_server([(503, {"error": "loading"}), yes])
    try:
        assert LLMJudge(url, "j", votes=1, backoff=0).label(_a_call()) == 1 and server.posts == 2
    finally:
        srv.shutdown()
    for reply, message in (((503, {"error": "down"}), "HTTP 503"), ((200, {"choices": []}), "choices")):
        srv, server, url = judge_server([reply])
        try:
            with pytest.raises(IntentError, match=f"--judge-url {url}.*{message}"):
                LLMJudge(url, "j", votes=1, backoff=0).label(_a_call())
        finally:
            srv.shutdown()


def test_labelling_with_a_judge_runs_under_a_progress_reporter(tmp_path, monkeypatch):
    # Was: no line at all while a judge labelled every call (votes x calls requests: hours on a real log).
    from training.annotate import annotate

    asked_outside = []
    open_bars = count_open_progress(monkeypatch)

    class Judge:
        def label(self, record):
            if not open_bars[0]:
                asked_outside.append(record.call_id)
            return 1

    assert annotate([_a_call()], tmp_path / "z.jsonl", method="llm", judge=Judge()) == {"labelled": 1}
    assert asked_outside == []


def test_train_predictor_and_train_report_score_a_prediction_alike():
    """`intent train predictor`'s report.json and `intent train report` both say "ece" and "auroc": they were
    10-bin and 15-bin ECEs under one name, from two AUROC implementations. Probabilities chosen so that 10
    and 15 bins give different ECEs."""
    from training.predictor_report import score
    from training.train_intention import _metrics
    from worldmodel.calibration import ece

    probs = [0.12, 0.18, 0.31, 0.38, 0.52, 0.58, 0.61, 0.69, 0.83, 0.88, 0.93, 0.97]
    labels = [0, 1, 0, 0, 1, 0, 1, 1, 1, 0, 1, 1]
    assert ece(probs, labels, n_bins=10) != ece(probs, labels, n_bins=15)  # (the case where the reports differed)
    ours, report = _metrics(probs, labels), score(probs, labels)
    assert {k: ours[k] for k in ("ece", "auroc", "nll", "brier", "accuracy")} == \
        {k: report[k] for k in ("ece", "auroc", "nll", "brier", "accuracy")}


def test_annotate_leaves_no_partial_labelled_log(tmp_path):
    # Was: the labelled log was written in place, so a judge that stayed down halfway (or logs without a label)
    # left a partial file at OUT, over an earlier complete one.
    from intent.errors import UsageError
    from training.annotate import annotate

    out = tmp_path / "labelled.jsonl"
    with pytest.raises(UsageError, match="no call could be labelled"):
        annotate([_a_call()], out, progress=False)  # no ground truth in the artifact
    assert list(tmp_path.iterdir()) == []

    class DownAfterOne:
        asked = 0

        def label(self, record):
            self.asked += 1
            if self.asked > 1:
                raise UsageError("the judge at http://judge/v1 failed 3 times")
            return 1

    out.write_text("an earlier complete labelled log\n")
    with pytest.raises(UsageError, match="failed 3 times"):
        annotate([_a_call(), _a_call()], out, method="llm", judge=DownAfterOne(), progress=False)
    assert out.read_text() == "an earlier complete labelled log\n" and list(tmp_path.iterdir()) == [out]
    assert annotate([_a_call()], out, method="llm", judge=DownAfterOne(), progress=False) == {"labelled": 1}
    assert '"z": 1' in out.read_text() and list(tmp_path.iterdir()) == [out]
