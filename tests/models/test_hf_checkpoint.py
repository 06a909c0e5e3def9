"""HF safetensors loading: logits parity with transformers on tiny random Llama / Qwen2 / Qwen3, sharded
indexes, sharding placement, clear errors for bad folders, and (GPU) the sampler's decode attention for head sizes
the Pallas kernel does and does not take against transformers.

Precision: fp32 parameters and compute; on a GPU (``TREEJAX_TEST_DEVICE=gpu``) under ``highest`` matmul
precision (tests/conftest.py), so the tolerances are the CPU ones: max relative logits error 1e-5 (forward and
decode steps), greedy tokens equal; decode steps with a bf16 KV cache: 2**-6 relative (see that test)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from treejax.models import hf_checkpoint, transformer  # noqa: E402
from treejax.models.hf_checkpoint import CheckpointError, load_hf_checkpoint  # noqa: E402

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def make_hf_model(family: str, tie: bool, seed: int = 0, **overrides):
    """A tiny random HF model; 1-D params (norms, biases) are perturbed so they are not trivially 1 / 0.
    ``overrides``: config fields (e.g. ``head_dim``)."""
    cfg_cls, model_cls = FAMILIES[family]
    fields = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, rope_theta=5000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=tie, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    hc = cfg_cls(**(fields | overrides))
    torch.manual_seed(seed)
    model = model_cls(hc).eval().float()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def padded_batch(vocab: int):
    rng = np.random.RandomState(1)
    toks = rng.randint(3, vocab, (3, 11))
    mask = np.ones_like(toks)
    mask[1, 7:] = 0  # right padding
    mask[2, 4:] = 0
    return toks, mask


def hf_logits(model, toks, mask):
    with torch.no_grad():
        return model(torch.tensor(toks), attention_mask=torch.tensor(mask)).logits.float().numpy()


def treejax_logits(params, config, toks, mask):
    pos = np.broadcast_to(np.arange(toks.shape[1]), toks.shape)
    h = transformer.forward(params, config, jnp.asarray(toks), jnp.asarray(pos), jnp.asarray(mask))
    return np.asarray(transformer.logits(params, config, h))


def max_rel_err(ours, ref, mask):
    valid = mask.astype(bool)
    return np.abs(ours - ref)[valid].max() / np.abs(ref[valid]).max()


@pytest.mark.parametrize("family,tie", [("llama", True), ("llama", False), ("qwen2", False), ("qwen3", True)])
def test_logits_parity_with_transformers(tmp_path, family, tie):
    model = make_hf_model(family, tie)
    model.save_pretrained(tmp_path)
    config, params = load_hf_checkpoint(str(tmp_path))
    assert config.architecture == family and config.tie_word_embeddings == tie
    assert config.qkv_bias == (family == "qwen2") and config.qk_norm == (family == "qwen3")
    toks, mask = padded_batch(config.vocab_size)
    err = max_rel_err(treejax_logits(params, config, toks, mask), hf_logits(model, toks, mask), mask)
    assert err <= 1e-5, f"{family}: max relative logits error {err:.2e}"


@pytest.mark.devices(8)
def test_sharded_index_and_shardings(tmp_path):
    """A multi-file checkpoint with model.safetensors.index.json, placed straight into a mesh sharding."""
    model = make_hf_model("qwen2", tie=False, seed=3)
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config = hf_checkpoint.load_hf_config(str(tmp_path))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    P = jax.sharding.PartitionSpec
    logical = transformer.param_logical_axes(config)
    rules = {"embed": "data", "mlp": "model", "heads": "model", "kv_heads": "model", "vocab": "model"}
    shardings = jax.tree.map(lambda axes: jax.sharding.NamedSharding(mesh, P(*(rules.get(a) for a in axes))),
                             logical, is_leaf=lambda x: isinstance(x, tuple))
    config, params = load_hf_checkpoint(str(tmp_path), shardings=shardings)
    assert params["layers"]["wq"].sharding == shardings["layers"]["wq"]
    assert params["embed"].sharding == shardings["embed"]
    host_params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), params)  # values, off the mesh
    toks, mask = padded_batch(config.vocab_size)
    err = max_rel_err(treejax_logits(host_params, config, toks, mask), hf_logits(model, toks, mask), mask)
    assert err <= 1e-5


def test_bf16_param_dtype(tmp_path):
    make_hf_model("llama", tie=True).save_pretrained(tmp_path)
    config, params = load_hf_checkpoint(str(tmp_path), param_dtype="bfloat16")
    assert config.param_dtype == "bfloat16"
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))


# ----------------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    make_hf_model("llama", tie=False).save_pretrained(path)
    return path


def copy_folder(src, dst):
    for name in os.listdir(src):
        with open(src / name, "rb") as f:
            (dst / name).write_bytes(f.read())
    return dst


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_hf_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        load_hf_checkpoint(str(tmp_path))


def test_missing_weights_file(saved_llama, tmp_path):
    folder = copy_folder(saved_llama, tmp_path)
    os.remove(folder / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf_checkpoint(str(folder))


def test_missing_shard_named_by_index(tmp_path):
    make_hf_model("llama", tie=True).save_pretrained(tmp_path, max_shard_size="60KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    os.remove(shard)
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_hf_checkpoint(str(tmp_path))


def test_truncated_safetensors(saved_llama, tmp_path):
    folder = copy_folder(saved_llama, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 4096])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_hf_checkpoint(str(folder))


@pytest.mark.parametrize("changes,match", [
    (dict(model_type="mistral"), r"unsupported architecture model_type='mistral'"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), r"rope_scaling"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), r"rope_type='yarn'"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu'"),
    (dict(attention_bias=True), r"attention_bias"),
    (dict(mlp_bias=True), r"mlp_bias"),
])
def test_unsupported_config_fields(saved_llama, tmp_path, changes, match):
    folder = copy_folder(saved_llama, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=match) as info:
        load_hf_checkpoint(str(folder))
    assert "config.json" in str(info.value)


def test_sliding_window_rejected(tmp_path):
    make_hf_model("qwen2", tie=False).save_pretrained(tmp_path)
    edit_config(tmp_path, use_sliding_window=True, sliding_window=32)
    with pytest.raises(CheckpointError, match="use_sliding_window"):
        load_hf_checkpoint(str(tmp_path))


def test_shape_mismatch_names_tensor_file_and_shapes(saved_llama, tmp_path):
    folder = copy_folder(saved_llama, tmp_path)
    edit_config(folder, intermediate_size=100)
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(str(folder))
    msg = str(info.value)
    assert "mlp.gate_proj.weight" in msg and "model.safetensors" in msg and "(112, 64)" in msg and "(100, 64)" in msg


def test_missing_tensor_is_named(saved_llama, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = copy_folder(saved_llama, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.v_proj\.weight'"):
        load_hf_checkpoint(str(folder))


def test_unexpected_tensor_is_an_error(saved_llama, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = copy_folder(saved_llama, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"o_proj\.bias"):
        load_hf_checkpoint(str(folder))


# ----------------------------------------------------------------------------------------------- GPU decode
def tiny_llama_prompts(folder, head_dim: int):
    """A tiny random Llama (6 query heads over 2 KV heads of size ``head_dim``) saved to and loaded from
    ``folder``, and 3 left-padded prompts: ``(model, config, params, tokens [3, 11], mask [3, 11])``.

    Weights ~ N(0, 0.05^2): logits of scale ~2, so the teacher-forced logits below check fp32 to ~6e-7 relative
    on CPU and the smallest top-2 margin of the greedy steps (4e-4) is far above fp32 error."""
    model = make_hf_model("llama", tie=False, head_dim=head_dim, hidden_size=96, num_attention_heads=6,
                          initializer_range=0.05)
    model.save_pretrained(folder)
    config, params = load_hf_checkpoint(str(folder))
    assert config.head_dim == head_dim
    lengths = np.array([11, 7, 4])
    mask = (np.arange(11)[None, :] >= 11 - lengths[:, None]).astype(np.int64)
    left = np.zeros((3, 11), np.int64)
    left[mask > 0] = np.random.RandomState(2).randint(3, config.vocab_size, int(mask.sum()))
    return model, config, params, left, mask


def transformers_greedy(model, left, mask, new_tokens: int = 24):
    """transformers' fp32 greedy ``generate``: ``(tokens [B, N], logits [B, N, V])``."""
    with torch.no_grad():
        out = model.generate(torch.tensor(left), attention_mask=torch.tensor(mask), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences.numpy()[:, left.shape[1]:], torch.stack(out.logits, 1).float().numpy()


def sampler_greedy(config, params, left, mask, attention: str, new_tokens: int = 24):
    """The sampler's greedy continuations ``[B, new_tokens]`` of the prompts (fp32 cache)."""
    from treejax.sampling import decode, strategies

    fns = decode.make_model_fns(config, attention=attention, block_size=16, cache_dtype="float32")
    right, lens = decode.left_to_right_padded(left, mask)
    out = decode.generate(params, fns, right, lens, jax.random.key(0), new_tokens, strategies.Greedy(), stop_ids=())
    return np.asarray(out.tokens)


def decode_logits(config, params, left, mask, continuation, attention: str, cache_dtype: str):
    """Logits ``[B, N, V]`` of the sampler's decode steps (its prefill, cache and attention) fed each prompt and
    then ``continuation [B, N]`` (teacher forcing)."""
    from treejax.sampling import attention as attention_lib
    from treejax.sampling import decode

    fns = decode.make_model_fns(config, attention=attention, block_size=16, cache_dtype=cache_dtype)
    right, lens = decode.left_to_right_padded(left, mask)
    B, N = continuation.shape
    cache = fns.init_cache(B, attention_lib.round_cache_length(right.shape[1] + N, fns.cache_multiple))
    p = fns.prepare(params)
    prefill = jax.jit(lambda p, c, t, n: decode.prefill_prompts(fns, p, c, t, n, jnp.arange(B)))
    cache, pending, position = prefill(p, cache, jnp.asarray(right), jnp.asarray(lens))
    step = jax.jit(fns.step)
    logits = []
    for t in range(N):
        z, cache = step(p, pending, position + t, cache)
        logits.append(np.asarray(z))
        pending = jnp.asarray(continuation[:, t], jnp.int32)
    return np.stack(logits, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,attention", [(24, "auto"), (80, "auto"), (96, "auto"), (64, "pallas"),
                                                (128, "pallas")])
