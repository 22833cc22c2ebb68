"""`mlx-h2o eval`, `passkey` and `recall`: measure several policies side by side."""

import os
import sys

import mlx_h2o

from .model import _attention_desc, _load
from .specs import _command_specs


def cmd_eval(args) -> int:
    from ..evaluation import load_corpus, token_samples
    from ..evaluation.corpus import set_samples
    from ..evaluation.report import perplexity_markdown, plot_sweep, speed_markdown
    from ..evaluation.runner import perplexity_table, speed_table

    specs = _command_specs(args)
    corpus = load_corpus(args.text_files)
    print(f"corpus: {corpus.name}", file=sys.stderr)
    print(f"BLAS: {mlx_h2o.blas_backend()}", file=sys.stderr)
    model, tokenizer = _load(args)
    print(f"attention: {_attention_desc()}", file=sys.stderr)
    rows = []
    for seq_len in args.seq_len:
        if args.doc_set is None:
            samples = token_samples(tokenizer, corpus, args.samples, seq_len, seed=args.seed)
        else:
            samples = set_samples(tokenizer, corpus, args.doc_set, args.samples, seq_len, seed=args.seed)
        print(f"seq {seq_len}: samples from " + ", ".join(os.path.basename(s[0]) for s in samples), file=sys.stderr)
        rows += perplexity_table(model, specs, samples, prefill=args.prefill, batch_size=args.batch_size,
                                 progress=not args.quiet, policy_batch_size=args.policy_batch or 1,
                                 score_after_prefill=args.score_after_prefill)
    for r in rows:
        r["doc_set"] = args.doc_set
    print(perplexity_markdown(rows))
    payload = {"corpus": corpus.name, "blas": mlx_h2o.blas_backend(), "attention": _attention_desc(),
               "doc_set": args.doc_set, "perplexity": rows}
    if args.speed_context:
        context = token_samples(tokenizer, corpus, 1, args.speed_context + 1, seed=args.seed)[0][1]
        speed = speed_table(model, specs, context, steps=args.speed_steps, progress=not args.quiet)
        print()
        print(speed_markdown(speed))
        payload["speed"] = speed
    if args.json:
        _write_json(args.json, payload)
    if args.plot:
        if plot_sweep(rows, args.plot):
            print(f"wrote {args.plot}", file=sys.stderr)
        else:
            print("no sweep over --max-kv-size or --seq-len: no plot written", file=sys.stderr)
    return 0


def cmd_passkey(args) -> int:
    from ..evaluation import load_corpus
    from ..evaluation.passkey import passkey_markdown, passkey_trials, run_passkey

    specs = _command_specs(args)
    model, tokenizer = _load(args)
    trials = passkey_trials(tokenizer, load_corpus(args.text_files), args.context, args.depths, args.per_depth, seed=args.seed)
    rows = run_passkey(model, tokenizer, specs, trials, prefill_step_size=args.prefill_step_size, progress=not args.quiet)
    print(passkey_markdown(rows))
    if args.json:
        _write_json(args.json, {"context": args.context, "budget": args.budget, "passkey": rows})
    return 0


def _write_json(path, payload):
    from ..evaluation.report import write_json

    write_json(path, payload)
    print(f"wrote {path}", file=sys.stderr)


def cmd_recall(args) -> int:
    from ..evaluation import load_corpus
    from ..evaluation.corpus import document_set
    from ..evaluation.recall import recall_markdown, recall_sequences, recall_table

    specs = _command_specs(args)
    doc_set = 0 if args.doc_set is None else args.doc_set
    corpus = load_corpus(args.text_files)
    model, tokenizer = _load(args)
    docs = document_set(tokenizer, corpus, doc_set, seed=args.seed)
    print(f"doc set {doc_set}: " + ", ".join(os.path.basename(d[0]) for d in docs), file=sys.stderr)
    rows = []
    for chunk in args.chunk or [None]:
        for span in args.span:
            for filler in args.filler:
                sequences = recall_sequences(docs, span, filler, args.trials)
                rows += recall_table(model, specs, sequences, chunk=chunk, prefill=args.prefill,
                                     policy_batch_size=args.policy_batch or None, progress=not args.quiet)
    for r in rows:
        r["doc_set"] = doc_set
    print(recall_markdown(rows))
    if args.json:
        _write_json(args.json, {"corpus": corpus.name, "doc_set": doc_set, "recall": rows})
    return 0


def cmd_recall_suite(args) -> int:
    from ..evaluation import load_corpus
    from ..evaluation.corpus import document_set
    from ..evaluation.suite import CACHES, check_fractions, check_probes, parse_caches, recall_suite, suite_markdown

    check_fractions(args.budget)
    caches = parse_caches(args.cache) if args.cache else CACHES
    check_probes(args.probes, caches)
    corpus = load_corpus(args.text_files)
    model, tokenizer = _load(args)
    docs = document_set(tokenizer, corpus, args.doc_set, seed=args.seed)
    print(f"doc set {args.doc_set} ({'tuning' if args.doc_set == 0 else 'held out'}): "
          + ", ".join(os.path.basename(d[0]) for d in docs), file=sys.stderr)
    payload = {"corpus": corpus.name, "doc_set": args.doc_set, "contexts": args.context, "budgets": args.budget}

    def save(rows):  # partial results survive an interrupted run
        if args.json:
            _write_json(args.json, {**payload, "suite": rows})

    rows = recall_suite(model, tokenizer, docs, args.context, args.budget, probes=args.probes, per_depth=args.per_depth,
                        span_trials=args.span_trials, policy_batch_size=args.policy_batch, progress=not args.quiet, on_rows=save,
                        caches=caches)
    print(suite_markdown(rows))
    return 0


def cmd_demo(args) -> int:
    from ..evaluation import load_corpus
    from ..evaluation.corpus import document_set
    from ..evaluation.demo import check_arguments, demo_markdown, plot_demo, run_demo

    check_arguments(args.context, args.budget)
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    corpus = load_corpus(args.text_files)
    say(f"demo: loading the model ({args.model or 'embedded SmolLM2-135M-Instruct'})")
    model, tokenizer = _load(args)
    docs = document_set(tokenizer, corpus, args.doc_set, seed=args.seed)
    say(f"demo: doc set {args.doc_set} ({'tuning' if args.doc_set == 0 else 'held out'}): "
        + ", ".join(os.path.basename(d[0]) for d in docs[: max(args.samples, args.span_trials)]))
    rows = run_demo(model, docs, args.context, args.budget, samples=args.samples, span_trials=args.span_trials,
                    progress=not args.quiet, say=say)
    print(demo_markdown(rows))
    if args.json:
        _write_json(args.json, {"corpus": corpus.name, "doc_set": args.doc_set, "blas": mlx_h2o.blas_backend(),
                                "attention": _attention_desc(), "demo": rows})
    if args.plot:
        plot_demo(rows, args.plot)
        say(f"wrote {args.plot}")
    return 0
