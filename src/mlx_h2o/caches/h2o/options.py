"""The configuration of an h2o cache: four parts, each a frozen dataclass whose fields are its options
(budget.py, scorer.py, keeper.py, storage.py). `OPTIONS`, the table `make_cache` validates against,
the command lines and mlx-lm's `--kv-option` parse with and the docs' option tables are generated
from, is made from their fields. A part that cannot combine with another says so in its `check`."""

from dataclasses import asdict, dataclass, fields

from ...options import check_options, option_names, options_of
from .budget import Budget
from .keeper import Keeper
from .scorer import Scorer
from .storage import Storage

PARTS = {"budget": Budget, "scorer": Scorer, "keeper": Keeper, "storage": Storage}
OPTIONS = options_of(*PARTS.values())


@dataclass(frozen=True)
class H2OConfig:
    """The validated options of one h2o cache, by part."""

    budget: Budget
    scorer: Scorer
    keeper: Keeper
    storage: Storage

    def __post_init__(self):
        if not self.budget.resolved:  # a byte budget: checked once resolved (bytes.py)
            return
        for part in PARTS:  # a part that forbids a combination says so in its check(config)
            check = getattr(getattr(self, part), "check", None)
            if check is not None:
                check(self)

    @classmethod
    def build(cls, max_kv_size=None, **options) -> "H2OConfig":
        """Check `options` against the table, then build each part from its own."""
        if max_kv_size is not None and options.get("max_kv_bytes") is not None:
            raise ValueError("give max_kv_size (entries per kv head) or max_kv_bytes (bytes per sequence), not both")
        return cls.from_checked(check_options("h2o", OPTIONS, {"max_kv_size": max_kv_size, **options} if max_kv_size is not None else options))

    @classmethod
    def from_checked(cls, o: dict) -> "H2OConfig":
        """Each part from its own checked options (`o`: every option of the table)."""
        # A part that resolves what its options leave open (Budget: heavy / recent from split) does it
        # in from_options.
        return cls(**{part: getattr(kind, "from_options", kind)(**{n: o[n] for n in option_names(kind)}) for part, kind in PARTS.items()})

    def options(self) -> dict:
        """Every option as the parts hold it (what from_checked takes back)."""
        return {n: getattr(getattr(self, part), n) for part, kind in PARTS.items() for n in option_names(kind)}

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "H2OConfig":
        # (a field newer than the file, e.g. max_kv_bytes, takes its default)
        parts = {part: {f.name: d[part].get(f.name, f.default) for f in fields(kind)} for part, kind in PARTS.items()}
        parts["budget"]["pin"] = tuple(tuple(s) for s in parts["budget"]["pin"])
        return cls(**{part: PARTS[part](**values) for part, values in parts.items()})
