"""K/V storage for caches: K and V rows side by side, in one format (`KVStore`), in two precision
tiers (`TieredKV`), or with the first rows in a format of their own (`SinkRowsKV`). Storage knows
nothing of eviction policies: a cache appends rows, asks for a compaction that keeps rows it chose,
and hands `segments()` to the fused kernel. `KVStorage` declares the protocol every storage
implements (the rotation wrapper, storage/rotation.py, and the per-entry columns,
storage/columns.py, included).

A format is `bits` (None = the model's dtype, or 2-8 packed) for K and V alike, or a (k_bits,
v_bits) pair: keys are the sensitive half, so K8/V4 spends its bits where they matter.
"""

from abc import ABC, abstractmethod
from typing import List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from .._ops import MAX_SEGMENTS
from .rows import RowStore, capacity_for, pad_indices, take_rows

# (q_rotation, out_rotation): float32 (D, D) matrices the attention op multiplies queries and output by
# (KVStorage.rotations).
Rotation = Optional[Tuple[mx.array, mx.array]]


class RowTransform(NamedTuple):
    """What a storage's write makes of new rows before storing them (KVStorage.append): keys
    (k - key_center) @ rk, values v @ rv, each step rounded to the rows' dtype as the stock ops
    would round it. The wrappers that rotate (RotatedKV) or centre keys (CenteredKeysKV,
    rotation.py) hand their part down, so that a packed store does all of it inside its write's
    one primitive (RowStore.put) instead of each wrapper adding primitives of its own."""

    rk: Optional[mx.array] = None  # float32 (Dk, Dk)
    rv: Optional[mx.array] = None  # float32 (Dv, Dv)
    key_center: Optional[mx.array] = None  # float32 (B, H, 1, Dk)


class KVStorage(ABC):
    """K/V rows of one cache layer, (B, H, rows, D) per tensor, in row order."""

    @property
    @abstractmethod
    def length(self) -> int:
        """Rows held."""

    @abstractmethod
    def append(self, keys: mx.array, values: mx.array, capacity: Optional[int] = None,
               transform: Optional[RowTransform] = None) -> None:
        """Write rows (B, H, L, D) after the held ones; `capacity` sizes the buffers when they grow
        (None: steps of GROW_STEP rows). With a `transform`, the rows to keep are what it makes of
        them (rotated, keys centred), in their dtype."""

    def append_in_place(self, keys: mx.array, values: mx.array):
        """`append` where it only writes: rows kept as they come, into room the buffers have. Returns
        what `fetch` then returns, or None, having done nothing, where `append` must run (growth,
        packing, a transform, shared rows). A decode step's append, without the general path's
        Python (docs/cpu-decode.md)."""
        return None

    @abstractmethod
    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        """Keep rows idx[..., :keep] (ascending) per (batch, head), in buffers of `capacity` rows; the
        last `protected_tail` of them are the newest rows (a tiered storage keeps them in its high tier)."""

    @abstractmethod
    def trim(self, n: int) -> None:
        """Forget the newest n rows."""

    @abstractmethod
    def segments(self) -> list:
        """[(k, v)] in row order, each an mx.array or a PackedKV: what the fused kernel reads."""

    def attended(self, fetched) -> Optional[list]:
        """The segments attention reads in place of `fetched`, when that is the (keys, values) pair
        `fetch` returned: its dense rows as their buffers (DenseRows), so that the two slices stay out
        of a decode step's graph. None for anything else (attention then reads `fetched`)."""
        return None

    @abstractmethod
    def read_rows(self) -> Tuple[mx.array, mx.array]:
        """Every row's (keys, values) as dense float32 arrays in row order, in the stored space (for
        policies that look at key / value content)."""

    @abstractmethod
    def write_rows(self, idx: mx.array, keys: mx.array, values: mx.array) -> None:
        """Overwrite rows idx (B, H, n) with dense keys / values (B, H, n, D) in the stored space
        (packed rows are re-quantized)."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of the rows held."""

    @abstractmethod
    def state(self):
        """The rows as a tree of arrays (None when empty) that `load` takes back."""

    @abstractmethod
    def load(self, state) -> None: ...

    def fetch(self):
        """What a cache's update_and_fetch returns: (keys, values) arrays for dense rows (models may
        use them directly), else (segments(), None), at most the fused op's MAX_SEGMENTS."""
        segments = self.segments()
        if len(segments) > MAX_SEGMENTS:
            self.own_rows()
            segments = self.segments()
        return segments, None

    def own_rows(self) -> None:
        """Copy rows shared with copies of this storage (KVStore) into buffers of its own: one
        segment per format again."""

    @property
    def shared_length(self) -> int:
        """Rows at the front read in place from a prefix shared with copies (KVStore); 0 where a
        storage keeps none."""
        return 0

    def gather_own(self, idx: mx.array, keep: int, capacity: int) -> None:
        """Keep rows idx[..., :keep] of those after the shared prefix (indices counted from its end),
        in buffers of `capacity` rows, leaving the prefix in place."""
        raise ValueError(f"{type(self).__name__} holds no shared prefix")

    def prepare_queries(self, queries: mx.array) -> mx.array:
        """Queries in the stored space (identity here; a rotation there)."""
        return queries

    def restore_output(self, out: mx.array, dtype) -> mx.array:
        """An attention output over the stored values, back in the model's space and dtype."""
        return out

    def key_center(self, stored: bool = False) -> Optional[mx.array]:
        """The mean key c (B, H, 1, Dk) the stored keys are less of (CenteredKeysKV, rotation.py), in
        the model's space or, `stored`, in the stored one; or None. Logits over the rows are q . k - q . c."""
        return None

    def rotations(self) -> Rotation:
        """(q_rotation, out_rotation) when the attention op can do what prepare_queries and
        restore_output do (`attention_with_scores`'s arguments: no primitives of their own), else
        None (identity here)."""
        return None


