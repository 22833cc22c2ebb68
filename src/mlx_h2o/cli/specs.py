"""What a model subcommand runs: --kv-policy and --kv-option (with generate's shorthand flags) as
PolicySpecs."""

from .flags import DEFAULT_POLICIES, RECALL_MAX_KV_SIZE

# ------------------------------------------------------------------------------ options of the caches


def _kv_options(args, *shorthands) -> dict:
    """{key: text} of --kv-option (a later one wins), with the shorthand flags (flag, key, value)
    folded in; a shorthand and a --kv-option of the same key must agree."""
    from ..options import parse_key_values

    options = parse_key_values(args.kv_option or [], "--kv-option")
    for flag, key, value in shorthands:
        if value is None:
            continue
        if key in options and options[key] != str(value):
            raise ValueError(f"{flag} {value} and --kv-option {key}={options[key]} disagree")
        options[key] = str(value)
    return options


def _policy_specs(args, max_kv_sizes=(), options=None):
    """The listed policies (--kv-policy, or the subcommand's default) as PolicySpecs, --kv-option
    applied to every one that takes it."""
    from ..evaluation.runner import parse_specs

    policies = args.kv_policy or DEFAULT_POLICIES[args.command]
    return parse_specs(policies, max_kv_sizes, options=_kv_options(args) if options is None else options)


def _sweep_specs(args, default_sizes=()):
    """eval / recall: the policies over the --max-kv-size sweep."""
    options = _kv_options(args)
    if args.max_kv_size and "max_kv_size" in options:
        raise ValueError("give the budgets with --max-kv-size or with --kv-option max_kv_size, not both")
    sizes = args.max_kv_size or ([] if "max_kv_size" in options else default_sizes)
    return _policy_specs(args, sizes, options)


def _generate_spec(args):
    """generate's one policy: --max-kv-size and --max-context are shorthands of --kv-option."""
    policies = args.kv_policy or DEFAULT_POLICIES["generate"]
    if len(policies) != 1:
        raise ValueError(f"generate runs one policy, got --kv-policy {' '.join(policies)}")
    options = _kv_options(args, ("--max-kv-size", "max_kv_size", args.max_kv_size),
                          ("--max-context", "max_context", args.max_context))
    return _policy_specs(args, (), options)[0]


def _cache_options(args) -> dict:
    """The options generate builds its cache with."""
    return dict(_generate_spec(args).options)


def _command_specs(args):
    """What a model subcommand runs: generate its one PolicySpec, eval / passkey / recall a list."""
    if args.command == "generate":
        return _generate_spec(args)
    if args.command == "passkey":
        if not 0.0 < args.budget <= 1.0:
            raise ValueError(f"--budget must be a fraction in (0, 1], got {args.budget}")
        return _policy_specs(args, [max(1, int(args.context * args.budget))])
    return _sweep_specs(args, [RECALL_MAX_KV_SIZE] if args.command == "recall" else ())
