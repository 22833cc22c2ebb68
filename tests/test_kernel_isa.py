"""The kernels' instruction-set variants (csrc/kernels/isa_variants.inc): the AVX512-VNNI variant
computes the same integer dot products as the AVX2 one with one instruction instead of three, so on
a CPU that has it the two must agree bit for bit, for the integer-dot matmul and for attention over
packed and dense K/V. Each variant is also checked against the float64 references elsewhere
(test_attention.py, test_quantized_matmul.py) in whichever variant the machine runs."""

import os
import subprocess
import sys

import numpy as np
import pytest

from mlx_h2o import _ext

VNNI = "avx2+fma+f16c+avx512vnni"

_OUTPUTS = """
import sys; sys.path[:0] = {path!r}
import numpy as np, mlx.core as mx, mlx_h2o
from attention_reference import make_inputs
from test_quantized_attention import qsdpa
rng = np.random.default_rng(7)
outs = []
# Products: 4-bit pairs with and without a trailing lone block (K / 32 odd), 8-bit, 1-9 rows.
for bits, gs, M, K, N in [(4, 32, 1, 576, 192), (4, 64, 3, 1536, 130), (4, 32, 2, 96, 40), (8, 64, 1, 576, 300),
                          (8, 32, 5, 160, 64), (4, 128, 9, 384, 33)]:
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32))
    outs.append(mlx_h2o.quantized_matmul(x, *mx.quantize(w, group_size=gs, bits=bits), group_size=gs, bits=bits))
# Attention over packed K/V (int8 queries against 4- and 8-bit keys) and over dense rows.
for bits, D, L, N in [(4, 64, 1, 700), (4, 96, 3, 129), (8, 64, 2, 300), (8, 128, 1, 64)]:
    q, k, v = make_inputs(rng, 1, 6, 2, L, N, D, mx.float32)
    kq = mx.quantize(k, group_size=32, bits=bits)
    vq = mx.quantize(v, group_size=32, bits=bits)
    outs += list(qsdpa(q, kq, vq, scale=D**-0.5, mask="causal" if L > 1 else None, bits=bits, group_size=32))
for dtype in (mx.float16, mx.float32):
    q, k, v = make_inputs(rng, 1, 9, 3, 1, 1000, 64, dtype)
    outs += list(mlx_h2o.scaled_dot_product_attention_with_scores(q, k, v, scale=0.125))
mx.eval(outs)
np.savez({out!r}, *[np.array(o.astype(mx.float32)) for o in outs])
print(mlx_h2o._ext.kernel_isa())
"""


def _outputs(tmp_path, name, env):
    out = str(tmp_path / f"{name}.npz")
    code = _OUTPUTS.format(path=[os.path.dirname(__file__)] + [p for p in sys.path if p], out=out)
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    with np.load(out) as f:
        return r.stdout.strip(), [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


@pytest.mark.skipif(_ext.kernel_isa() != VNNI, reason="this CPU has no AVX512-VNNI (the AVX2 variant runs)")
def test_vnni_variant_equals_avx2_bit_for_bit(tmp_path):
    isa_vnni, vnni = _outputs(tmp_path, "vnni", {})
    isa_avx2, avx2 = _outputs(tmp_path, "avx2", {"MLX_H2O_KERNEL_ISA": "avx2"})
    assert (isa_vnni, isa_avx2) == (VNNI, "avx2+fma+f16c")
    assert len(vnni) == len(avx2) == 6 + 4 * 2 + 2 * 2
    for i, (a, b) in enumerate(zip(vnni, avx2)):
        assert a.shape == b.shape and np.isfinite(a).all(), i
        np.testing.assert_array_equal(a, b, err_msg=f"output {i}")


def test_an_unknown_or_unsupported_variant_name_falls_back_to_the_best():
    code = "import mlx_h2o; print(mlx_h2o._ext.kernel_isa())"
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "MLX_H2O_KERNEL_ISA": "avx9000"},
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == _ext.kernel_isa(), r.stderr[-3000:]
