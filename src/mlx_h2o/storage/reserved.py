"""Reserved storage: a (B, H, capacity, D) array reserved once, written in place, with a live prefix.

The memory comes from MLX's allocator through the `uninitialized` op, which returns every page of
it to the OS (so RSS grows only as positions are written) and starts it on a page boundary. Writes
are MLX `slice_update`s: the buffer is donated, so MLX writes the new rows into the same memory
instead of copying the whole buffer (the buffer must stay owned by MLX's allocator for that: MLX
never donates an array that wraps foreign memory). `truncate` gives the pages past the live
prefix back to the OS where the platform allows (`release_pages`).

The class is the storage under `ReservedKVCache` and is meant to be reusable under other caches
(one buffer per stored tensor: keys, values, packed codes, scales). It is one tensor's buffer, not a
K/V storage (storage/kv.py): it writes at a position and truncates, and names its calls so.
"""

from math import gcd

import mlx.core as mx

from .._native import _ext
from ..options import check_int

MAX_POSITIONS = 2**31 - 1  # shapes are int32 in MLX: positions past this cannot be addressed


def check_capacity(value, name: str = "capacity") -> int:
    return check_int(name, value, 1, MAX_POSITIONS)


def _aligned_capacity(capacity: int, row_bytes: int) -> int:
    """`capacity` rounded up so each head's region (capacity * row_bytes) is a whole number of
    pages: every region then starts on a page boundary and commits only the pages it writes."""
    page = _ext.page_size()
    step = page // gcd(page, row_bytes)
    aligned = -(-capacity // step) * step
    # Padding is uncommitted address space, but keep it small relative to the reservation.
    return aligned if aligned - capacity <= max(capacity // 8, 1) and aligned <= MAX_POSITIONS else capacity


class ReservedBuffer:
    """Positions [0, length) along axis 2 of a (B, H, capacity, D) reservation.

    The reservation is made by the first `write`, which fixes B, H, D and the dtype (later writes
    are cast to it, as mlx-lm's KVCache does). Reading `view()` gives the live prefix without a
    copy.
    """

    def __init__(self, capacity: int):
        self.capacity = check_capacity(capacity)
        self.length = 0
        self._data = None  # the reservation, (B, H, capacity rounded up to whole pages, D)

    @property
    def reserved(self) -> bool:
        return self._data is not None

    @property
    def dtype(self):
        return None if self._data is None else self._data.dtype

    @property
    def live_nbytes(self) -> int:
        """Bytes of the live positions (what is stored, not what is reserved)."""
        if self._data is None:
            return 0
        B, H, _, D = self._data.shape
        return B * H * self.length * D * self._data.dtype.size

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of address space reserved (committed only where written)."""
        return 0 if self._data is None else self._data.nbytes

    def _reserve(self, like: mx.array):
        B, H, _, D = like.shape
        capacity = _aligned_capacity(self.capacity, D * like.dtype.size)
        # Allocated on the CPU stream (the op has no GPU kernel to run); with unified memory the
        # array is as usable from GPU ops as any other.
        self._data = _ext.uninitialized([B, H, capacity, D], like.dtype, stream=mx.cpu)
        # Evaluated now, so a failed allocation surfaces here rather than deep inside a later eval.
        mx.eval(self._data)

    def write(self, start: int, x: mx.array):
        """Write `x` (B, H, L, D) at positions [start, start + L); the live prefix becomes
        [0, start + L). `start` may be below `length` (overwrite, e.g. after compaction)."""
        if not isinstance(x, mx.array) or x.ndim != 4:
            raise ValueError(f"x must be an mx.array of shape (B, H, L, D), got {getattr(x, 'shape', type(x))}")
        check_int("start", start, 0, self.length)
        L = x.shape[2]
        if start + L > self.capacity:
            raise ValueError(
                f"writing {L} positions at {start} needs {start + L}, past the capacity of {self.capacity} "
                "positions reserved; reserve more (a larger capacity / max_context)"
            )
        if self._data is None:
            self._reserve(x)
        else:
            B, H, _, D = self._data.shape
            if (x.shape[0], x.shape[1], x.shape[3]) != (B, H, D):
                raise ValueError(f"x must have shape ({B}, {H}, L, {D}) like the reservation, got {tuple(x.shape)}")
        if L:
            # A slice_update: MLX donates the reservation and writes the L rows into it in place.
            self._data[..., start : start + L, :] = x
        self.length = start + L

    def view(self):
        """The live prefix (B, H, length, D), a view of the reservation (None before the first write)."""
        return None if self._data is None else self._data[..., : self.length, :]

    def truncate(self, length: int) -> int:
        """Keep positions [0, length) and give the pages past them back to the OS where it is safe
        and the platform allows. Returns the bytes given back."""
        check_int("length", length, 0, self.length)
        self.length = length
        if self._data is None:
            return 0
        # Releases nothing while a view handed out earlier can still be read (see release_pages).
        return _ext.release_pages(self._data, length, axis=2)
