"""`mlx-h2o`: generate with a bounded cache, or measure policies side by side.

    mlx-h2o generate --prompt "..." --cache rotating --max-kv-size 256
    mlx-h2o eval --cache full rotating --max-kv-size 128 256 512 --seq-len 2048 --samples 4
    mlx-h2o generate --prompt "..." --cache h2o --max-kv-size 256 --h2o-split heavy --h2o-score ema
    mlx-h2o eval --cache full rotating h2o h2o:score=ema,select=layer --max-kv-size 128 256
"""

import argparse
import os
import sys

import mlx_h2o

from ._blas import use_openblas


def _add_model_args(p):
    p.add_argument("--model", default=None, help="a .gguf file or an mlx-lm model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--weights", default=None, choices=["float32", "bfloat16", "float16", "quantized"], help="GGUF weights: dequantized dtype or packed (default: packed, as mlx_h2o.load())")
    p.add_argument("--attention", default="fused", choices=["fused", "stock"], help="attention on CPU: mlx-h2o's fused kernel (default) or mlx-lm's stock path")


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_doc_set_args(p):
    p.add_argument("--doc-set", type=int, default=None, help="draw samples from document set K (0 = tuning, 1 and 2 = held out; disjoint sets of 8 documents); default: the seeded document order")
    p.add_argument("--policy-batch", type=_positive_int, default=1, help="decode this many policies together in one batch (same NLLs; the model's weights are read once per step for all)")


def _option_type(option):
    """argparse type for an option of a policy's table: its own parser and error message."""

    def convert(text):
        try:
            return option.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _h2o_flag_options():
    """The h2o options with a --h2o-* flag: all but the budget (--max-kv-size)."""
    from .caches.h2o import OPTIONS

    return [o for o in OPTIONS if o.name != "max_kv_size"]


def _add_h2o_args(p):
    from .options import Choice, Flag

    h = p.add_argument_group("h2o policy (--cache h2o; flags from the policy's option table)")
    for o in _h2o_flag_options():
        flag = f"--h2o-{o.name.replace('_', '-')}"
        default = "" if o.default is None else f" (default: {o.default})"
        if isinstance(o.kind, Flag):
            h.add_argument(flag, dest=f"h2o_{o.name}", action="store_const", const=True, help=o.help)
        elif o.name == "pin":
            h.add_argument(flag, dest="h2o_pin", nargs="+", metavar="START:END", help=o.help)
        else:
            metavar = "{" + ",".join(map(str, o.kind.names())) + "}" if isinstance(o.kind, Choice) else None
            h.add_argument(flag, dest=f"h2o_{o.name}", type=_option_type(o), metavar=metavar, help=o.help + default)


def _h2o_options(args) -> dict:
    opts = {o.name: getattr(args, f"h2o_{o.name}") for o in _h2o_flag_options() if getattr(args, f"h2o_{o.name}", None) is not None}
    if "pin" in opts:
        opts["pin"] = ";".join(opts["pin"])
    return opts


def _cache_options(args) -> dict:
    options = {"max_kv_size": args.max_kv_size, "max_context": args.max_context}
    options = {k: v for k, v in options.items() if v is not None}
    h2o = _h2o_options(args)
    if h2o and args.cache != "h2o":
        raise ValueError(f"--h2o-* options apply to --cache h2o, not --cache {args.cache}")
    return {**options, **h2o}


def _with_h2o_flags(specs, args):
    """Apply the --h2o-* flags to every h2o spec; options written in a spec win."""
    h2o = _h2o_options(args)
    for spec in specs:
        if spec.policy == "h2o" and h2o:
            m = {"max_kv_size": spec.options["max_kv_size"]} if "max_kv_size" in spec.options else {}
            spec.options = {**m, **h2o, **spec.options}
    return specs


def _system_prompt_tokens(tokenizer, system) -> int:
    """Tokens the chat template spends on the system message (the prefix a system-only chat shares)."""
    full = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "x"}])
    alone = tokenizer.apply_chat_template([{"role": "system", "content": system}])
    n = 0
    while n < min(len(full), len(alone)) and full[n] == alone[n]:
        n += 1
    return n


def _attention_desc() -> str:
    import mlx.core as mx

    from .hook import fast_cpu_attention_enabled

    if fast_cpu_attention_enabled() and mx.default_device() == mx.cpu:
        return f"fused CPU kernel ({mlx_h2o._ext.kernel_isa()}, {mlx_h2o._ext.kernel_threads()} threads)"
    return "mlx-lm stock"