# Dtypes a cache may store dense rows in (`kv_dtype`) other than the model's: on the CPU the model
# computes in float32, and float16 rows halve a cache at no measurable perplexity cost (docs/cpu-decode.md).
KV_DTYPES = ("float16", "bfloat16", "float32")
# the option's text, for every policy
KV_DTYPE_HELP = "dtype the K/V rows are stored in (unset: float16 for a model computing in float32, else the model's)"


def dtype_name(dtype) -> str:
    """An mx dtype's name as the options spell it: mx.float16 -> "float16"."""
    return str(dtype).rpartition(".")[2]


def model_dtype(model):
    """The dtype `model`'s layers compute in: that of most of its floating parameters, not counting
    quantized layers' scales and biases (a GGUF's are float16 where its layers compute in float32).
    None for a model without such parameters."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))
    counts = {}
    for name, p in params.items():
        owner, _, leaf = name.rpartition(".")
        packed = leaf in ("scales", "biases") and getattr(params.get(f"{owner}.weight"), "dtype", None) == mx.uint32
        if mx.issubdtype(p.dtype, mx.floating) and not packed:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.size
    return max(counts, key=counts.get) if counts else None


def default_kv_dtype(model):
    """The `kv_dtype` of a policy's caches where the user left it unset: "float16" for a model that
    computes in float32 (on the CPU, the GGUF models), else None (the model's own dtype).

    Why: float16 rows halve the cache, as llama.cpp's default f16 cache does, and cost nothing
    measurable: perplexity +0.02 % on held-out set 1 (docs/cpu-decode.md, "Float16 K/V rows"). The
    fused kernel reads them as they are, so attention gets cheaper too. Models that already compute
    in 16 bits (mlx-lm's bfloat16 / float16 checkpoints) keep their rows as they come."""
    return "float16" if model_dtype(model) == mx.float32 else None


def stored_as(dtype, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
    """keys and values in `dtype` (an mx dtype or a name of KV_DTYPES; None: as they come)."""
    if dtype is None:
        return keys, values
    dtype = getattr(mx, dtype) if isinstance(dtype, str) else dtype
    return keys.astype(dtype) if keys.dtype != dtype else keys, values.astype(dtype) if values.dtype != dtype else values


def role_bits(bits) -> Tuple[Optional[int], Optional[int]]:
    """A format (module docstring) as (k_bits, v_bits)."""
    return tuple(bits) if isinstance(bits, (tuple, list)) else (bits, bits)


# A store forked many times (a chat's snapshots, turn after turn) would read ever more segments:
# past this many shared pieces, a fork joins them into one (a copy, once, that later forks share).
MAX_SHARED_PIECES = 2


# Rows a store appends after shared ones grow in smaller steps: a request forked from a snapshot adds
# a question and an answer, and GROW_STEP rows of spare room in each of N requests would cost more
# than the rows they share.
SHARED_TAIL_STEP = 64


def tail_capacity(needed: int, capacity: Optional[int], shared: int) -> int:
    """Own rows to allocate after `shared` rows: the caller's capacity for the whole store, less the
    shared rows, at most SHARED_TAIL_STEP steps, never less than `needed`."""
    step = -(-needed // SHARED_TAIL_STEP) * SHARED_TAIL_STEP
    return max(needed, step if capacity is None else min(capacity - shared, step))


def _along_rows(arrays: list) -> mx.array:
    """Arrays (B, H, rows, ...) joined in row order (the one array itself when alone)."""
    return arrays[0] if len(arrays) == 1 else mx.concatenate(arrays, axis=2)


class KVStore(KVStorage):
    """K and V rows in one format: dense (`bits=None`), packed at `bits`, or K and V at their own
    bits (`bits=(k_bits, v_bits)`).

    Copies share their rows, copy on write. `copy.deepcopy` turns the rows held into a read-only
    prefix that the original and the copy both read (MLX arrays are immutable: nothing is copied),
    and each appends after it in buffers of its own. The first call that rewrites rows (a
    compaction, `write_rows`) copies the prefix into the store's own buffer; a trim into the prefix
    keeps its head shared (`head`). So requests forked from one prompt-cache snapshot (mlx-lm's
    server deep-copies it for each) hold the snapshot's rows once until they evict."""

    def __init__(self, bits=None, group_size: int = 32):
        k_bits, v_bits = role_bits(bits)
        self.k, self.v = RowStore(k_bits, group_size), RowStore(v_bits, group_size)
        self.shared = []  # read-only pieces before its own rows (the property)
        self._length = 0  # own rows
        self._heads = {}  # head(n), as a shared piece

    @property
    def shared(self) -> List["KVStore"]:
        """The read-only pieces, in row order, before this store's own rows (assigned whole)."""
        return self._shared

    @shared.setter
    def shared(self, pieces: List["KVStore"]) -> None:
        # their rows counted once: `length` is read several times per layer and decode step
        self._shared, self._shared_rows = pieces, sum(piece._length for piece in pieces)

    @property
    def shared_length(self) -> int:
        return self._shared_rows

    @property
    def length(self) -> int:
        return self._shared_rows + self._length

    @property
    def capacity(self) -> int:
        return self.shared_length + self.k.capacity

    def append(self, keys: mx.array, values: mx.array, capacity: Optional[int] = None,
               transform: Optional[RowTransform] = None) -> None:
        start = self._length
        needed = start + keys.shape[2]
        if needed > self.k.capacity:
            own = capacity_for(needed, capacity) if not self.shared else tail_capacity(needed, capacity, self.shared_length)
            # (encode only builds the graph here, never evaluated: the buffers' shapes and dtypes)
            self.k.reserve(self.k.encode(keys), start, own)
            self.v.reserve(self.v.encode(values), start, own)
        if transform is None:
            self.k.put(start, keys)
            self.v.put(start, values)
        else:
            self.k.put(start, keys, transform.rk, transform.key_center)
            self.v.put(start, values, transform.rv)
        self._length = needed

    def append_in_place(self, keys: mx.array, values: mx.array):
        start = self._length
        needed = start + keys.shape[2]
        if self.shared or self.k.bits is not None or self.v.bits is not None or needed > self.k.capacity:
            return None
        self.k.write(start, (keys,))
        self.v.write(start, (values,))
        self._length = needed
        return self.fetch()

    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        self.own_rows()
        self.gather_own(idx, keep, capacity)

    def gather_own(self, idx: mx.array, keep: int, capacity: int) -> None:
        if self.k.arrays is not None:  # (no rows of its own after a shared prefix: nothing to keep)
            rows = take_rows(self.k.arrays + self.v.arrays, pad_indices(idx, capacity))  # K's and V's buffers in one primitive
            n = len(self.k.arrays)
            self.k.arrays, self.v.arrays = tuple(rows[:n]), tuple(rows[n:])
        self._length = keep

    def drop_front(self, n: int) -> None:
        """Forget the oldest n rows (the rest keeps no spare room)."""
        self.own_rows()
        self.k.drop_front(n, self.length)
        self.v.drop_front(n, self.length)
        self._length -= n

    def decode(self, start: int, stop: int):
        """Rows [start, stop) of K and V as dense values in the stored dtype."""
        self.own_rows()
        return self.k.decode(start, stop, self.k.dtype), self.v.decode(start, stop, self.v.dtype)

    def read_rows(self):
        pieces = self._pieces() or [self]
        return tuple(_along_rows([getattr(p, role).decode(0, p._length, mx.float32) for p in pieces]) for role in "kv")

    def write_rows(self, idx: mx.array, keys: mx.array, values: mx.array) -> None:
        self.own_rows()
        self.k.write_at(idx, keys)
        self.v.write_at(idx, values)

    def trim(self, n: int) -> None:
        if n <= self._length:
            self._length -= n
            return
        # Into the shared prefix: keep the head of its pieces, still shared (no copy). mlx-lm's
        # prompt cache trims a copy of a longer conversation back to the common prefix; copies
        # trimmed alike get the same head piece, so a batch still holds it once.
        keep, self._length, self.k.arrays, self.v.arrays = self.length - n, 0, None, None
        pieces = []
        for piece in self.shared:
            if keep <= 0:
                break
            pieces.append(piece if piece._length <= keep else piece.head(keep))
            keep -= piece._length
        self.shared = pieces

    def head(self, n: int) -> "KVStore":
        """A read-only store of this one's first n own rows (views), one per n: what copies trimmed
        into this shared piece read."""
        if n not in self._heads:
            self._heads[n] = self._piece(self.k.state(n), self.v.state(n), n)
        return self._heads[n]

    def segments(self) -> list:
        own = [(self.k.view(self._length), self.v.view(self._length))] if self._length else []
        return [seg for piece in self.shared for seg in piece.segments()] + own

    def fetch(self):
        if self.k.bits is None and self.v.bits is None and not self.shared:
            return self.k.view(self.length), self.v.view(self.length)
        return super().fetch()

    def attended(self, fetched) -> Optional[list]:
        n = self._length
        if self.shared or not n or self.k.bits is not None or self.v.bits is not None:
            return None
        if fetched[0] is not self.k.view(n) or fetched[1] is not self.v.view(n):
            return None
        return [(self.k.in_place(n), self.v.in_place(n))]

    def joined(self) -> Tuple[mx.array, mx.array]:
        """Every row of a dense store as (keys, values) arrays, shared and own joined (a new array
        when there are several pieces), leaving the store as it is."""
        if self.k.bits is not None or self.v.bits is not None:
            raise ValueError("joined() reads dense rows; packed rows are read as segments()")
        return self._joined("k")[0], self._joined("v")[0]

    def nbytes(self) -> int:
        return sum(piece.nbytes() for piece in self.shared) + self.k.nbytes(self._length) + self.v.nbytes(self._length)

    def state(self):
        return {"k": self._joined("k"), "v": self._joined("v")} if self.length else None

    def load(self, state) -> None:
        self.shared = []
        if state is None:
            self._length = 0
            self.k.arrays = self.v.arrays = None
            return
        self.k.load(state["k"])
        self.v.load(state["v"])
        self._length = self.k.capacity

    # -- sharing --------------------------------------------------------------------------------
    @classmethod
    def reading(cls, keys: Optional[mx.array], values: Optional[mx.array], after: Sequence["KVStore"] = ()) -> "KVStore":
        """A dense store whose rows are those of the read-only pieces `after` (another store's
        `shared`), then `keys`, `values` (B, H, n, D; None: none), all read in place as a shared
        prefix (never written: new rows go to buffers of its own)."""
        store = cls()
        store.shared = list(after) + ([store._piece((keys,), (values,), keys.shape[2])] if keys is not None else [])
        return store

    def own(self) -> Optional[Tuple[mx.array, mx.array]]:
        """The rows after the shared prefix as (keys, values) views of a dense store, or None."""
        return (self.k.view(self._length), self.v.view(self._length)) if self._length else None

    def __deepcopy__(self, memo):
        self.share_rows()
        twin = self._piece()
        twin.shared = list(self.shared)
        memo[id(self)] = twin
        return twin

    def share_rows(self) -> None:
        """Make the rows held a read-only prefix (what copies share); new rows go to new buffers.
        The prefix holds exactly its rows: a request's question in a buffer with room for its answer
        would keep that room, in every copy, for as long as the copies live."""
        if self._length:
            self.shared = self.shared + [self._piece(self.k.exact(self._length), self.v.exact(self._length), self._length)]
            self.k.arrays = self.v.arrays = None
            self._length = 0
        if len(self.shared) > MAX_SHARED_PIECES:
            self.shared = [self._piece(self._joined("k"), self._joined("v"), self.shared_length)]

    def _piece(self, k=None, v=None, n: int = 0) -> "KVStore":
        """A store of this one's formats holding rows k, v (RowStore arrays) of length n, or empty."""
        piece = KVStore((self.k.bits, self.v.bits), self.k.group_size)
        if n:
            piece.k.arrays, piece.v.arrays, piece._length = tuple(k), tuple(v), n
        return piece

    def own_rows(self) -> None:
        """Copy the shared prefix into this store's own buffers (before rows are rewritten)."""
        if self.shared:
            k, v, n = self._joined("k"), self._joined("v"), self.length
            self.k.load(k)
            self.v.load(v)
            self.shared, self._length = [], n

    def _pieces(self) -> list:
        """The stores holding rows, in row order: the shared pieces, then this one if it has rows."""
        return self.shared + ([self] if self._length else [])

    def _joined(self, role: str) -> list:
        """The arrays of K or V (`role`) over every row held, shared and own, in row order."""
        parts = [getattr(piece, role).state(piece._length) for piece in self._pieces()]
        return [_along_rows(list(a)) for a in zip(*parts)]


class TwoPartKV(KVStorage):
    """Rows in two storages, the first's before the second's in row order (their attribute names:
    PARTS, which their saved state keeps too). A compaction or a new row is the subclass's to place;
    reading, trimming (the newest rows first), counting and saving are the same for any split."""

    PARTS = ("first", "second")
    WHAT = "a two-part storage"  # (in errors)

    def _parts(self) -> Tuple[KVStorage, KVStorage]:
        return getattr(self, self.PARTS[0]), getattr(self, self.PARTS[1])

    @property
    def length(self) -> int:
        first, second = self._parts()
        return first.length + second.length

    def read_rows(self):
        first, second = self._parts()
        if not first.length or not second.length:  # (e.g. nothing has left a tiered storage's window yet)
            return (second if not first.length else first).read_rows()
        (k1, v1), (k2, v2) = first.read_rows(), second.read_rows()
        return mx.concatenate([k1, k2], axis=2), mx.concatenate([v1, v2], axis=2)

    def write_rows(self, idx, keys, values) -> None:
        raise ValueError(f"rows of {self.WHAT} cannot be rewritten in place; use one format")

    def trim(self, n: int) -> None:
        first, second = self._parts()
        from_second = min(n, second.length)
        second.trim(from_second)
        first.trim(n - from_second)

    def segments(self) -> list:
        first, second = self._parts()
        return first.segments() + second.segments()

    def own_rows(self) -> None:
        for part in self._parts():
            part.own_rows()

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self._parts())

    def state(self):
        return {name: part.state() for name, part in zip(self.PARTS, self._parts())}

    def load(self, state) -> None:
        for name, part in zip(self.PARTS, self._parts()):
            part.load(state[name])


class TieredKV(TwoPartKV):
    """Mixed precision: the low tier's rows followed by the high tier's, in row order. New rows enter
    the high tier; a row is converted to the low tier's format once, when it leaves the newest
    `window` rows. A compaction keeps the high tier whole (the protected newest rows) and gathers in
    the low tier."""

    PARTS, WHAT = ("low", "high"), "a two-tier storage"

    def __init__(self, low_bits, high_bits, window: int, group_size: int = 32):
        self.low, self.high = KVStore(low_bits, group_size), KVStore(high_bits, group_size)
        self.window = window

    def append(self, keys, values, capacity: Optional[int] = None, transform: Optional[RowTransform] = None) -> None:
        # Exact room: demote() cuts the high tier back to its newest rows, so spare capacity there
        # would be allocated and dropped on every call. (Demoted rows are stored rows: not rotated again.)
        self.high.append(keys, values, self.high.length + keys.shape[2], transform)
        self.demote(self.window, capacity)

    def demote(self, keep_high: int, capacity: Optional[int]) -> None:
        """Convert all but the newest `keep_high` high-tier rows to the low tier's format."""
        n = self.high.length - keep_high
        if n <= 0:
            return
        k, v = self.high.decode(0, n)
        self.low.append(k, v, None if capacity is None else max(capacity, self.low.length + n))
        self.high.drop_front(n)

    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        self.demote(protected_tail, capacity)
        low_keep = keep - self.high.length
        self.low.gather(idx[..., :low_keep], low_keep, capacity=capacity)


class SinkRowsKV(TwoPartKV):
    """The first `count` rows in their own format (`bits`), the rest in `rest`: an h2o cache's
    attention sinks, which take a large share of every query's attention and which it never evicts,
    so their keys' rounding error weighs more than any other row's. A compaction keeps them whole
    (the cache protects them: idx starts with them) and gathers the rest."""

    PARTS, WHAT = ("sinks", "rest"), "a storage with sink rows"

    def __init__(self, rest: KVStorage, count: int, bits, group_size: int = 32):
        self.sinks, self.rest, self.count = KVStore(bits, group_size), rest, count

    def append(self, keys, values, capacity: Optional[int] = None, transform: Optional[RowTransform] = None) -> None:
        n = min(self.count - self.sinks.length, keys.shape[2])
        if n > 0:
            self.sinks.append(keys[:, :, :n], values[:, :, :n], self.count, transform)
        if keys.shape[2] > n:
            rest = None if capacity is None else max(capacity - self.count, 1)
            self.rest.append(keys[:, :, n:] if n > 0 else keys, values[:, :, n:] if n > 0 else values, rest, transform)

    def gather(self, idx: mx.array, keep: int, protected_tail: int = 0, capacity: int = 0) -> None:
        n = self.sinks.length  # idx[..., :n] are the sink rows (protected, ascending)
        self.rest.gather(idx[..., n:] - n, keep - n, protected_tail, max(capacity - n, 0))


def make_kv_storage(low_bits, high_bits, window: int, group_size: int = 32) -> KVStorage:
    """One format when both tiers agree, else older rows at `low_bits` and the newest `window` rows at
    `high_bits` (formats as in the module docstring; None: the model's dtype)."""
    if role_bits(low_bits) == role_bits(high_bits):
        return KVStore(low_bits, group_size)
    return TieredKV(low_bits, high_bits, window, group_size)
