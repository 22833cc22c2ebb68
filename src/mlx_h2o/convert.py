"""`mlx-h2o convert --out DIR`: a llama GGUF (default: the embedded SmolLM2-135M-Instruct) written as an
mlx-lm model directory, so mlx-lm's own commands run it offline:

    mlx-h2o convert --out smollm2
    mlx_lm.generate --model smollm2 --kv-policy h2o --kv-option max_kv_size=64 --prompt "..."

The model and tokenizer come from `loading.load_gguf` (the same tensors, RoPE rows un-permuted, and
the same tokenizer `mlx_h2o.load()` uses); the directory holds them in mlx-lm's format:
model.safetensors (+ index), config.json (llama args, and the per-module quantization when the
weights stay packed), the tokenizer files and the chat template. mlx-lm loading the directory gives
the same logits as `mlx_h2o.load()` with the same `weights` (tests/test_convert.py).
"""

import dataclasses
import shutil
from pathlib import Path
from typing import Optional

from .loading import WEIGHT_MODES, default_model_path, load_gguf

def model_config(model, tokenizer) -> dict:
    """config.json for mlx-lm: the llama arguments, the eos ids, and each quantized module's
    group size and bits (the default is the most common; modules that differ are listed by path)."""
    config = dataclasses.asdict(model.args)
    config["eos_token_id"] = sorted(tokenizer.eos_token_ids)
    quantized = {p: {"group_size": m.group_size, "bits": m.bits} for p, m in model.named_modules() if hasattr(m, "bits")}
    if quantized:
        settings = [tuple(q.items()) for q in quantized.values()]
        default = dict(max(set(settings), key=settings.count))
        config["quantization"] = {**default, **{p: q for p, q in quantized.items() if q != default}}
    return config


def convert(out, gguf: Optional[str] = None, weights: Optional[str] = None, force: bool = False) -> Path:
    """Write the GGUF at `gguf` (default: the embedded model) to the directory `out`; returns it.
    `weights` as `load_gguf`'s (default: the GGUF's packed weights, which
    mlx_h2o's integer-dot kernel decodes fastest on the CPU). An existing non-empty `out` is an error unless `force`."""
    from mlx_lm.utils import save_config, save_model

    if weights is not None and weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ValueError(f"--out {str(out)!r} exists and is not an empty directory (give --force to replace it)")
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    model, tokenizer = load_gguf(gguf or default_model_path(), weights=weights)
    save_model(out, model)
    save_config(model_config(model, tokenizer), config_path=out / "config.json")
    tokenizer.save_pretrained(str(out))  # tokenizer.json, tokenizer_config.json, the chat template
    return out