def _layers_desc(model) -> str:
    from .cpu_layers import cpu_layer_kernels_used, mlx_has_layer_kernels

    n = cpu_layer_kernels_used(model)
    if n:
        return f"{n} modules on mlx-h2o's CPU kernels"
    return "MLX's own (the fork's CPU kernels)" if mlx_has_layer_kernels() else "MLX's own"


def _load(args):
    mlx_h2o.use_fast_cpu_attention(args.attention == "fused")
    return mlx_h2o.load(args.model, weights=args.weights)


def cmd_generate(args) -> int:
    from mlx_lm import stream_generate

    if args.prompt is None and args.prompt_file is None:
        raise ValueError("give --prompt or --prompt-file")
    prompt = args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file!r}: {e}") from None
    options = _cache_options(args)
    model, tokenizer = _load(args)
    if args.h2o_pin_system:
        if args.cache != "h2o" or not args.system or not tokenizer.has_chat_template or args.no_chat_template:
            raise ValueError("--h2o-pin-system needs --cache h2o, --system and the chat template")
        span = f"0:{_system_prompt_tokens(tokenizer, args.system)}"
        options["pin"] = ";".join(filter(None, [options.get("pin"), span]))
    cache = mlx_h2o.make_cache(model, args.cache, **options)
    if tokenizer.has_chat_template and not args.no_chat_template:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt = tokenizer.encode(prompt)
    response = None
    kwargs = {"prefill_step_size": args.prefill_step_size} if args.prefill_step_size else {}
    for response in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, prompt_cache=cache, **kwargs):
        print(response.text, end="", flush=True)
    print(flush=True)
    if response is None:
        return 0
    layers = [c for c in cache if hasattr(c, "size")]
    tokens = max((c.size() for c in layers), default=0)
    kv = sum(c.nbytes for c in cache)
    print("=" * 10, file=sys.stderr)
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec", file=sys.stderr)
    print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens-per-sec", file=sys.stderr)
    print(f"Peak memory: {response.peak_memory:.3f} GB", file=sys.stderr)
    print(f"KV cache ({args.cache}): {tokens} tokens per layer, {kv / 2**20:.2f} MiB in {len(cache)} layers", file=sys.stderr)
    print(f"BLAS: {mlx_h2o.blas_backend()}; attention: {_attention_desc()}; layers: {_layers_desc(model)}", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from .evaluation import load_corpus, token_samples
    from .evaluation.corpus import set_samples
    from .evaluation.report import perplexity_markdown, plot_sweep, speed_markdown
    from .evaluation.runner import parse_specs, perplexity_table, speed_table

    specs = _with_h2o_flags(parse_specs(args.cache, args.max_kv_size or ()), args)
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
                                 progress=not args.quiet, policy_batch_size=args.policy_batch)
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
    from .evaluation import load_corpus
    from .evaluation.passkey import passkey_markdown, passkey_trials, run_passkey
    from .evaluation.runner import parse_specs

    if not 0.0 < args.budget <= 1.0:
        raise ValueError(f"--budget must be a fraction in (0, 1], got {args.budget}")
    specs = _with_h2o_flags(parse_specs(args.cache, [max(1, int(args.context * args.budget))]), args)
    model, tokenizer = _load(args)
    trials = passkey_trials(tokenizer, load_corpus(args.text_files), args.context, args.depths, args.per_depth, seed=args.seed)
    rows = run_passkey(model, tokenizer, specs, trials, prefill_step_size=args.prefill_step_size, progress=not args.quiet)
    print(passkey_markdown(rows))
    if args.json:
        _write_json(args.json, {"context": args.context, "budget": args.budget, "passkey": rows})
    return 0


def _write_json(path, payload):
    from .evaluation.report import write_json

    write_json(path, payload)
    print(f"wrote {path}", file=sys.stderr)


