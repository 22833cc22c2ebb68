"""The storage of an h2o cache: the format its K/V rows are kept in (mlx_h2o.storage does the work)."""

from dataclasses import dataclass
from typing import Optional, Tuple

from ...options import Choice, Flag, Int, option
from ...storage import DEFAULT_LAMBDA, KV_DTYPE_HELP, KV_DTYPES, LAMBDA_MODES, CenteredKeysKV, KVStorage, RotatedKV, SinkRowsKV, TieredKV, check_group_size, make_kv_storage, role_bits

# Bits of the older rows (sink + heavy hitters) / of the recent window; "fp" = the model's dtype;
# "k8v4" = 8-bit keys with 4-bit values (keys are the sensitive half), "k4v8" the reverse.
# "mixed" = 4/8: the newest rows take most of the attention, and a row is converted once, downwards,
# when it leaves the window.
KV_BITS = ("8", "4", "8/4", "4/8", "8/fp", "4/fp", "k8v4", "k4v8", "k8v4/8", "k8v4/fp")
KV_BITS_ALIASES = (("mixed", "4/8"), (8, "8"), (4, "4"))
KV_GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32  # kv_group_size unset, outside a byte budget


def tier_bits(tier: str):
    """"fp" -> None, "8" -> 8, "k8v4" -> (8, 4): a storage format (storage/kv.py)."""
    if tier == "fp":
        return None
    if tier.startswith("k"):
        k, _, v = tier[1:].partition("v")
        return int(k), int(v)
    return int(tier)


def row_bytes(bits, head_dim_k: int, head_dim_v: int, group_size: int, itemsize: int) -> int:
    """Bytes of one (kv head, token) entry: K and V rows in format `bits` (storage/kv.py)."""

    def one(b, d):
        if b is None:
            return d * itemsize
        return d * b // 8 + (d // group_size) * 2 * itemsize  # packed words + scale and bias per group

    k_bits, v_bits = role_bits(bits)
    return one(k_bits, head_dim_k) + one(v_bits, head_dim_v)


class WindowTieredKV(TieredKV):
    """Two tiers whose low tier reserves `capacity` less the recent window: the newest `window` rows
    live in the high tier, so an h2o cache of M entries needs only M - window low rows (the rows
    stay where TieredKV puts them; only the reservation is smaller, a byte budget counts it).

    The high tier also holds up to `slack` rows beyond the window (the byte bound's "window plus one
    step", bytes.py): calls of at most `slack` rows demote the rows past the window once the tier
    is full, a batch every `slack` tokens. Demoting one row a token regrew the exact-size high tier,
    a copy of it and ~12 primitives per layer at every decode step (docs/h2o.md, "Equal bytes on a long context")."""

    def __init__(self, low_bits, high_bits, window: int, group_size: int = 32, slack: int = 0):
        super().__init__(low_bits, high_bits, window, group_size)
        self.slack = slack

    def append(self, keys, values, capacity=None, transform=None) -> None:
        L = keys.shape[2]
        if L > self.slack:  # a prefill chunk: appended whole, then cut back to the window
            return super().append(keys, values, capacity, transform)
        room = self.window + self.slack
        if self.high.length + L > room:
            self.demote(self.window, capacity)
        self.high.append(keys, values, room, transform)

    def demote(self, keep_high, capacity):
        super().demote(keep_high, None if capacity is None else max(capacity - self.window, 1))

    def gather(self, idx, keep, protected_tail=0, capacity=0):
        # (a recent window longer than the tier's: its older rows are demoted, kept in the low tier)
        self.demote(min(protected_tail, self.window), capacity)
        low_keep = keep - self.high.length
        self.low.gather(idx[..., :low_keep], low_keep, capacity=max(capacity - self.window, 0))


