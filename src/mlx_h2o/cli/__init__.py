"""`mlx-h2o`: generate with a bounded cache, or measure policies side by side.

    mlx-h2o generate --prompt "..." --kv-policy rotating --max-kv-size 256
    mlx-h2o generate --prompt "..." --kv-policy h2o --max-kv-size 256 --kv-option split=heavy --kv-option score=ema
    mlx-h2o eval --kv-policy full rotating --max-kv-size 128 256 512 --seq-len 2048 --samples 4
    mlx-h2o eval --kv-policy full rotating h2o h2o:score=ema,select=layer --max-kv-size 128 256
    mlx-h2o eval --kv-policy h2o h2o:kv_bits=mixed --kv-option score=ema --max-kv-size 256

The cache is spelled as in the patched mlx-lm (`mlx_lm.generate --kv-policy NAME --kv-option
KEY=VALUE`): `--kv-policy` names the policy (generate) or the policies to compare (eval, passkey,
recall), each optionally with its own options as `NAME:KEY=VALUE,...`; every `--kv-option` applies to
each listed policy that has that option (a policy's own options win). `mlx-h2o options NAME` prints a
policy's options. The old spellings `--cache` and `--h2o-*` still work for one release, with a warning.
"""

import argparse
import sys

import mlx_h2o

from .._allocator import limit_mlx_buffer_cache, use_mmap_for_large_buffers
from .._blas import use_openblas
from .flags import (DEFAULT_POLICIES, RECALL_MAX_KV_SIZE, _data_parent, _Deprecated, _epilog, _kv_parent, _model_parent,
                    _positive_int, _prefill_step_parent, _sweep_parent)
from .generate import cmd_generate
from .measure import cmd_eval, cmd_passkey, cmd_demo, cmd_recall, cmd_recall_suite
from .specs import _cache_options, _command_specs
from .tools import cmd_convert, cmd_options

__all__ = ["DEFAULT_POLICIES", "RECALL_MAX_KV_SIZE", "build_parser", "main", "cmd_generate", "cmd_eval", "cmd_passkey",
           "cmd_recall", "cmd_recall_suite", "cmd_demo", "cmd_options", "cmd_convert", "_cache_options", "_command_specs"]


