"""A GGUF file read one tensor at a time, into the arrays `mx.load` makes of it.

Why not `mx.load`: it maps the whole file and copies every tensor while the map is resident, so a
93 MiB file lifts the process's peak RSS by ~195 MiB (the mapped pages and the copies), more than
anything after it at 512 tokens of context (docs/cpu-decode.md). Here the header is parsed from a
map that is closed before any tensor is read, and each tensor is read with `readinto` (the page
cache holds the file, not this process), converted, and handed to MLX before the next: the peak is
the tensors so far plus one.

The conversion is MLX's (mlx/io/gguf_quants.cpp): Q4_0, Q4_1 and Q8_0 blocks of 32 become MLX's
affine triplets (`name.weight` packed uint32, `name.scales` and `name.biases` float16, group size 32),
F32 and F16 stay as they are. `GGUFFile.readable()` says whether a file holds only those types;
others (K-quants, which MLX widens to float16) are for `mx.load`.
"""

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_BLOCK = 32  # weights per block in Q4_0 / Q4_1 / Q8_0
# GGML tensor types this reader converts: the block types -> bytes per block of _BLOCK, the plain ones
# -> their element type.
F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
_PLAIN = {F32: np.float32, F16: np.float16}


def _converts(ggml_type: int) -> bool:
    return ggml_type in _PLAIN or ggml_type in _BLOCK_BYTES
# Metadata value types (gguf's GGUF_VALUE_TYPE_*) -> struct format; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Rows of a quantized tensor converted at a time: bounds the conversion's own temporaries (~4 MiB read).
_ROWS_PER_READ = 4096


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: Tuple[int, ...]  # MLX / NumPy order (GGUF stores the dimensions innermost first)
    ggml_type: int
    offset: int  # from the start of the file


class _Cursor:
    """Little-endian reads from a buffer, with a clear error past its end."""

    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int):
        if self.pos + n > len(self.buf):
            raise ValueError(f"{self.path}: not a complete GGUF file (its header runs past the end of the file)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("<Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS and item != 7:
                dtype = np.dtype(_SCALARS[item])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).copy()
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF metadata value type {kind}")


