"""The flags of `mlx-h2o`'s subcommands: their argparse types, the deprecated spellings, the parent
parsers that declare each shared flag once, and the help epilogs."""

import argparse
import sys

import mlx_h2o

# --kv-policy when none is given, per subcommand
DEFAULT_POLICIES = {
    "generate": ["full"],
    "eval": ["full", "rotating"],
    "passkey": ["full", "rotating", "h2o"],
    "recall": ["full", "rotating", "h2o"],
}
RECALL_MAX_KV_SIZE = 256  # recall's budget when neither --max-kv-size nor --kv-option max_kv_size gives one


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _policy_spec(text):
    """argparse type of --kv-policy: `NAME` or `NAME:KEY=VALUE,...` with a known NAME (the options
    are checked once all flags are read, against the options the policy takes)."""
    name = text.partition(":")[0]
    if name not in mlx_h2o.POLICIES:
        raise argparse.ArgumentTypeError(f"invalid choice: {name!r} (choose from {', '.join(sorted(mlx_h2o.POLICIES))})")
    return text


def _key_value(text):
    """argparse type of --kv-option: KEY=VALUE, as options.parse_key_values reads it."""
    from ..options import parse_key_values

    try:
        parse_key_values([text])
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an option as `mlx-h2o options NAME` prints them), got {text!r}") from None
    return text


# ------------------------------------------------------------------------------- deprecated spellings
# `--cache` and the `--h2o-*` flags, kept for one release: each use prints one warning line and
# stores what the new spelling would.


def _warn_deprecated(flag: str, use: str):
    print(f"mlx-h2o: warning: {flag} is deprecated and will be removed in the next release; use {use}", file=sys.stderr)


class _Deprecated(argparse.Action):
    """An old flag: warns, then `apply(namespace, values)` sets the new spelling's destination."""

    def __init__(self, option_strings, dest, use, apply, **kwargs):
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.use, self.apply = use, apply

    def __call__(self, parser, namespace, values, option_string=None):
        _warn_deprecated(option_string, self.use)
        self.apply(namespace, values)


def _append_kv_option(namespace, item: str):
    namespace.kv_option = [*(getattr(namespace, "kv_option", None) or []), item]


def _add_deprecated_h2o_flags(p):
    """`--h2o-NAME VALUE` for every h2o option but the budget: `--kv-option NAME=VALUE` now (no other
    policy has an option of those names, so the value reaches the h2o specs as it did)."""
    from ..caches.h2o import OPTIONS
    from ..options import Flag

    for o in OPTIONS:
        if o.name == "max_kv_size":
            continue
        flag = f"--h2o-{o.name.replace('_', '-')}"
        if isinstance(o.kind, Flag):
            p.add_argument(flag, nargs=0, action=_Deprecated, use=f"--kv-option {o.name}=true",
                           apply=lambda ns, _, name=o.name: _append_kv_option(ns, f"{name}=true"))
        elif o.name == "pin":
            p.add_argument(flag, nargs="+", action=_Deprecated, use="--kv-option 'pin=START:END;START:END'",
                           apply=lambda ns, spans: _append_kv_option(ns, "pin=" + ";".join(spans)))
        else:
            p.add_argument(flag, action=_Deprecated, use=f"--kv-option {o.name}=...",
                           apply=lambda ns, text, name=o.name: _append_kv_option(ns, f"{name}={text}"))


# ------------------------------------------------------------------------------ shared parent parsers


def _policies_text() -> str:
    width = max(map(len, mlx_h2o.POLICIES))
    return "\n".join(f"  {name:<{width}}  {p.summary}" for name, p in sorted(mlx_h2o.POLICIES.items()))


def _model_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="a .gguf file or an mlx-lm model directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--weights", default=None, choices=["float32", "bfloat16", "float16", "quantized"], help="GGUF weights: dequantized dtype or packed (default: packed, as mlx_h2o.load())")
    g.add_argument("--attention", default="fused", choices=["fused", "stock"], help="attention on CPU: mlx-h2o's fused kernel (default) or mlx-lm's stock path")
    return p


def _kv_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("KV cache (spelled as mlx-lm's --kv-policy / --kv-option)")
    g.add_argument("--kv-policy", nargs="+", type=_policy_spec, default=None, metavar="NAME",
                   help="the KV cache policy (generate: one; eval, passkey, recall: those to compare; the policies and "
                        "the default are listed below). NAME:KEY=VALUE,... gives a policy its own options, over "
                        "--kv-option: two variants of one policy side by side, e.g. --kv-policy h2o h2o:kv_bits=mixed")
    g.add_argument("--kv-option", action="append", type=_key_value, default=None, metavar="KEY=VALUE",
                   help="an option of the listed policies, as `mlx-h2o options NAME` prints them (repeatable); it applies "
                        "to every listed policy that has the option")
    g.add_argument("--cache", nargs="+", type=_policy_spec, action=_Deprecated, use="--kv-policy",
                   apply=lambda ns, specs: setattr(ns, "kv_policy", specs))
    _add_deprecated_h2o_flags(g)
    return p


def _data_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--text-files", nargs="+", default=None, help="documents from these text files instead of the default corpus")
    p.add_argument("--seed", type=int, default=0, help="seed of the document order (default: 0)")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _sweep_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--max-kv-size", nargs="+", type=_positive_int, default=None, metavar="M",
                   help=f"budgets of the bounded policies, one row each (eval: no default; recall: {RECALL_MAX_KV_SIZE}); "
                        "--kv-option max_kv_size=M or NAME:max_kv_size=M fix one instead")
    p.add_argument("--prefill", type=_positive_int, default=32, help="tokens prefilled in one call before token-by-token decoding")
    p.add_argument("--doc-set", type=int, default=None,
                   help="draw the documents from set K (0 = tuning, 1 and 2 = held out; disjoint sets of 8 documents); "
                        "default: eval the seeded document order, recall set 0")
    p.add_argument("--policy-batch", type=_positive_int, default=None,
                   help="decode this many policies together in one batch (same NLLs; the model's weights are read once "
                        "per step for all); default: eval 1, recall all")
    return p


def _prefill_step_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--prefill-step-size", type=_positive_int, default=None,
                   help="prefill the prompt in chunks of this many tokens (the h2o cache evicts between chunks); "
                        "default: generate mlx-lm's 2048, passkey the whole prompt in one call")
    return p


EXAMPLES = {
    "generate": 'mlx-h2o generate --prompt "..." --kv-policy h2o --max-kv-size 256 --kv-option kv_bits=mixed',
    "eval": "mlx-h2o eval --kv-policy full h2o h2o:kv_bits=mixed --kv-option score=ema --max-kv-size 128 256",
    "passkey": "mlx-h2o passkey --kv-policy full rotating h2o h2o:obs_window=32 --context 2048 --budget 0.25",
    "recall": "mlx-h2o recall --kv-policy full rotating h2o --kv-option chunk=4 --max-kv-size 256 --doc-set 1",
}


def _epilog(command: str) -> str:
    which = "" if command == "generate" else ";\neach applies to every listed policy that has the option (a NAME:KEY=VALUE,... of its own wins)"
    return (f"KV cache policies (--kv-policy NAME; default: {' '.join(DEFAULT_POLICIES[command])}):\n"
            f"{_policies_text()}\n\n"
            f"--kv-option KEY=VALUE takes the policy's options as printed by `mlx-h2o options NAME`{which}.\n"
            f"example: {EXAMPLES[command]}")
