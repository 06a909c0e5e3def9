"""Export -> transformers reload (local_files_only) -> the same logits; export -> treejax reload is exact."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from treejax.models import presets, registry, transformer  # noqa: E402
from treejax.models.export import export_hf  # noqa: E402
from treejax.models.hf_checkpoint import load_hf_checkpoint  # noqa: E402
from treejax.models.tokenizer import TextTokenizer  # noqa: E402


def random_params(config, seed):
    """init_params, with norms and biases perturbed so the export of every tensor is exercised."""
    params = transformer.init_params(config, jax.random.key(seed))
    bump = lambda x: x + 0.1 * jax.random.normal(jax.random.key(seed + 7), x.shape)  # noqa: E731
    params["final_norm"] = bump(params["final_norm"])
    params["layers"] = {k: (bump(v) if k.endswith("norm") or k.startswith("b") else v)
                        for k, v in params["layers"].items()}
    return params


@pytest.mark.parametrize("preset,tie", [("smollm2-135m", True), ("qwen2.5-0.5b", False), ("qwen3-0.6b", True)])
def test_export_reload_in_transformers_gives_same_logits(tmp_path, preset, tie):
    config = presets.tiny_config(preset, tie_word_embeddings=tie)
    params = random_params(config, seed=len(preset))
    export_hf(params, config, str(tmp_path))
    hf_cfg = json.loads((tmp_path / "config.json").read_text())
    assert hf_cfg["model_type"] == config.architecture
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True,
                                                              dtype=torch.float32).eval()
    assert type(model).__name__ == hf_cfg["architectures"][0]
    toks = np.random.RandomState(0).randint(3, config.vocab_size, (2, 10))
    mask = np.ones_like(toks)
    mask[1, 6:] = 0
    with torch.no_grad():
        ref = model(torch.tensor(toks), attention_mask=torch.tensor(mask)).logits.numpy()
    pos = np.broadcast_to(np.arange(10), toks.shape)
    ours = np.asarray(transformer.logits(params, config, transformer.forward(
        params, config, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask))))
    valid = mask.astype(bool)
    err = np.abs(ours - ref)[valid].max() / np.abs(ref[valid]).max()
    assert err <= 1e-5, err
    # And back through treejax's own loader: bit-identical params.
    config2, params2 = load_hf_checkpoint(str(tmp_path))
    assert config2.replace(true_vocab_size=config.true_vocab_size) == config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)


def test_export_with_tokenizer_and_bf16(tmp_path):
    gguf_path = registry.embedded_model_path("smollm2-135m-instruct")
    tok = TextTokenizer.from_gguf(gguf_path)
    config = presets.tiny_config("smollm2-135m", vocab_size=tok.vocab_size, eos_token_ids=tok.eos_ids, pad_token_id=2)
    params = random_params(config, seed=5)
    export_hf(params, config, str(tmp_path), tokenizer=tok, dtype="bfloat16")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        assert (tmp_path / name).is_file(), name
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert hf_tok.encode("Hello 123 wörld", add_special_tokens=False) == tok.encode("Hello 123 wörld")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), local_files_only=True)
    assert model.dtype == torch.bfloat16 and model.generation_config.eos_token_id == 2
    loaded_config, loaded, loaded_tok = registry.load_model(str(tmp_path), param_dtype="bfloat16")
    assert loaded_tok.eos_ids == tok.eos_ids and loaded_config.true_vocab_size is None
    expected = jax.tree.map(lambda x: np.asarray(x.astype(jnp.bfloat16)), params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), loaded, expected)