class GGUFFile:
    """The header of a GGUF file (metadata and tensor table), and its tensors on demand.

    metadata: key -> int / float / bool / str, a NumPy array for numeric arrays, a list otherwise.
    """

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                cur = _Cursor(view, self.path)
                if bytes(cur.take(4)) != _MAGIC:
                    raise ValueError(f"{self.path}: not a GGUF file (no 'GGUF' magic at its start)")
                version = cur.unpack("<I")
                if version not in (2, 3):
                    raise ValueError(f"{self.path}: GGUF version {version}; this reader knows versions 2 and 3")
                n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
                self.metadata = {}
                for _ in range(n_kv):
                    key = cur.string()
                    self.metadata[key] = cur.value(cur.unpack("<I"))
                infos = []
                for _ in range(n_tensors):
                    name = cur.string()
                    dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
                    infos.append((name, tuple(reversed(dims)), cur.unpack("<I"), cur.unpack("<Q")))
                alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
                data_start = -(-cur.pos // alignment) * alignment
                self.size = len(mm)
            finally:
                view.release()
        self.tensors: Dict[str, TensorInfo] = {n: TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos}

    def readable(self) -> bool:
        """Whether every tensor is of a type this reader converts (else: mx.load)."""
        return all(_converts(t.ggml_type) for t in self.tensors.values())

    def nbytes(self, info: TensorInfo) -> int:
        """Bytes of the tensor in the file (of a type this reader converts)."""
        if not _converts(info.ggml_type):
            raise ValueError(f"{self.path}: tensor {info.name!r} has GGML type {info.ggml_type}, which this reader does not convert")
        n = int(np.prod(info.shape, dtype=np.int64))
        if info.ggml_type in _PLAIN:
            return n * np.dtype(_PLAIN[info.ggml_type]).itemsize
        return n // _BLOCK * _BLOCK_BYTES[info.ggml_type]

    def arrays(self, names: List[str]) -> Iterator[Tuple[str, object]]:
        """(MLX name, evaluated mx.array) for each tensor in `names`, in that order, one read at a
        time: a quantized `x.weight` gives `x.weight`, `x.scales` and `x.biases`."""
        import mlx.core as mx

        with open(self.path, "rb", buffering=0) as f:
            for name in names:
                info = self.tensors[name]
                if info.offset + self.nbytes(info) > self.size:
                    raise ValueError(f"{self.path}: tensor {name!r} runs past the end of the file")
                for mlx_name, host in self._converted(f, info):
                    out = mx.array(host)
                    del host
                    mx.eval(out)
                    yield mlx_name, out

    def _converted(self, f, info: TensorInfo):
        f.seek(info.offset)
        if info.ggml_type in _PLAIN:
            host = np.empty(info.shape, _PLAIN[info.ggml_type])
            _read_exactly(f, host, self.path)
            yield info.name, host
            return
        if not info.name.endswith(".weight") or info.shape[-1] % _BLOCK:
            raise ValueError(f"{self.path}: quantized tensor {info.name!r} of shape {info.shape} is not a '.weight' "
                             f"with rows of whole {_BLOCK}-weight blocks")
        rows, cols = int(np.prod(info.shape[:-1], dtype=np.int64)), info.shape[-1]
        blocks = cols // _BLOCK
        per_word = 8 if info.ggml_type in (Q4_0, Q4_1) else 4
        weight = np.empty((rows, cols // per_word), np.uint32)
        scales = np.empty((rows, blocks), np.float16)
        biases = np.empty((rows, blocks), np.float16)
        raw = np.empty((min(rows, _ROWS_PER_READ), blocks, _BLOCK_BYTES[info.ggml_type]), np.uint8)
        for r0 in range(0, rows, _ROWS_PER_READ):
            n = min(_ROWS_PER_READ, rows - r0)
            chunk = raw[:n]
            _read_exactly(f, chunk, self.path)
            w, s, b = _convert_blocks(chunk, info.ggml_type)
            weight[r0 : r0 + n] = w.reshape(n, -1)
            scales[r0 : r0 + n], biases[r0 : r0 + n] = s, b
        del raw
        stem = info.name[: -len(".weight")]
        lead = info.shape[:-1]
        yield info.name, weight.reshape(*lead, -1)
        yield stem + ".scales", scales.reshape(*lead, blocks)
        yield stem + ".biases", biases.reshape(*lead, blocks)


def _read_exactly(f, host: np.ndarray, path) -> None:
    view = memoryview(host.reshape(-1)).cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{path}: the file ends inside a tensor")
        done += n


def _convert_blocks(raw: np.ndarray, ggml_type: int):
    """(packed uint32 words, scales, biases) of blocks `raw` (..., bytes per block), as
    mlx/io/gguf_quants.cpp unpacks them."""
    d = raw[..., 0:2].copy().view(np.float16)[..., 0]
    if ggml_type == Q8_0:
        q = raw[..., 2:] ^ np.uint8(0x80)  # int8 -> offset binary: the bias is -128 * scale
        return q.reshape(*q.shape[:-2], -1).copy().view(np.uint32), d, d * np.float16(-128)
    if ggml_type == Q4_1:
        m, qs = raw[..., 2:4].copy().view(np.float16)[..., 0], raw[..., 4:]
    else:  # Q4_0: the bias is -8 * scale
        m, qs = d * np.float16(-8), raw[..., 2:]
    # A block's 16 bytes hold weights 0-15 in their low nibbles and 16-31 in their high ones; MLX
    # packs weight j of a group into nibble j (little-endian) of its words.
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    packed = q[..., 0::2] | (q[..., 1::2] << np.uint8(4))
    return packed.reshape(*packed.shape[:-2], -1).copy().view(np.uint32), d, m
