"""`mlx-h2o generate`: stream a generation with one KV cache policy."""

import sys

import mlx_h2o

from .._allocator import allocator_description
from .model import _attention_desc, _layers_desc, _load
from .specs import _command_specs


def _system_prompt_tokens(tokenizer, system) -> int:
    """Tokens the chat template spends on the system message (the prefix a system-only chat shares)."""
    full = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": "x"}])
    alone = tokenizer.apply_chat_template([{"role": "system", "content": system}])
    n = 0
    while n < min(len(full), len(alone)) and full[n] == alone[n]:
        n += 1
    return n


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
    spec = _command_specs(args)
    options = dict(spec.options)
    if args.pin_system:
        pinning = sorted(n for n, p in mlx_h2o.POLICIES.items() if any(o.name == "pin" for o in p.options))
        if spec.policy not in pinning:
            raise ValueError(f"--pin-system pins through the policy's pin option: policy {spec.policy!r} has none "
                             f"(policies with one: {', '.join(pinning)})")
        if not args.system or args.no_chat_template:
            raise ValueError("--pin-system needs --system and the chat template")
    model, tokenizer = _load(args)
    if args.pin_system:
        if not tokenizer.has_chat_template:
            raise ValueError("--pin-system needs the chat template: this model has none")
        options["pin"] = (*(options.get("pin") or ()), (0, _system_prompt_tokens(tokenizer, args.system)))
    cache = mlx_h2o.make_cache(model, spec.policy, **options)
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
    tokens = max((c.size() or getattr(c, "offset", 0) for c in layers), default=0)  # mlx-lm's QuantizedKVCache has no size()
    kv = sum(c.nbytes for c in cache)
    print("=" * 10, file=sys.stderr)
    print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens-per-sec", file=sys.stderr)
    print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens-per-sec", file=sys.stderr)
    print(f"Peak memory: {response.peak_memory:.3f} GB", file=sys.stderr)
    rows = _row_dtype(layers)
    print(f"KV cache ({spec.policy}): {tokens} tokens per layer, {kv / 2**20:.2f} MiB in {len(cache)} layers"
          + (f" ({rows} rows)" if rows else ""), file=sys.stderr)
    print(f"BLAS: {mlx_h2o.blas_backend()}; attention: {_attention_desc()}; layers: {_layers_desc(model)}; "
          f"large buffers: {allocator_description()}", file=sys.stderr)
    return 0


def _row_dtype(layers):
    """The dtype a cache's dense K/V rows are kept in ("float16"), or None where they are packed or unknown."""
    from ..storage import dtype_name  # mlx.core: after the command's BLAS choice

    for c in layers:
        if getattr(getattr(getattr(c, "config", None), "storage", None), "kv_bits", None) is not None:
            return None  # h2o's packed rows (row_dtype is what they are packed from)
        dtype = getattr(c, "row_dtype", None) or getattr(getattr(c, "keys", None), "dtype", None)
        if dtype is not None:
            return dtype_name(dtype)
    return None
