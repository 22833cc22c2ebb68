"""`mlx-h2o convert`: the embedded GGUF as an mlx-lm model directory that mlx-lm loads into the same
model: identical logits to `mlx_h2o.load()` on real text, the same tokenizer and chat template."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load as lm_load

import mlx_h2o
from mlx_h2o.cli import main as cli_main
from mlx_h2o.convert import convert


@pytest.fixture(scope="module")
def model_text():
    with open("/usr/share/common-licenses/Apache-2.0", encoding="utf-8") as f:
        return f.read()[:4000]


@pytest.mark.parametrize("weights", ["quantized", "float32"])
def test_directory_gives_the_same_logits(smollm, model_text, tmp_path, weights):  # smollm: skips without the model
    # None: the CPU default, packed weights (loading.DEFAULT_CPU_WEIGHTS); "float32" dequantizes.
    out = convert(tmp_path / "model", weights=None if weights == "quantized" else weights)
    lm_model, lm_tokenizer = lm_load(str(out))
    # MLX's own layers on both sides (load() would switch its model to mlx-h2o's CPU kernels on stock MLX)
    model, tokenizer = mlx_h2o.load(weights=weights, cpu_kernels=False)
    tokens = tokenizer.encode(model_text)
    assert lm_tokenizer.encode(model_text) == tokens
    x = mx.array(tokens[:384])[None]
    expected, got = model(x), lm_model(x)
    assert expected.dtype == got.dtype == mx.float32
    assert mx.array_equal(expected, got).item(), mx.abs(expected - got).max().item()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    if weights == "quantized":
        # 4-bit linears by default, the 8-bit embedding listed by path
        assert config["quantization"]["bits"] == 4
        assert config["quantization"]["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    else:
        assert "quantization" not in config


def test_tokenizer_and_chat_template(smollm, tmp_path):
    _, tokenizer = smollm
    out = convert(tmp_path / "model", weights="quantized")  # the smallest directory
    _, lm_tokenizer = lm_load(str(out))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime > 10."}]
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert lm_tokenizer.apply_chat_template(messages, add_generation_prompt=True) == expected
    assert lm_tokenizer.eos_token_ids == tokenizer.eos_token_ids
    assert "<|im_start|>" in lm_tokenizer.decode(expected)


def test_cli_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert cli_main(["convert", "--out", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "keep.txt").exists()
    with pytest.raises(ValueError, match="weights must be one of"):
        convert(tmp_path / "other", weights="int3")
