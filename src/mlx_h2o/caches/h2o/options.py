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
        for part in PARTS:  # a part that forbids a combination says so in its check(config)
            check = getattr(getattr(self, part), "check", None)
            if check is not None:
                check(self)

    @classmethod
    def build(cls, max_kv_size=None, **options) -> "H2OConfig":
        """Check `options` against the table, then build each part from its own."""
        o = check_options("h2o", OPTIONS, {"max_kv_size": max_kv_size, **options} if max_kv_size is not None else options)
        # A part that resolves what its options leave open (Budget: heavy / recent from split) does it
        # in from_options.
        return cls(**{part: getattr(kind, "from_options", kind)(**{n: o[n] for n in option_names(kind)}) for part, kind in PARTS.items()})

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "H2OConfig":
        parts = {part: {f.name: d[part][f.name] for f in fields(kind)} for part, kind in PARTS.items()}
        parts["budget"]["pin"] = tuple(tuple(s) for s in parts["budget"]["pin"])
        return cls(**{part: PARTS[part](**values) for part, values in parts.items()})
