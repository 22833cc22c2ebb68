"""A batch of sequences that keep their own caches, for mlx-lm's `BatchGenerator` (and so
`batch_generate` and `mlx_lm.server`).

`SequenceBatch.merge(caches)`: one layer's caches of several sequences, each still its own cache
with its own length and offset (an h2o cache: its own scores and evictions; the full cache's
`SharedRowsKVCache`: rows shared with the other copies of one snapshot). Nothing is padded: a model
call of B sequences hands each sequence its own rows and the fused op runs once per sequence (its
keys differ in number and position from the others'). mlx-lm's batch protocol:

- `offset` is the (B,) array of the sequences' token counts (RoPE positions, as BatchKVCache's);
- `prepare(lengths=, right_padding=)` / `finalize()`: a batched prompt is right-padded; each
  sequence takes only its first `lengths[b]` tokens of the padded call, and the padded rows get
  zero outputs (mlx-lm ignores them);
- `filter`, `extend`, `extract`, `merge`: the per-sequence caches are kept, dropped, joined or handed
  back as they are (`extract` copies).
"""

import copy
from typing import List, Optional

import mlx.core as mx

from .base import AttendingCache


class SequenceBatch(AttendingCache):
    """One layer of a batch of sequences in caches of their own (see the module docstring)."""

    def __init__(self, caches: List):
        self.caches = list(caches)
        self._lengths: Optional[List[int]] = None  # real tokens per sequence in the padded prompt
        self._fed = 0  # tokens of the padded prompt already fed
        self._rows: List[int] = []  # real rows per sequence in the current call
        self._value_dim = 0  # of the current call's values (the output rows of empty sequences)

    @classmethod
    def merge(cls, caches):
        """The sequences of `caches` (single-sequence caches, or batches of them) as one batch."""
        out = []
        for c in caches:
            out += c.caches if isinstance(c, cls) else [c]
        return cls(out)

    # ------------------------------------------------------------------ batch protocol
    @property
    def offset(self) -> mx.array:
        return mx.array([c.offset for c in self.caches])

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None and max(left_padding) > 0:
            raise ValueError("a batch of per-sequence caches takes right-padded prompts (lengths=, right_padding=), not left padding")
        if lengths is not None:
            self._lengths, self._fed = list(lengths), 0

    def finalize(self):
        self._lengths, self._fed = None, 0

    def filter(self, batch_indices):
        self.caches = [self.caches[i] for i in batch_indices]

    def extend(self, other):
        self.caches += other.caches

    def extract(self, idx):
        return copy.deepcopy(self.caches[idx])

    def size(self):
        return max((c.size() for c in self.caches), default=0)

    def empty(self):
        return all(c.empty() for c in self.caches)

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self.caches)

    def is_trimmable(self):
        return False

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None):
        # attend() masks each sequence causally over its own rows; this only tells the model that
        # a mask applies.
        return None if N == 1 else "causal"

    # ------------------------------------------------------------------ the layer's calls
    def rows_of_call(self, L: int) -> List[int]:
        """Each sequence's real rows in the next call of L rows (fewer, in a right-padded prompt)."""
        if self._lengths is None:
            return [L] * len(self.caches)
        return [max(0, min(n - self._fed, L)) for n in self._lengths]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[0] != len(self.caches):
            raise ValueError(f"keys have batch {keys.shape[0]} but the batch cache holds {len(self.caches)} sequences")
        L = keys.shape[2]
        self._value_dim = values.shape[-1]
        self._rows = self.rows_of_call(L)
        if self._lengths is not None:
            self._fed += L
        fetched = []
        for b, (c, n) in enumerate(zip(self.caches, self._rows)):
            fetched.append(c.update_and_fetch(keys[b : b + 1, :, :n], values[b : b + 1, :, :n]) if n else None)
        return fetched, None

    def attend(self, queries, keys, values, *, scale, mask=None, sinks=None):
        B, Hq, L, _ = queries.shape
        outs = []
        for b, (c, n, kv) in enumerate(zip(self.caches, self._rows, keys)):
            parts = []
            if n:
                parts.append(c.attend(queries[b : b + 1, :, :n], *kv, scale=scale, mask="causal" if n > 1 else None, sinks=sinks))
            if n < L:  # the padded rows of a right-padded prompt: outputs mlx-lm never reads
                parts.append(mx.zeros((1, Hq, L - n, self._value_dim), queries.dtype))
            outs.append(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
        return mx.concatenate(outs, axis=0)

    # ------------------------------------------------------------------ state
    # mlx-lm evaluates a batch's state after each prefill chunk; saving goes through the
    # sequences' own caches (BatchGenerator's extract), so a batch has no save format.
    @property
    def state(self):
        return [c.state for c in self.caches]

    @state.setter
    def state(self, value):
        raise ValueError("a batch of per-sequence caches is not loaded from a file; load its sequences' caches and merge them")
