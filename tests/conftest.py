# The suite opts in to OpenBLAS matmuls (mlx_h2o._blas) before anything imports mlx.core: the
# model tests prefill through MLX's GEMM, several times slower on the mlx-cpu wheel's reference BLAS.
from mlx_h2o._blas import use_openblas  # isort: skip

use_openblas()

import mlx_h2o  # noqa: E402

import os

import pytest


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