def test_gpu_decode_matches_transformers(tmp_path, head_dim, attention):
    """fp32 cache through ``"auto"`` (ragged: every fp32 cache, and head sizes 24, 80, 96 at any dtype) and the
    Pallas kernel (IEEE fp32 dots): transformers' greedy tokens, and its logits along them within 1e-5 relative
    (measured on CPU: <= 6.8e-7)."""
    model, config, params, left, mask = tiny_llama_prompts(tmp_path, head_dim)
    ref_tokens, ref_logits = transformers_greedy(model, left, mask)
    np.testing.assert_array_equal(sampler_greedy(config, params, left, mask, attention), ref_tokens)
    logits = decode_logits(config, params, left, mask, ref_tokens, attention, "float32")
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err <= 1e-5, f"head_dim {head_dim}, {attention}: max relative logits error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [24, 80, 96, 64, 128])
def test_gpu_decode_bf16_cache_matches_transformers(tmp_path, head_dim):
    """bf16 KV cache (fp32 model, queries cast to bf16 inside the attention) through ``"auto"``: the Pallas kernel
    for 64 and 128, ragged for 24, 80, 96. Logits along transformers' greedy tokens within ``2**-6`` relative to
    its fp32 logits: 4 bf16 unit roundoffs (``u = 2**-8``); K, V, q and the attention probabilities (and in the
    kernel its partial outputs) are rounded to bf16, each perturbing a layer's attention output by about ``u``
    relative. Measured on CPU: <= 0.6 u (ragged, dense) and <= 1.2 u (the kernel in Pallas' interpreter)."""
    model, config, params, left, mask = tiny_llama_prompts(tmp_path, head_dim)
    ref_tokens, ref_logits = transformers_greedy(model, left, mask)
    logits = decode_logits(config, params, left, mask, ref_tokens, "auto", "bfloat16")
    err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
    assert err <= 2.0**-6, f"head_dim {head_dim}: max relative logits error {err:.2e} with a bf16 cache"
