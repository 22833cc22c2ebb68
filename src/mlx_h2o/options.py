"""Options of cache policies, declared once.

Each policy states its options as a table of `Option`s (name, kind, default, help). The table is
what `make_cache` validates against, what the CLI builds its flags from, how `name:key=value` specs
and mlx-lm's `--kv-option KEY=VALUE` strings are parsed, and what the option tables in README.md
and docs/policies.md are generated from (`mlx-h2o options --write FILE`).
"""

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

# -------------------------------------------------------------------------------------------- checks


def check_int(name: str, value, low: Optional[int] = None, high: Optional[int] = None) -> int:
    """`value` as an int in [low, high] (either bound may be None), else a ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer {_int_range(low, high)}, got {value!r}")
    return int(value)


def _int_range(low, high) -> str:
    if low is not None and high is not None:
        return f"in [{low}, {high}]"
    if low is not None:
        return f">= {low}"
    return f"<= {high}" if high is not None else ""


def check_choice(name: str, value, choices: Sequence, aliases: Optional[Mapping] = None):
    """`value` (or what it is an alias of) if it is one of `choices`, else a ValueError listing them."""
    if aliases and _hashable(value) and value in aliases:
        value = aliases[value]
    if _hashable(value) and value in choices and not isinstance(value, bool):
        return value
    listed = ", ".join(repr(c) for c in (*choices, *(aliases or {})))
    raise ValueError(f"{name} must be one of {listed}, got {value!r}")


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


# ---------------------------------------------------------------------------------------------- kinds
# A kind checks a Python value (normalising it) and parses the text form of one.


@dataclass(frozen=True)
class Int:
    low: Optional[int] = None
    high: Optional[int] = None

    def check(self, name, value):
        return check_int(name, value, self.low, self.high)

    def parse(self, name, text: str):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer {_int_range(self.low, self.high)}, got {text!r}") from None

    def describe(self) -> str:
        return f"integer {_int_range(self.low, self.high)}".strip()


@dataclass(frozen=True)
class Float:
    low: float
    high: float  # exclusive

    def check(self, name, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not self.low <= value < self.high:
            raise ValueError(f"{name} must be a number in [{self.low}, {self.high}), got {value!r}")
        return float(value)

    def parse(self, name, text: str):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{name} must be a number in [{self.low}, {self.high}), got {text!r}") from None

    def describe(self) -> str:
        return f"number in [{self.low}, {self.high})"


@dataclass(frozen=True)
class Choice:
    choices: Tuple
    aliases: Tuple[Tuple[Any, Any], ...] = ()  # (alias, value) pairs

    def check(self, name, value):
        return check_choice(name, value, self.choices, dict(self.aliases))

    def names(self) -> Tuple:
        """What a user can write: the choices and the aliases spelled differently from them."""
        spelled = {str(c) for c in self.choices}
        return (*self.choices, *(a for a, _ in self.aliases if isinstance(a, str) and a not in spelled))

    def parse(self, name, text: str):
        for c in self.names():
            if str(c) == text:
                return dict(self.aliases).get(c, c)
        return self.check(name, text)  # raises, listing the choices

    def describe(self) -> str:
        return " \\| ".join(f"`{c}`" for c in self.names())


@dataclass(frozen=True)
class Flag:
    def check(self, name, value):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
        return value

    def parse(self, name, text: str):
        return self.check(name, {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower(), text))

    def describe(self) -> str:
        return "true \\| false"


@dataclass(frozen=True)
class Custom:
    """A kind with its own check (value -> normalised value) and text parser."""

    checker: Callable[[str, Any], Any]
    parser: Callable[[str, str], Any]
    description: str

    def check(self, name, value):
        return self.checker(name, value)

    def parse(self, name, text: str):
        return self.checker(name, self.parser(name, text))

    def describe(self) -> str:
        return self.description


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
            return "required"
        return "unset" if self.default is None else f"`{json.dumps(self.default) if isinstance(self.default, bool) else self.default}`"


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
        elif o.required:
            raise ValueError(f"policy {policy!r} needs {o.name} ({o.help})")
        else:
            checked[o.name] = o.default
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
        return self.build(model, **self.check_options(options))

    @property
    def bounded(self) -> bool:
        """Takes a `max_kv_size` budget."""
        return any(o.name == "max_kv_size" for o in self.options)


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