def cmd_recall(args) -> int:
    from .evaluation import load_corpus
    from .evaluation.corpus import document_set
    from .evaluation.recall import recall_markdown, recall_sequences, recall_table
    from .evaluation.runner import parse_specs

    specs = _with_h2o_flags(parse_specs(args.cache, args.max_kv_size or ()), args)
    corpus = load_corpus(args.text_files)
    model, tokenizer = _load(args)
    docs = document_set(tokenizer, corpus, args.doc_set, seed=args.seed)
    print(f"doc set {args.doc_set}: " + ", ".join(os.path.basename(d[0]) for d in docs), file=sys.stderr)
    rows = []
    for chunk in args.chunk or [None]:
        for span in args.span:
            for filler in args.filler:
                sequences = recall_sequences(docs, span, filler, args.trials)
                rows += recall_table(model, specs, sequences, chunk=chunk, prefill=args.prefill,
                                     policy_batch_size=args.policy_batch or None, progress=not args.quiet)
    for r in rows:
        r["doc_set"] = args.doc_set
    print(recall_markdown(rows))
    if args.json:
        _write_json(args.json, {"corpus": corpus.name, "doc_set": args.doc_set, "recall": rows})
    return 0


def cmd_options(args) -> int:
    from .options import markdown_table, render_option_tables

    stale = []
    for path in (args.write or []) + (args.check or []):
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        new = render_option_tables(text, mlx_h2o.POLICIES)
        if new == text:
            continue
        if path in (args.write or []):
            with open(path, "w", encoding="utf-8") as f:
                f.write(new)
            print(f"rewrote the option tables in {path}", file=sys.stderr)
        else:
            stale.append(path)
    if stale:
        raise ValueError(f"stale option tables in {', '.join(stale)}: run mlx-h2o options --write {' '.join(stale)}")
    if not (args.write or args.check):
        for name in args.policy or sorted(mlx_h2o.POLICIES):
            if name not in mlx_h2o.POLICIES:
                raise ValueError(f"policy must be one of {sorted(mlx_h2o.POLICIES)}, got {name!r}")
            policy = mlx_h2o.POLICIES[name]
            table = markdown_table(policy) if policy.options else "(no options)"
            print(f"### `{name}`: {policy.summary}\n\n{table}\n")
    return 0


