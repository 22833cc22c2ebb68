"""The kinds of values policy options take (options.py): each checks a Python value, normalising it,
parses the text form of one and describes itself for the docs' option tables."""

import math
import re
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


# A byte count in text: decimal units are powers of 1000 (as disks and network rates are sold),
# binary ones powers of 1024 (as memory is addressed); "64MB" = 64 x 10^6, "64MiB" = 64 x 2^20.
BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_BYTE_TEXT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


class ByteCount(int):
    """A number of bytes that remembers the unit it was written in ("MB"), so that a message about
    it can answer in the user's units (`in_unit`)."""

    unit = "B"

    def __new__(cls, value: int, unit: str = "B"):
        obj = super().__new__(cls, value)
        obj.unit = unit
        return obj

    def in_unit(self, n: int) -> str:
        """`n` bytes in this count's unit, rounded up (a smallest budget must still suffice): "5.63MB"."""
        if self.unit == "B":
            return f"{n} B"
        scale = BYTE_UNITS[self.unit]
        value = n / scale
        digits = 2 if value < 100 else 1 if value < 1000 else 0
        step = 10**-digits
        shown = math.ceil(value / step - 1e-9) * step  # up, ignoring float noise below a billionth of a step
        return f"{shown:.{digits}f}{self.unit}"


def parse_bytes(name: str, text: str) -> ByteCount:
    """"64MB", "1.5GiB", "512KB", "1000000" -> a ByteCount (whole bytes, rounded down: a budget is a ceiling)."""
    m = _BYTE_TEXT.match(text)
    units = {u.lower(): u for u in BYTE_UNITS}
    unit = units.get((m.group(2) or "B").lower()) if m else None
    if unit is None:
        raise ValueError(f"{name} must be a number of bytes, e.g. 67108864, '64MB' or '1.5GiB' "
                         f"(units {', '.join(BYTE_UNITS)}), got {text!r}")
    return ByteCount(int(float(m.group(1)) * BYTE_UNITS[unit]), unit)


@dataclass(frozen=True)
class Bytes:
    """A positive number of bytes: an integer, or text with a unit (BYTE_UNITS)."""

    def check(self, name, value):
        if isinstance(value, str):
            value = parse_bytes(name, value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a number of bytes >= 1 (an integer, or text such as '64MB' or '1.5GiB'), got {value!r}")
        return value if isinstance(value, ByteCount) else ByteCount(value)

    def parse(self, name, text: str):
        return parse_bytes(name, text.strip())

    def describe(self) -> str:
        return "bytes: integer or `64MB`, `1.5GiB` (MB = 10^6, MiB = 2^20)"
