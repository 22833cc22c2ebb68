"""mlx_h2o.gguf: GGUF files read one tensor at a time, into exactly the arrays `mx.load` makes of them.

References: MLX's own GGUF loader (`mx.load`) bit for bit on written files of random tensors of every
type the reader converts, and a float64 NumPy dequantization of GGML's block formats; the embedded
model read both ways; bad files get a ValueError naming what is wrong.
"""

import struct

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import gguf

# GGML block formats: type -> (bytes per block of 32, float64 dequantization of (n, bytes) blocks).


def _f16(raw, at):
    return raw[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float64)


def _nibbles(qs):
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float64)  # weights 0-15 low, 16-31 high


DEQUANTIZE = {
    gguf.Q4_0: (18, lambda raw: _f16(raw, 0)[:, None] * (_nibbles(raw[:, 2:]) - 8)),
    gguf.Q4_1: (20, lambda raw: _f16(raw, 0)[:, None] * _nibbles(raw[:, 4:]) + _f16(raw, 2)[:, None]),
    gguf.Q8_0: (34, lambda raw: _f16(raw, 0)[:, None] * raw[:, 2:].view(np.int8).astype(np.float64)),
}


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def write_gguf(path, tensors, metadata=(), alignment=32):
    """A GGUF v3 file of `tensors` [(name, ggml type, MLX-order shape, raw bytes)] and `metadata`
    [(key, value type, packed value bytes)]."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, kind, value in metadata:
        head += _string(key) + struct.pack("<I", kind) + value
    offsets, offset = [], 0
    for _, _, _, raw in tensors:
        offsets.append(offset)
        offset += -(-len(raw) // alignment) * alignment
    for (name, kind, shape, _), at in zip(tensors, offsets):
        head += _string(name) + struct.pack("<I", len(shape)) + b"".join(struct.pack("<Q", d) for d in reversed(shape))
        head += struct.pack("<IQ", kind, at)
    head += b"\0" * (-len(head) % alignment)
    body = b"".join(raw + b"\0" * (-len(raw) % alignment) for _, _, _, raw in tensors)
    path.write_bytes(head + body)


def random_blocks(rng, kind, rows, cols):
    """Raw blocks of a (rows, cols) tensor with finite float16 scales (biases)."""
    size, _ = DEQUANTIZE[kind]
    raw = rng.integers(0, 256, size=(rows * cols // 32, size), dtype=np.uint8)
    header = 4 if kind == gguf.Q4_1 else 2
    raw[:, :header] = rng.uniform(-0.1, 0.1, size=(len(raw), header // 2)).astype(np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("seed", range(4))
def test_random_tensors_match_mx_load_bit_for_bit(tmp_path, seed):
    rng = np.random.default_rng(seed)
    tensors = []
    for i, kind in enumerate([gguf.Q4_0, gguf.Q4_1, gguf.Q8_0, gguf.F32, gguf.F16] * 2):
        shape = (int(rng.integers(1, 40)), 32 * int(rng.integers(1, 6)))
        if i >= 5:
            shape = (int(rng.integers(1, 4)), *shape)  # a 3-D tensor
        if kind in DEQUANTIZE:
            raw = random_blocks(rng, kind, int(np.prod(shape[:-1])), shape[-1]).tobytes()
        else:
            raw = rng.standard_normal(shape).astype(gguf._PLAIN[kind]).tobytes()
        tensors.append((f"t{i}.weight", kind, shape, raw))
    path = tmp_path / "random.gguf"
    write_gguf(path, tensors, [("general.architecture", 8, _string("llama")), ("n", 4, struct.pack("<I", 7)),
                               ("xs", 9, struct.pack("<IQ", 6, 3) + np.float32([1, 2, 3]).tobytes())])
    f = gguf.GGUFFile(path)
    assert f.readable()
    assert f.metadata["general.architecture"] == "llama" and f.metadata["n"] == 7
    assert f.metadata["xs"].tolist() == [1.0, 2.0, 3.0]
    names = list(f.tensors)
    rng.shuffle(names)
    ours = dict(f.arrays(names))
    ref = mx.load(str(path))
    assert set(ours) == set(ref)
    for k, v in ref.items():
        assert ours[k].dtype == v.dtype and ours[k].shape == v.shape, k
        assert mx.array_equal(ours[k].view(mx.uint8) if v.dtype != mx.uint32 else ours[k], v.view(mx.uint8) if v.dtype != mx.uint32 else v).item(), k


@pytest.mark.parametrize("kind", sorted(DEQUANTIZE))
def test_quantized_blocks_dequantize_as_ggml_defines_them(tmp_path, kind):
    rng = np.random.default_rng(kind)
    rows, cols = 37, 96
    raw = random_blocks(rng, kind, rows, cols)
    path = tmp_path / "q.gguf"
    write_gguf(path, [("w.weight", kind, (rows, cols), raw.tobytes())])
    out = dict(gguf.GGUFFile(path).arrays(["w.weight"]))
    bits = 8 if kind == gguf.Q8_0 else 4
    got = mx.dequantize(out["w.weight"], out["w.scales"], out["w.biases"], group_size=32, bits=bits).astype(mx.float32)
    want = DEQUANTIZE[kind][1](raw).reshape(rows, cols)
    # float16 scale x code + float16 bias, rounded once more to float16 by MLX's affine form (Q8_0's
    # bias is -128 x scale and Q4_0's -8 x scale, both exact in float16).
    np.testing.assert_allclose(np.array(got), want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_the_embedded_model_reads_as_mx_load_reads_it():
    from mlx_h2o.loading import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    f = gguf.GGUFFile(path)
    assert f.readable()
    ref, meta = mx.load(str(path), return_metadata=True)
    ours = dict(f.arrays(list(f.tensors)))
    assert set(ours) == set(ref)
    for k, v in ref.items():
        assert ours[k].dtype == v.dtype and mx.array_equal(ours[k], v).item(), k
    assert set(f.metadata) == set(meta)
    for k, v in meta.items():
        assert (np.array_equal(f.metadata[k], np.array(v)) if isinstance(v, mx.array) else f.metadata[k] == v), k


def test_bad_files_get_a_value_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf.GGUFFile(path)
    write_gguf(path, [("w.weight", gguf.F32, (4, 32), np.zeros((4, 32), np.float32).tobytes())])
    data = path.read_bytes()
    path.write_bytes(data[:40])
    with pytest.raises(ValueError, match="not a complete GGUF file"):
        gguf.GGUFFile(path)
    path.write_bytes(data[: len(data) - 64])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        list(gguf.GGUFFile(path).arrays(["w.weight"]))
    write_gguf(path, [("w.weight", 14, (4, 256), bytes(4 * 210))])  # Q6_K: MLX's own loader widens it
    assert not gguf.GGUFFile(path).readable()
    with pytest.raises(ValueError, match="GGML type 14"):
        list(gguf.GGUFFile(path).arrays(["w.weight"]))
