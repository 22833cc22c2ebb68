"""The kinds of values policy options take (options.py): each checks a Python value, normalising it,
parses the text form of one and describes itself for the docs' option tables."""

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

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


def _parse_as(convert, name: str, text: str, expected: str):
    """`convert(text)`, or a ValueError saying what `name` must be."""
    try:
        return convert(text)
    except ValueError:
        raise ValueError(f"{name} must be {expected}, got {text!r}") from None


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
        return _parse_as(int, name, text, f"an integer {_int_range(self.low, self.high)}")

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
        return _parse_as(float, name, text, f"a number in [{self.low}, {self.high})")

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
