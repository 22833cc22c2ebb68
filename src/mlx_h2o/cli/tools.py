"""`mlx-h2o options` and `convert`: the commands that decode nothing."""

import sys

import mlx_h2o


def cmd_options(args) -> int:
    from ..options import markdown_table, render_option_tables

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
    from ..convert import convert

    out = convert(args.out, gguf=args.model, weights=args.weights, force=args.force)
    print(f"wrote {out} (run it with: mlx_lm.generate --model {out} ...)", file=sys.stderr)
    return 0