RECALL_SUITE_EPILOG = """caches at every budget B (a fraction of the full cache's bytes at the context), beside the full cache:
  window fp      mlx-lm's RotatingKVCache of B / (full bytes per token) entries
  window 8-bit   h2o split=window,kv_bits=8 at max_kv_bytes=B (sinks + a sliding window, no eviction by score)
  h2o            h2o max_kv_bytes=B (the byte rule)
  h2o + archive  h2o max_kv_bytes=B,evicted_bits=2,score=cumulative
every prompt is fed token by token (the perplexity protocol); each cell is the share of the full cache's success that survives.
--cache NAME=SPEC (repeatable) replaces these with your own, {B} standing for the budget's bytes and {M} for the fp window's entries.
example: mlx-h2o recall-suite --context 2048 4096 --budget 0.1 0.2 --doc-set 1 --json suite.json
         mlx-h2o recall-suite --probes needle passkey --cache "8-bit=h2o:max_kv_bytes={B},split=window,kv_bits=8" --cache "h2o=h2o:max_kv_bytes={B}"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-h2o", description="Bounded-memory LLM inference for MLX / mlx-lm.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,eval,passkey,recall,recall-suite,demo,options,convert}")
    policies = sorted(mlx_h2o.POLICIES)
    model, kv, data, sweep, prefill_step = _model_parent(), _kv_parent(), _data_parent(), _sweep_parent(), _prefill_step_parent()

    def model_command(name, help, parents):
        return sub.add_parser(name, help=help, parents=[model, kv, *parents], epilog=_epilog(name),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    g = model_command("generate", "stream a generation with a chosen KV cache policy", [prefill_step])
    g.add_argument("--prompt", help="the prompt text")
    g.add_argument("--prompt-file", help="read the prompt from a file")
    g.add_argument("--system", default=None, help="system prompt (chat models)")
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt raw, without the chat template")
    g.add_argument("--max-tokens", type=_positive_int, default=256)
    g.add_argument("--max-kv-size", type=_positive_int, default=None, help="KV budget in tokens: --kv-option max_kv_size=N")
    g.add_argument("--max-context", type=_positive_int, default=None, help="tokens the 'reserved' policy reserves: --kv-option max_context=N (default: the model's context length)")
    g.add_argument("--pin-system", action="store_true", help="pin the system prompt's tokens (never evicted) through the policy's pin option")
    g.add_argument("--h2o-pin-system", nargs=0, action=_Deprecated, use="--pin-system",
                   apply=lambda ns, _: setattr(ns, "pin_system", True))
    g.set_defaults(func=cmd_generate)

    e = model_command("eval", "perplexity / speed / memory of several policies on identical tokens", [data, sweep])
    e.add_argument("--seq-len", nargs="+", type=_positive_int, default=[512], metavar="L")
    e.add_argument("--samples", type=_positive_int, default=4, help="number of samples, each from a different document")
    e.add_argument("--batch-size", type=_positive_int, default=None, help="samples decoded together (default: all)")
    e.add_argument("--speed-context", type=_positive_int, default=None, help="also measure decode speed after a context of this many tokens")
    e.add_argument("--speed-steps", type=_positive_int, default=64)
    e.add_argument("--plot", default=None, help="write a PNG of ΔPPL vs budget (or length) here")
    e.add_argument("--score-after-prefill", action="store_true",
                   help="score only the tokens predicted after the --prefill call (kvpress's protocol: --seq-len 1793 "
                        "--prefill 1536 scores the 256 tokens after a 1536-token context)")
    e.set_defaults(func=cmd_eval)

    k = model_command("passkey", "passkey retrieval: a number hidden in real text, asked for at the end", [data, prefill_step])
    k.add_argument("--context", type=_positive_int, default=1024, help="prompt length in tokens")
    k.add_argument("--budget", type=float, default=0.25, help="KV budget of bounded policies as a fraction of --context")
    k.add_argument("--depths", nargs="+", type=float, default=[0.1, 0.3, 0.5, 0.7, 0.9], help="needle depths (0 = start, 1 = end)")
    k.add_argument("--per-depth", type=_positive_int, default=3, help="trials per depth, each from another document")
    k.set_defaults(func=cmd_passkey)

    r = model_command("recall", "recall probe: a span of real text, unrelated filler, the span again (NLL on the repeat)", [data, sweep])
    r.add_argument("--span", nargs="+", type=_positive_int, default=[64], metavar="S", help="span lengths in tokens")
    r.add_argument("--filler", nargs="+", type=_positive_int, default=[1000], metavar="F", help="filler lengths in tokens between the span and its repeat")
    r.add_argument("--trials", type=_positive_int, default=4, help="sequences per (span, filler), each span from another document of the set")
    r.add_argument("--chunk", nargs="+", type=_positive_int, default=None, metavar="C", help="feed everything before the repeat as a prompt in chunks of C tokens (prefill-time eviction); default: token by token")
    r.set_defaults(func=cmd_recall)

    u = sub.add_parser("recall-suite", help="needle (paraphrase, decoy), passkey and span recall of every cache at equal bytes",
                       parents=[model, data], epilog=RECALL_SUITE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    u.add_argument("--context", nargs="+", type=_positive_int, default=[2048], metavar="T", help="context lengths in tokens")
    u.add_argument("--budget", nargs="+", type=float, default=[0.1, 0.2], metavar="F",
                   help="KV bytes per sequence as fractions of the full cache's at the context")
    u.add_argument("--probes", nargs="+", choices=["needle", "passkey", "span"], default=["needle", "passkey", "span"])
    u.add_argument("--per-depth", type=_positive_int, default=1, help="needle and passkey trials per depth (depths 25, 50, 75 %%)")
    u.add_argument("--span-trials", type=_positive_int, default=4, help="span probe sequences, each from another document")
    u.add_argument("--doc-set", type=int, default=1, help="document set (0 tunes the defaults; 1 and 2 are held out; default 1)")
    u.add_argument("--policy-batch", type=_positive_int, default=None, help="caches decoded together (default: all)")
    u.add_argument("--cache", action="append", default=None, metavar="NAME=SPEC",
                   help="a cache to compare instead of the default ones (repeatable): a policy spec where {B} is the budget in bytes, "
                        "{M} the fp window's entries, {D} the model's dtype (the default windows keep rows in it: "
                        "'window fp=rotating:max_kv_size={M},kv_dtype={D}')")
    u.set_defaults(func=cmd_recall_suite)

    d = sub.add_parser("demo", help="the main job: full vs windows vs h2o at equal bytes on a long context (table, plot, verdicts)",
                       parents=[model, data], formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="example: mlx-h2o demo --context 2048 --budget 0.0625 0.125 0.25 --json demo.json --plot demo.png")
    d.add_argument("--context", type=_positive_int, default=2048, help="tokens of context (default 2048)")
    d.add_argument("--budget", nargs="+", type=float, default=[1 / 16, 1 / 8, 1 / 4], metavar="F",
                   help="KV bytes per sequence as fractions of the full cache's (default 1/16 1/8 1/4)")
    d.add_argument("--samples", type=_positive_int, default=1,
                   help="documents for perplexity (default 1: the demo's 8 minutes; docs/h2o.md runs 2)")
    d.add_argument("--span-trials", type=_positive_int, default=1, help="span recall sequences (default 1; docs/h2o.md runs 2)")
    d.add_argument("--doc-set", type=int, default=1, help="document set (0 tunes the defaults; 1 and 2 are held out; default 1)")
    d.add_argument("--plot", default=None, help="write the PNG of ΔPPL and recall against the bytes here")
    d.set_defaults(func=cmd_demo)

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
    # The command opts its own process in to OpenBLAS matmuls before anything loads MLX, and to freed
    # large buffers going back to the system, MLX's included (importing the package does neither);
    # the generate command prints both. MLX_H2O_BLAS=reference and MLX_H2O_ALLOCATOR=glibc opt out.
    use_openblas()
    use_mmap_for_large_buffers()
    limit_mlx_buffer_cache()  # (after use_openblas: it loads MLX)
    args = build_parser().parse_args(argv)
    from .. import hook

    # A model command picks the attention for its run (--attention); called in-process, it leaves
    # the caller's choice as it found it.
    attention = hook.fast_cpu_attention_setting()
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"mlx-h2o {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        hook.use_fast_cpu_attention(attention)
