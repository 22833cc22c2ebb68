"""`weights_on_huge_pages` / `_ext.collapse_into_huge_pages`: a model's weights moved onto 2 MiB pages
where the OS can, with their contents and addresses unchanged, and nothing done to memory the arrays
do not fill."""

import platform

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_h2o import _ext
from mlx_h2o.cpu_layers import weights_on_huge_pages
from mlx_h2o.evaluation.memory import array_address, memory_maps
from tiny_models import tiny_model

HUGE = 2 << 20


def thp_available() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not switched off."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return False
        major, minor = (int(v) for v in platform.release().split(".")[:2])
    except (OSError, ValueError):
        return False
    return (major, minor) >= (6, 1)


def huge_bytes_at(address: int, length: int) -> int:
    """Bytes of the mappings overlapping [address, address + length) on anonymous huge pages."""
    return sum(fields.get("AnonHugePages", 0) for lo, hi, _, fields in memory_maps() if lo < address + length and address < hi)


@pytest.mark.skipif(not thp_available(), reason="needs Linux 6.1+ with transparent huge pages")
def test_a_large_array_moves_onto_huge_pages_with_its_contents():
    a = mx.random.normal((3 * HUGE // 4,))  # 6 MiB: at least two whole aligned 2 MiB blocks
    mx.eval(a)
    before, where = np.array(a), array_address(a)
    moved = _ext.collapse_into_huge_pages([a])
    assert moved >= 2 * HUGE and moved % HUGE == 0
    assert huge_bytes_at(where, a.nbytes) >= 2 * HUGE
    assert array_address(a) == where
    np.testing.assert_array_equal(np.array(a), before)


def test_arrays_filling_less_than_half_a_block_are_left_alone():
    small = [mx.arange(1000 * i, 1000 * i + 1000) for i in range(4)]  # 4 KB each
    mx.eval(small)
    assert _ext.collapse_into_huge_pages(small) == 0
    assert _ext.collapse_into_huge_pages([]) == 0
    assert _ext.collapse_into_huge_pages([mx.array([], dtype=mx.float32)]) == 0


def test_unevaluated_arrays_are_evaluated_first():
    a = mx.ones((HUGE,)) * 3  # 8 MiB, lazy
    moved = _ext.collapse_into_huge_pages([a])
    assert moved >= 0 and moved % HUGE == 0
    assert float(a.sum()) == 3 * HUGE


def test_a_model_keeps_its_outputs():
    model = tiny_model("llama")
    x = mx.array([[1, 2, 3, 4]])
    before = np.array(model(x))
    params = [array_address(a) for _, a in tree_flatten(model.parameters())]
    assert weights_on_huge_pages(model) >= 0
    assert [array_address(a) for _, a in tree_flatten(model.parameters())] == params
    np.testing.assert_array_equal(np.array(model(x)), before)
    with pytest.raises(ValueError, match="nn.Module"):
        weights_on_huge_pages([mx.ones((4,))])
