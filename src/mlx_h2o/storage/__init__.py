"""Storage for KV caches, below every cache policy and knowing none of them.

- `rows`: K or V rows in (B, H, capacity, ...) buffers, dense or MLX-packed; gathers that compact them.
- `kv`: K and V side by side in one format (`KVStore`) or two precision tiers (`TieredKV`); the
  interface every storage offers.
- `wrapper`: `KVWrapper`, a storage over another that changes some calls and forwards the rest.
- `columns`: `ColumnedKV`, rows plus per-entry columns (score, position...) kept in step with them.
- `rotation`: rotate-then-quantize (`KVRotation`) and `RotatedKV`, which wraps any storage with it.
- `reserved`: `ReservedBuffer`, address space reserved once whose pages the OS commits as rows are
  written.
"""

from .columns import ColumnedKV
from .kv import (KV_DTYPE_HELP, KV_DTYPES, KVStorage, KVStore, SinkRowsKV, TieredKV, default_kv_dtype, dtype_name, make_kv_storage,
                 model_dtype, role_bits, stored_as)
from .reserved import ReservedBuffer, check_capacity
from .rotation import DEFAULT_LAMBDA, LAMBDA_MODES, CenteredKeysKV, KVRotation, RotatedKV
from .rows import GROW_STEP, RowStore, check_group_size, flat_rows, grown_capacity, pad_indices, take_rows
from .wrapper import KVWrapper

__all__ = [
    "ColumnedKV",
    "DEFAULT_LAMBDA",
    "KV_DTYPE_HELP",
    "KV_DTYPES",
    "default_kv_dtype",
    "dtype_name",
    "model_dtype",
    "GROW_STEP",
    "KVRotation",
    "KVStorage",
    "KVStore",
    "KVWrapper",
    "LAMBDA_MODES",
    "ReservedBuffer",
    "CenteredKeysKV",
    "RotatedKV",
    "RowStore",
    "SinkRowsKV",
    "TieredKV",
    "check_capacity",
    "check_group_size",
    "flat_rows",
    "take_rows",
    "grown_capacity",
    "make_kv_storage",
    "pad_indices",
    "role_bits",
    "stored_as",
]
