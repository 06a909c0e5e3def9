"""Linear sampler: greedy parity with transformers' generate, log-probs vs a full forward, strategies, bucketing
without recompiles, bad input (the decode attention implementations: tests/sampling/test_attention.py).

Precision: fp32 model and caches (``highest`` matmul precision on a GPU, tests/conftest.py): greedy tokens equal
transformers', log-probs within 1e-4 of a full forward, token statistics within 1e-5."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets
from treejax.models import transformer as T
from treejax.sampling import decode
from treejax.sampling import strategies as S


def _hf_to_params(sd, cfg):
    g = lambda n: sd[n].detach().numpy().astype(np.float32)  # noqa: E731
    E, Q, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        d = dict(attn_norm=g(p + "input_layernorm.weight"), mlp_norm=g(p + "post_attention_layernorm.weight"),
                 wq=g(p + "self_attn.q_proj.weight").T.reshape(E, Q, H),
                 wk=g(p + "self_attn.k_proj.weight").T.reshape(E, K, H),
                 wv=g(p + "self_attn.v_proj.weight").T.reshape(E, K, H),
                 wo=g(p + "self_attn.o_proj.weight").T.reshape(Q, H, E),
                 w_gate=g(p + "mlp.gate_proj.weight").T, w_up=g(p + "mlp.up_proj.weight").T,
                 w_down=g(p + "mlp.down_proj.weight").T)
        if cfg.qkv_bias:
            d.update(bq=g(p + "self_attn.q_proj.bias").reshape(Q, H), bk=g(p + "self_attn.k_proj.bias").reshape(K, H),
                     bv=g(p + "self_attn.v_proj.bias").reshape(K, H))
        if cfg.qk_norm:
            d.update(q_norm=g(p + "self_attn.q_norm.weight"), k_norm=g(p + "self_attn.k_norm.weight"))
        layers.append(d)
    out = dict(embed=g("model.embed_tokens.weight"), layers={k: np.stack([x[k] for x in layers]) for k in layers[0]},
               final_norm=g("model.norm.weight"))
    if not cfg.tie_word_embeddings:
        out["lm_head"] = g("lm_head.weight").T
    return jax.tree.map(jnp.asarray, out)


@pytest.mark.parametrize("preset", ["smollm2-135m", "qwen2.5-0.5b", "qwen3-0.6b"])
def test_greedy_matches_transformers_generate(preset):
    torch = pytest.importorskip("torch")
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    cfg = presets.tiny_config(preset, tie_word_embeddings=False)
    name = cls[cfg.architecture]
    hc = getattr(transformers, name + "Config")(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=False,
        max_position_embeddings=512, attention_bias=cfg.qkv_bias, initializer_range=0.25)
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(hc).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    params = _hf_to_params(model.state_dict(), cfg)
    rng = np.random.RandomState(1)
    lengths = np.array([12, 7, 3])
    left = np.zeros((3, 12), np.int64)
    mask = np.zeros((3, 12), np.int64)
    for b, n in enumerate(lengths):
        left[b, 12 - n:] = rng.randint(3, cfg.vocab_size, n)
        mask[b, 12 - n:] = 1
    with torch.no_grad():
        ref = model.generate(torch.tensor(left), attention_mask=torch.tensor(mask), max_new_tokens=64,
                             do_sample=False, pad_token_id=0, eos_token_id=None).numpy()[:, 12:]
    right, lens = decode.left_to_right_padded(left, mask)
    # Qwen2 (q/k/v biases) and Qwen3 (q/k norms) decode through the fused projections, Llama through the plain ones.
    fns = decode.make_model_fns(cfg, block_size=32, cache_dtype="float32", fuse=preset != "smollm2-135m")
    out = decode.generate(params, fns, right, lens, jax.random.key(0), 64, S.Greedy(), stop_ids=())
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert np.all(np.asarray(out.finish_reason) == int(decode.FinishReason.LENGTH))


def _tiny(preset="qwen2.5-0.5b", **kw):
    cfg = presets.tiny_config(preset, **kw)
    params = T.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params)  # peakier, less uniform logits
    return cfg, params


def _full_forward_logprobs(params, cfg, prompt, new_tokens):
    seq = np.concatenate([prompt, new_tokens])[None]
    pos = np.arange(seq.shape[1])[None]
    h = T.forward(params, cfg, jnp.asarray(seq), jnp.asarray(pos))
    z = T.logits(params, cfg, h)[0]
    n = len(prompt)
    z = z[n - 1: n - 1 + len(new_tokens)]
    lp = jax.nn.log_softmax(z, axis=-1)
    return np.asarray(lp[np.arange(len(new_tokens)), new_tokens]), z


@pytest.mark.parametrize("attention,fuse", [("ragged", True), ("dense", False)])
def test_logprobs_equal_full_forward(attention, fuse):
    cfg, params = _tiny(true_vocab_size=200)
    fns = decode.make_model_fns(cfg, attention=attention, block_size=16, cache_dtype="float32", fuse=fuse)
    rng = np.random.RandomState(0)
    lengths = np.array([9, 4, 6])
    prompts = rng.randint(3, 200, (3, 9))
    out = decode.generate(params, fns, prompts, lengths, jax.random.key(7), 24, S.TopK(k=20, temperature=0.8),
                          stop_ids=(5,), with_entropy=True)
    toks, mask = np.asarray(out.tokens), np.asarray(out.mask)
    assert np.all(toks[mask] < cfg.sampling_vocab_size)  # padded-vocabulary ids are never sampled
    for b in range(3):
        n = int(out.lengths[b])
        assert n >= 1 and mask[b, :n].all() and not mask[b, n:].any()
        ref, z = _full_forward_logprobs(params, cfg, prompts[b, : lengths[b]], toks[b, :n])
        np.testing.assert_allclose(np.asarray(out.logprobs[b, :n]), ref, atol=1e-4)
        # log-prob under the sampling distribution: top-20 of z / 0.8, renormalized
        zs = np.asarray(z) / 0.8
        kth = np.sort(zs, axis=-1)[:, -20]
        zs = np.where(zs >= kth[:, None], zs, -np.inf)
        ref_s = _np_log_softmax(zs)[np.arange(n), toks[b, :n]]
        np.testing.assert_allclose(np.asarray(out.sampling_logprobs[b, :n]), ref_s, atol=1e-4)
        if out.finish_reason[b] == decode.FinishReason.STOP:
            assert toks[b, n - 1] == 5 and 5 not in toks[b, : n - 1]
    ent = np.asarray(out.entropy)[mask]
    assert np.all(ent > 0) and np.all(ent <= np.log(200) + 1e-4)


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_strategies_against_numpy():
    rng = np.random.RandomState(0)
    z = rng.randn(4, 50).astype(np.float32) * 2
    zj = jnp.asarray(z)
    # top-k
    out = np.asarray(S.TopK(k=5, temperature=0.5).process(zj))
    for b in range(4):
        keep = np.argsort(-z[b])[:5]
        assert set(np.nonzero(np.isfinite(out[b]))[0]) == set(keep)
        np.testing.assert_allclose(out[b, keep], z[b, keep] / 0.5, rtol=1e-6)
    # top-p
    out = np.asarray(S.TopP(p=0.7, temperature=1.3).process(zj))
    for b in range(4):
        p = np.exp(_np_log_softmax(z[b] / 1.3))
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = order[before < 0.7]
        assert set(np.nonzero(np.isfinite(out[b]))[0]) == set(keep)
    # min-p
    out = np.asarray(S.MinP(p=0.1, temperature=1.0).process(zj))
    for b in range(4):
        p = np.exp(_np_log_softmax(z[b]))
        assert set(np.nonzero(np.isfinite(out[b]))[0]) == set(np.nonzero(p >= 0.1 * p.max())[0])
    # sampling frequencies follow the processed distribution
    keys = jax.random.split(jax.random.key(0), 20000)
    strat = S.Temperature(0.7)
    draws = np.asarray(strat.sample(keys, jnp.broadcast_to(zj[0], (20000, 50))))
    freq = np.bincount(draws, minlength=50) / 20000
    np.testing.assert_allclose(freq, np.exp(_np_log_softmax(z[0] / 0.7)), atol=0.015)
    with pytest.raises(ValueError, match="temperature"):
        S.Temperature(0.0)
    with pytest.raises(KeyError, match="unknown sampling strategy"):
        S.get_strategy("beam")


@pytest.mark.parametrize("V,block", [(50, 128), (1000, 128), (1003, 16)])
def test_inverse_cdf_sample_frequencies(V, block):
    """The one-uniform-per-row sampler draws softmax(z) exactly (chi-square-sized tolerance) and never a masked id."""
    rng = np.random.RandomState(V)
    z = rng.randn(V).astype(np.float32) * 3
    z[rng.rand(V) < 0.3] = -np.inf  # masked ids (e.g. padded vocabulary, top-k)
    z[-1] = -np.inf  # the last block's tail is masked too
    p = np.exp(_np_log_softmax(z))
    n = 40000
    draws = np.asarray(jax.jit(S.inverse_cdf_sample, static_argnames="block")(
        jax.random.split(jax.random.key(3), n), jnp.broadcast_to(jnp.asarray(z), (n, V)), block=block))
    assert np.all(np.isfinite(z[draws]))
    freq = np.bincount(draws, minlength=V) / n
    # 5 binomial standard deviations, plus 5 draws of slack for ids too rare for the normal approximation
    bound = 5 * np.sqrt(p * (1 - p) / n) + 5 / n
    worst = np.argmax(np.abs(freq - p) - bound)
    assert np.all(np.abs(freq - p) <= bound), f"id {worst}: frequency {freq[worst]:.5f} vs probability {p[worst]:.5f}"
    # a point mass anywhere (first id, a block edge, the last id) is always drawn
    for hot in sorted({h for h in (0, block - 1, block, V - 1) if h < V}):
        zz = np.full((8, V), -np.inf, np.float32)
        zz[:, hot] = 0.0
        got = np.asarray(S.inverse_cdf_sample(jax.random.split(jax.random.key(hot), 8), jnp.asarray(zz), block))
        assert np.all(got == hot)


def test_token_statistics_match_log_softmax():
    rng = np.random.RandomState(0)
    z = rng.randn(5, 40).astype(np.float32) * 2
    z[:, 30:] = -np.inf
    zp = z / 0.7
    tok = rng.randint(0, 30, 5)
    pol, samp, ent = S.token_statistics(jnp.asarray(z), jnp.asarray(zp), jnp.asarray(tok), greedy=False)
    lp = _np_log_softmax(z)
    np.testing.assert_allclose(np.asarray(pol), lp[np.arange(5), tok], atol=1e-5)
    np.testing.assert_allclose(np.asarray(samp), _np_log_softmax(zp)[np.arange(5), tok], atol=1e-5)
    pr = np.exp(lp)
    np.testing.assert_allclose(np.asarray(ent), -np.sum(np.where(pr > 0, pr * lp, 0), -1), atol=1e-5)
    zj = jnp.asarray(z)
    pol2, samp2, ent2 = S.token_statistics(zj, zj, jnp.asarray(tok), greedy=False, with_entropy=False)
    np.testing.assert_array_equal(np.asarray(samp2), np.asarray(pol2))
    assert not np.any(np.asarray(ent2))


def test_no_recompile_within_bucket_and_bad_input():
    cfg, params = _tiny()
    fns = decode.make_model_fns(cfg, block_size=16, cache_dtype="float32")
    rng = np.random.RandomState(0)
    before = decode.TRACE_COUNTS.get("generate", 0)
    for width, lengths in [(9, [9, 3]), (13, [2, 13]), (16, [16, 1])]:  # all in the 16 bucket
        decode.generate(params, fns, rng.randint(3, 256, (2, width)), np.array(lengths), jax.random.key(1), 8,
                        S.Temperature(1.0))
    assert decode.TRACE_COUNTS["generate"] - before == 1
    with pytest.raises(ValueError, match="empty prompt"):
        decode.generate(params, fns, np.ones((2, 4)), np.array([4, 0]), jax.random.key(0), 4)
    with pytest.raises(ValueError, match="exceed the padded prompt width"):
        decode.generate(params, fns, np.ones((2, 4)), np.array([4, 5]), jax.random.key(0), 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        decode.generate(params, fns, np.ones((2, 4)), np.array([4, 4]), jax.random.key(0), 0)