def cmd_convert(args) -> int:
    from .convert import convert

    out = convert(args.out, gguf=args.model, weights=args.weights, force=args.force)
    print(f"wrote {out} (run it with: mlx_lm.generate --model {out} ...)", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-h2o", description="Bounded-memory LLM inference for MLX / mlx-lm.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,eval,passkey,recall,options,convert}")
    policies = sorted(mlx_h2o.POLICIES)

    g = sub.add_parser("generate", help="stream a generation with a chosen KV cache policy")
    _add_model_args(g)
    g.add_argument("--prompt", help="the prompt text")
    g.add_argument("--prompt-file", help="read the prompt from a file")
    g.add_argument("--system", default=None, help="system prompt (chat models)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt raw, without the chat template")
    g.add_argument("--max-tokens", type=_positive_int, default=256)
    g.add_argument("--cache", default="full", choices=policies, help="KV cache policy")
    g.add_argument("--max-kv-size", type=_positive_int, default=None, help="KV budget in tokens for bounded policies")
    g.add_argument("--prefill-step-size", type=_positive_int, default=None, help="prefill the prompt in chunks of this many tokens (mlx-lm default 2048); the h2o cache evicts between chunks")
    _add_h2o_args(g)
    g.add_argument("--h2o-pin-system", action="store_true", help="pin the system prompt's tokens (never evicted)")
    g.add_argument("--max-context", type=_positive_int, default=None, help="tokens reserved by the 'reserved' policy (default: the model's context length)")
    g.set_defaults(func=cmd_generate)

    e = sub.add_parser("eval", help="perplexity / speed / memory of several policies on identical tokens")
    _add_model_args(e)
    e.add_argument("--cache", nargs="+", default=["full", "rotating"], metavar="SPEC", help=f"policies ({', '.join(policies)}), optionally name:key=value,...")
    e.add_argument("--max-kv-size", nargs="+", type=_positive_int, default=None, metavar="M", help="budgets for bounded policies (one row each)")
    e.add_argument("--seq-len", nargs="+", type=_positive_int, default=[512], metavar="L")
    e.add_argument("--samples", type=_positive_int, default=4, help="number of samples, each from a different document")
    e.add_argument("--prefill", type=_positive_int, default=32, help="tokens prefilled in one call before token-by-token decoding")
    e.add_argument("--batch-size", type=_positive_int, default=None, help="samples decoded together (default: all)")
    e.add_argument("--text-files", nargs="+", default=None, help="evaluate on these text files instead of the default corpus")
    e.add_argument("--seed", type=int, default=0)
    _add_doc_set_args(e)
    e.add_argument("--speed-context", type=_positive_int, default=None, help="also measure decode speed after a context of this many tokens")
    e.add_argument("--speed-steps", type=_positive_int, default=64)
    e.add_argument("--json", default=None, help="write all results to this JSON file")
    e.add_argument("--plot", default=None, help="write a PNG of ΔPPL vs budget (or length) here")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_h2o_args(e)
    e.set_defaults(func=cmd_eval)

    k = sub.add_parser("passkey", help="passkey retrieval: a number hidden in real text, asked for at the end")
    _add_model_args(k)
    k.add_argument("--cache", nargs="+", default=["full", "rotating", "h2o"], metavar="SPEC", help="policies, optionally name:key=value,...")
    k.add_argument("--context", type=_positive_int, default=1024, help="prompt length in tokens")
    k.add_argument("--budget", type=float, default=0.25, help="KV budget of bounded policies as a fraction of --context")
    k.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9], help="needle depths (0 = start, 1 = end)")
    k.add_argument("--per-depth", type=_positive_int, default=3, help="trials per depth, each from another document")
    k.add_argument("--prefill-step-size", type=_positive_int, default=None, help="prefill chunk (default: the whole prompt in one call)")
    k.add_argument("--text-files", nargs="+", default=None, help="haystacks from these text files instead of the default corpus")
    k.add_argument("--seed", type=int, default=0)
    k.add_argument("--json", default=None)
    k.add_argument("--quiet", action="store_true")
    _add_h2o_args(k)
    k.set_defaults(func=cmd_passkey)

    r = sub.add_parser("recall", help="recall probe: a span of real text, unrelated filler, the span again (NLL on the repeat)")
    _add_model_args(r)
    r.add_argument("--cache", nargs="+", default=["full", "rotating", "h2o"], metavar="SPEC", help="policies, optionally name:key=value,... (give full and rotating for the recovered share)")
    r.add_argument("--max-kv-size", nargs="+", type=_positive_int, default=[256], metavar="M", help="budgets for bounded policies")
    r.add_argument("--span", nargs="+", type=_positive_int, default=[64], metavar="S", help="span lengths in tokens")
    r.add_argument("--filler", nargs="+", type=_positive_int, default=[1000], metavar="F", help="filler lengths in tokens between the span and its repeat")
    r.add_argument("--trials", type=_positive_int, default=4, help="sequences per (span, filler), each span from another document of the set")
    r.add_argument("--chunk", nargs="+", type=_positive_int, default=None, metavar="C", help="feed everything before the repeat as a prompt in chunks of C tokens (prefill-time eviction); default: token by token")
    r.add_argument("--prefill", type=_positive_int, default=32, help="tokens prefilled in one call before token-by-token decoding")
    r.add_argument("--policy-batch", type=_positive_int, default=None, help="policies decoded together in one batch (default: all)")
    r.add_argument("--text-files", nargs="+", default=None, help="documents from these text files instead of the default corpus")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--doc-set", type=int, default=0, help="document set (0 = tuning, 1 and 2 = held out; disjoint sets of 8 documents)")
    r.add_argument("--json", default=None)
    r.add_argument("--quiet", action="store_true")
    _add_h2o_args(r)
    r.set_defaults(func=cmd_recall)

    o = sub.add_parser("options", help="the cache policies' options (the tables the docs show)")
    o.add_argument("policy", nargs="*", help=f"print these policies' option tables ({', '.join(policies)}; default: all)")
    o.add_argument("--write", nargs="+", metavar="FILE", help="rewrite the generated option tables in these Markdown files")
    o.add_argument("--check", nargs="+", metavar="FILE", help="fail if a generated option table in these files is stale")
    o.set_defaults(func=cmd_options)

    c = sub.add_parser("convert", help="write a GGUF (default: the embedded model) as an mlx-lm model directory")
    c.add_argument("--out", required=True, help="the directory to write (must not exist or be empty)")
    c.add_argument("--model", default=None, help="a llama .gguf file (default: embedded SmolLM2-135M-Instruct)")
    c.add_argument("--weights", default=None, choices=["quantized", "float32", "bfloat16", "float16"],
                   help="the GGUF's packed weights or dequantized to a dtype (default: packed, as mlx_h2o.load())")
    c.add_argument("--force", action="store_true", help="replace an existing --out directory")
    c.set_defaults(func=cmd_convert)
    return parser


def main(argv=None) -> int:
    # The command opts its own process in to OpenBLAS matmuls before anything loads MLX (importing the
    # package does not); each model command prints the BLAS in use. MLX_H2O_BLAS=reference opts out.
    use_openblas()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mlx-h2o {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
