"""Options of cache policies, declared once.

Each policy states its options as a table of `Option`s (name, kind, default, help); a policy made
of parts declares them as dataclass fields (`option`), and `options_of` makes the table. The table is
what `make_cache` validates against, what the CLI builds its flags from, how `name:key=value` specs
and mlx-lm's `--kv-option KEY=VALUE` strings are parsed, and what the option tables in README.md
and docs/policies.md are generated from (`mlx-h2o options --write FILE`).
"""

import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, Mapping, Sequence, Tuple

from .option_kinds import Bytes, Choice, Custom, Flag, Float, Int, check_choice, check_int  # noqa: F401  (the kinds options take)

# -------------------------------------------------------------------------------------------- options

REQUIRED = object()  # the default of an option that must be given


@dataclass(frozen=True)
class Option:
    """One option of a policy. `default=None` means unset (the policy decides); None is then also
    accepted as a value and spelled `none` in text."""

    name: str
    kind: Any
    default: Any = None
    help: str = ""
    instead: Tuple[str, ...] = ()  # options a required one may be replaced by (max_kv_size: max_kv_bytes)

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def check(self, value):
        if value is None and self.default is None:
            return None
        return self.kind.check(self.name, value)

    def parse(self, text: str):
        if self.default is None and text.strip().lower() == "none":
            return None
        return self.kind.check(self.name, self.kind.parse(self.name, text.strip()))

    def describe_default(self) -> str:
        if self.required:
            return "required" + "".join(f" (or `{n}`)" for n in self.instead)
        return "unset" if self.default is None else f"`{json.dumps(self.default) if isinstance(self.default, bool) else self.default}`"


def option(kind, default=None, help: str = "", instead: Tuple[str, ...] = ()):
    """A dataclass field that is also a policy option named after the field: the parts of a policy
    declare their options once, as fields (`options_of` makes the table). A required option may
    name options that can be given `instead` (it is then None)."""
    return field(default=None if default is REQUIRED else default, metadata={"option": (kind, default, help, tuple(instead))})


def options_of(*classes) -> Tuple[Option, ...]:
    """The option table of dataclasses whose fields are `option`s, in field order."""
    return tuple(Option(f.name, *f.metadata["option"]) for cls in classes for f in fields(cls) if "option" in f.metadata)


def option_names(cls) -> Tuple[str, ...]:
    return tuple(f.name for f in fields(cls) if "option" in f.metadata)


def unknown_options(policy: str, table: Sequence[Option], names) -> ValueError:
    allowed = ", ".join(o.name for o in table) or "none"
    return ValueError(f"unknown option(s) {', '.join(sorted(names))} for policy {policy!r}; its options: {allowed}")


def check_options(policy: str, table: Sequence[Option], options: Mapping[str, Any]) -> Dict[str, Any]:
    """Every option of `table`, checked: given values normalised, the rest at their default."""
    unknown = set(options) - {o.name for o in table}
    if unknown:
        raise unknown_options(policy, table, unknown)
    checked = {}
    for o in table:
        if o.name in options:
            checked[o.name] = o.check(options[o.name])
        elif o.required and not any(options.get(n) is not None for n in o.instead):
            raise ValueError(f"policy {policy!r} needs {' or '.join((o.name, *o.instead))} ({o.help})")
        else:
            checked[o.name] = None if o.required else o.default
    return checked


@dataclass(frozen=True)
class Policy:
    """A cache policy: its options and how it builds one cache per layer."""

    name: str
    summary: str
    options: Tuple[Option, ...]
    build: Callable  # build(model, **checked options) -> list of per-layer caches
    cache_classes: Tuple[type, ...] = ()  # the classes its caches may be (for load_prompt_cache)

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise unknown_options(self.name, self.options, [name])

    def check_options(self, options: Mapping[str, Any]) -> Dict[str, Any]:
        return check_options(self.name, self.options, options)

    def parse_options(self, texts: Mapping[str, str]) -> Dict[str, Any]:
        """`{"max_kv_size": "512"}` -> `{"max_kv_size": 512}` (only the options given)."""
        return {k: self.option(k).parse(v) for k, v in texts.items()}

    def make(self, model, **options):
        checked = self.check_options(options)
        if self.takes("kv_dtype") and checked["kv_dtype"] is None:
            from .storage import default_kv_dtype

            checked["kv_dtype"] = default_kv_dtype(model)
        return self.build(model, **checked)

    def takes(self, name: str) -> bool:
        """Has an option called `name`."""
        return any(o.name == name for o in self.options)

    @property
    def bounded(self) -> bool:
        """Takes a `max_kv_size` budget."""
        return self.takes("max_kv_size")


def parse_key_values(items: Sequence[str], what: str = "option") -> Dict[str, str]:
    """["k=v", ...] -> {"k": "v"} (keys with '-' normalised to '_')."""
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{what}s are KEY=VALUE, got {item!r}")
        out[key.strip().replace("-", "_")] = value.strip()
    return out


def markdown_table(policy: Policy) -> str:
    """The Markdown table of a policy's options."""
    lines = ["| option | values | default | what it does |", "|---|---|---|---|"]
    for o in policy.options:
        lines.append(f"| `{o.name}` | {o.kind.describe()} | {o.describe_default()} | {o.help} |")
    return "\n".join(lines)


# Generated option tables in Markdown files sit between these markers, e.g.
#   <!-- options: h2o (generated by `mlx-h2o options --write FILE`) -->
#   ...table...
#   <!-- end options -->
_BLOCK = re.compile(r"(<!-- options: (\w+) [^>]*-->\n)(.*?)(<!-- end options -->)", re.S)


def render_option_tables(text: str, policies: Mapping[str, Policy]) -> str:
    """`text` with every generated option table block rewritten from `policies`."""
    return _BLOCK.sub(lambda m: m.group(1) + markdown_table(policies[m.group(2)]) + "\n" + m.group(4), text)
