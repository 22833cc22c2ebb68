# The suite opts in to OpenBLAS matmuls (mlx_h2o._blas) before anything imports mlx.core: the
# model tests prefill through MLX's GEMM, several times slower on the mlx-cpu wheel's reference BLAS.
from mlx_h2o._blas import use_openblas  # isort: skip

use_openblas()

import mlx_h2o  # noqa: E402
import mlx_h2o.storage  # noqa: E402

import os

import pytest


_PRODUCT_KV_DTYPE = mlx_h2o.storage.default_kv_dtype


@pytest.fixture(scope="session", autouse=True)
def _kv_rows_as_they_come():
    """Unset `kv_dtype` keeps rows in the model's dtype, in every test not marked `default_kv_dtype`
    (and in the module and session fixtures, which set up before any test's own).

    The policies' tests compare their logits and attention with float32 references: exactly with
    mlx-lm's own KVCache while nothing is evicted, with float64 within the kernel's error. The
    product's default, float16 rows for a float32 model (`storage.default_kv_dtype`), would round
    every row first; test_kv_dtype.py tests those rows, against references holding the same rounded
    values, and the marked tests the default itself."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlx_h2o.storage, "default_kv_dtype", lambda model: None)
        yield


@pytest.fixture(autouse=True)
def _default_kv_dtype_where_marked(request, monkeypatch):
    if request.node.get_closest_marker("default_kv_dtype") is not None:
        monkeypatch.setattr(mlx_h2o.storage, "default_kv_dtype", _PRODUCT_KV_DTYPE)


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 model with dequantized fp32 weights (the reference the tests compare
    against; the CPU default is packed weights) and tokenizer. In CI its absence is a failure."""
    try:
        from mlx_h2o.loading import default_model_path

        default_model_path()
    except FileNotFoundError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))
    return mlx_h2o.load(weights="float32")


@pytest.fixture(scope="session")
def licence_tokens(smollm):
    _, tokenizer = smollm
    with open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8") as f:
        return tokenizer.encode(f.read())
