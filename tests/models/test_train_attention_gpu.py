"""The cudnn training attention equals the general XLA masked attention on right-padded rows (GPU only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_cudnn_matches_xla_on_right_padded_rows(family):
    cfg = presets.tiny_config(family, param_dtype="bfloat16", compute_dtype="bfloat16", head_dim=64)
    params = transformer.init_params(cfg, jax.random.key(0))
    B, L = 3, 128
    tokens = jax.random.randint(jax.random.key(1), (B, L), 3, cfg.vocab_size)
    lengths = np.array([128, 70, 5])
    seg = jnp.asarray((np.arange(L)[None, :] < lengths[:, None]).astype(np.int32))
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    ref = transformer.forward(params, cfg, tokens, pos, seg, attention_impl="xla").astype(jnp.float32)
    got = transformer.forward(params, cfg, tokens, pos, seg, attention_impl="cudnn").astype(jnp.float32)
    valid = np.asarray(seg, bool)
    err = np.abs(np.asarray(got) - np.asarray(ref))[valid].max() / np.abs(np.asarray(ref)[valid]).max()
    assert err < 2e-2, f"bf16 relative error {err}"  # two bf16 attention implementations


def test_bad_attention_impl():
    cfg = presets.tiny_config("smollm2-135m")
    params = transformer.init_params(cfg, jax.random.key(0))
    with pytest.raises(ValueError, match="attention_impl"):
        transformer.forward(params, cfg, jnp.ones((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32),
                            attention_impl="flash")