@dataclass(frozen=True)
class Storage:
    """The format of the K/V rows an h2o cache keeps.

    Parameters
    ----------
    kv_bits:
        packed bits of the rows, or OLDER/RECENT tiers (the recent window at its own bits).
    kv_recent_rows:
        with OLDER/RECENT kv_bits, how many of the newest rows are kept in the RECENT format (unset:
        the whole recent window); the rest of the recent window is stored as the older rows are.
    kv_sink_rows:
        with OLDER/RECENT kv_bits, how many of the first rows (the attention sinks, at most the
        budget's `sink`) are kept in the RECENT format (unset: none).
    kv_group_size:
        values sharing one scale and bias when packed (unset: 32, or a byte budget's rule, bytes.py).
    center_keys:
        with OLDER/RECENT kv_bits, store keys less their mean key, fixed when the first rows leave
        the recent window (storage/rotation.py's CenteredKeysKV): the older rows' packed keys no
        longer spend their range on it.
    rotate, rotate_lam:
        rotate K/V before packing, with an optional per-coordinate scale (storage/rotation.py).
    kv_dtype:
        the dtype rows are kept in before any packing (unset: float16 for a model computing in
        float32, else the model's or under a byte budget the rule's); packed rows' scales and biases
        take it too, and a byte budget counts its size.
    """

    kv_bits: Optional[str] = option(
        Choice(KV_BITS, KV_BITS_ALIASES), None,
        "store K/V packed: 8, 4, `k8v4` (8-bit keys, 4-bit values), or OLDER/RECENT formats (`fp` = model dtype; `mixed` = 4/8); unset: model dtype")
    kv_recent_rows: Optional[int] = option(
        Int(1), None, "with OLDER/RECENT kv_bits: the newest rows kept in the RECENT format (unset: the whole recent window)")
    kv_sink_rows: Optional[int] = option(
        Int(1), None, "with OLDER/RECENT kv_bits: the first rows (attention sinks, at most `sink`) kept in the RECENT format (unset: none)")
    kv_group_size: Optional[int] = option(
        Choice(KV_GROUP_SIZES), None, "values sharing one scale and bias when packed (unset: 32, or the byte budget's rule)")
    center_keys: bool = option(
        Flag(), False, "with OLDER/RECENT kv_bits: store keys less their mean over the first rows (softmax ignores the shift)")
    rotate: bool = option(Flag(), False, "rotate K/V (sign x Hadamard/DFT) before packing: better low-bit quality")
    rotate_lam: str = option(Choice(LAMBDA_MODES, ((None, "none"),)), DEFAULT_LAMBDA, "per-coordinate scale of the rotation")
    kv_dtype: Optional[str] = option(
        Choice(KV_DTYPES), None, KV_DTYPE_HELP[:-1] + "; packed under a byte budget: the rule's)")

    @property
    def group_size(self) -> int:
        """kv_group_size, or its default."""
        return self.kv_group_size or DEFAULT_GROUP_SIZE

    @property
    def single_format(self) -> bool:
        """One format for every row (no older/recent tiers)."""
        return self.kv_bits is None or "/" not in self.kv_bits

    def check(self, config) -> None:
        for name in ("kv_recent_rows", "kv_sink_rows", "center_keys"):
            if getattr(self, name) not in (None, False) and self.single_format:
                raise ValueError(f"{name} needs two formats in kv_bits (OLDER/RECENT, e.g. 4/8), got kv_bits={self.kv_bits!r}")
        if self.center_keys and config.keeper.evicted_bits is not None:
            # (the archive's rows would be read with the centre added back, beside rows without it)
            raise ValueError("center_keys does not combine with an archive of evicted entries (evicted_bits)")

    def high_rows(self, recent: int) -> int:
        """The newest rows the RECENT format holds for a budget whose recent window is `recent`: the
        window, or fewer (kv_recent_rows). Never more: rows past the window can be evicted, and the
        RECENT tier keeps its rows in order."""
        return recent if self.kv_recent_rows is None else min(recent, self.kv_recent_rows)

    def tiers(self) -> Tuple[Optional[int], Optional[int]]:
        """(format of the older rows, format of the recent window); None = the model's dtype."""
        if self.kv_bits is None:
            return None, None
        older, _, recent = self.kv_bits.partition("/")
        return tier_bits(older), tier_bits(recent or older)

    def sink_rows(self, sink: int) -> int:
        """The first rows the RECENT format holds for a budget that keeps `sink` sink entries."""
        return 0 if self.single_format else min(self.kv_sink_rows or 0, sink)

    def make(self, window: int, seed: int, slack: int = 0, sinks: int = 0) -> KVStorage:
        """Rows as configured: one format or older/recent tiers (the newest `window` rows recent, and
        up to `slack` more before they demote; the first `sinks` rows recent too), keys centred once
        the first rows leave the high tier, rotated (seeded) or not."""
        older, recent = self.tiers()
        store = make_kv_storage(older, recent, window, self.group_size)
        if isinstance(store, TieredKV):
            store = WindowTieredKV(older, recent, window, self.group_size, slack)
            if sinks:
                store = SinkRowsKV(store, sinks, recent, self.group_size)
            if self.center_keys:  # c once rows first leave the high tier: what it holds is still fine
                store = CenteredKeysKV(store, window + slack, sinks)
        return RotatedKV(store, seed, self.rotate_lam) if self.rotate else store

    def check_rows(self, keys, values, packed: bool = False) -> None:
        """Packed rows (kv_bits, or `packed`: an archive) need a group size that divides the head dimension."""
        if self.kv_bits is not None or packed:
            for x in (keys, values):
                check_group_size("kv_group_size", self.group_size, x.shape[-1])
