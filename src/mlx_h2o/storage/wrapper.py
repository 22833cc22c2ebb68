"""`KVWrapper`: the base of storages that wrap another (rotation.py, columns.py)."""

from .kv import KVStorage


class KVWrapper(KVStorage):
    """A storage over another one (`inner`): it changes some calls and forwards the rest."""

    def __init__(self, inner: KVStorage):
        self.inner = inner

    @property
    def length(self) -> int:
        return self.inner.length

    def append(self, keys, values, capacity=None, transform=None) -> None:
        self.inner.append(keys, values, capacity, transform)

    def gather(self, idx, keep, protected_tail=0, capacity=0) -> None:
        self.inner.gather(idx, keep, protected_tail, capacity)

    def gather_own(self, idx, keep, capacity) -> None:
        self.inner.gather_own(idx, keep, capacity)

    @property
    def shared_length(self) -> int:
        return self.inner.shared_length

    def trim(self, n: int) -> None:
        self.inner.trim(n)

    def segments(self) -> list:
        return self.inner.segments()

    def attended(self, fetched):
        return self.inner.attended(fetched)

    def fetch(self):
        return self.inner.fetch()

    def own_rows(self) -> None:
        self.inner.own_rows()

    def read_rows(self):
        return self.inner.read_rows()

    def write_rows(self, idx, keys, values) -> None:
        self.inner.write_rows(idx, keys, values)

    def prepare_queries(self, queries):
        return self.inner.prepare_queries(queries)

    def restore_output(self, out, dtype):
        return self.inner.restore_output(out, dtype)

    def rotations(self):
        return self.inner.rotations()

    def key_center(self, stored=False):
        return self.inner.key_center(stored)

    def nbytes(self) -> int:
        return self.inner.nbytes()

    def state(self):
        return self.inner.state()

    def load(self, state) -> None:
        self.inner.load(state)
