"""Linear sampler: greedy parity with transformers' generate, log-probs vs a full forward, strategies, bucketing
without recompiles, bad input (the decode attention implementations: tests/sampling/test_attention.py).

Precision: fp32 model and caches (``highest`` matmul precision on a GPU, tests/conftest.py): greedy tokens equal
transformers', log-probs within 1e-4 of a full forward, token statistics within 1e-5."""

import functools

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


_REF_WIDTH = 48  # the longest prompt + response of the tests below is 9 + 24


@functools.partial(jax.jit, static_argnums=1)
def _padded_logits(params, cfg, seq, seg):
    return T.logits(params, cfg, T.forward(params, cfg, seq, jnp.arange(_REF_WIDTH)[None], seg))[0]


def _full_forward_logprobs(params, cfg, prompt, new_tokens):
    """Log-probs (and logits) of ``new_tokens`` after ``prompt`` from one full forward over prompt + tokens,
    right-padded to ``_REF_WIDTH`` with segment id 0 (padding attends to nothing and nothing attends to it: the
    real tokens' forward is the unpadded one), so one jitted program serves every row instead of an eager forward
    per sequence length."""
    n, m = len(prompt), len(prompt) + len(new_tokens)
    assert m <= _REF_WIDTH, (m, _REF_WIDTH)
    seq, seg = np.zeros((1, _REF_WIDTH), np.int32), np.zeros((1, _REF_WIDTH), np.int32)
    seq[0, :m], seg[0, :m] = np.concatenate([prompt, new_tokens]), 1
    z = _padded_logits(params, cfg, jnp.asarray(seq), jnp.asarray(seg))[n - 1: n - 1 + len(new_tokens)]
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


# ---------------------------------------------------------------------------------------- exactness of the draw
_exps_from_bits = jax.jit(S._exponentials_from_bits)
_draw_exps = jax.jit(S._draw_from_exponentials)


def _exps_of(K):
    """The generator's Exp(1) variates of 64-bit integers ``K`` (Python ints)."""
    K = [int(k) for k in K]
    hi = np.array([k >> 32 for k in K], np.uint32)
    lo = np.array([k & 0xFFFFFFFF for k in K], np.uint32)
    return np.asarray(_exps_from_bits(jnp.asarray(hi), jnp.asarray(lo)), np.float64)


def _generator_cdf(x, survival=False):
    """``P(E <= x)`` (or ``P(E > x)``) of the 64-bit generator, exactly: ``#{K : E(K) <= x} / 2^64`` found by
    bisection on ``K`` (``E`` is non-decreasing in ``K`` up to fp32 rounding, which moves the count by a relative
    ~1e-7)."""
    x = np.asarray(x, np.float64)
    lo, hi = [0] * x.size, [1 << 64] * x.size  # E(K) <= x for K < lo; E(K) > x for K >= hi
    for _ in range(65):
        mid = [(a + b) // 2 for a, b in zip(lo, hi)]
        below = _exps_of([min(m, (1 << 64) - 1) for m in mid]) <= x
        lo = [m + 1 if bl and h - a > 0 else a for m, bl, a, h in zip(mid, below, lo, hi)]
        hi = [h if bl else m for m, bl, h in zip(mid, below, hi)]
    return np.array([float((1 << 64) - h if survival else h) for h in hi]) / 2.0 ** 64


def test_exponentials_from_bits_extremes_and_distribution():
    """Every bit pattern gives a finite E > 0; both tails follow Exp(1) to relative 1e-5 (1e-15 <= x <= 30), plus
    the 2^-64 grid of the 64-bit integers (relative 5e-5 at x = 1e-15)."""
    E = _exps_of([0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 2, (1 << 64) - 1])
    assert np.all(np.isfinite(E)) and np.all(E > 0)
    np.testing.assert_allclose(E[:2], [0.5 * 2.0 ** -64, 1.5 * 2.0 ** -64], rtol=1e-6)  # K = 0: W = 2^-65, not 0
    np.testing.assert_allclose(E[2:4], np.log(2.0), rtol=1e-6)  # continuous across the two branches
    np.testing.assert_allclose(E[4:], [-np.log(1.5 * 2.0 ** -64), -np.log(0.5 * 2.0 ** -64)], rtol=1e-6)
    small = np.array([1e-15, 1e-12, 1e-9, 1e-6, 1e-3, 0.1, 0.6931])
    np.testing.assert_allclose(_generator_cdf(small), -np.expm1(-small), rtol=1e-5, atol=2.0 ** -64)
    large = np.array([0.6932, 1.0, 3.0, 10.0, 20.0, 30.0])
    np.testing.assert_allclose(_generator_cdf(large, survival=True), np.exp(-large), rtol=1e-5)


def _two_id_logits(V, heavy, light, p_light):
    z = np.full(V, -np.inf, np.float32)
    z[heavy], z[light] = 0.0, np.log(p_light / (1 - p_light))
    return z


@pytest.mark.parametrize("V,block,heavy,light", [
    (256, 128, 1, 0),      # the light id first in the vocabulary (the old sampler's u = 0 returned it)
    (256, 128, 60, 61),    # right after the heavy id, same block (lost in fl(1 + p) = 1 by the old sampler)
    (300, 128, 5, 130),    # a light block after a heavy block (the block race)
    (300, 128, 298, 299),  # the last id, in the padded last block
])
@pytest.mark.parametrize("p_light", [1e-9, 1e-12])
def test_exact_draw_preimage_has_the_id_probability(V, block, heavy, light, p_light):
    """Deterministic check of ``P(y = light) = p_light`` (relative 1e-5) for the draw as implemented: the pure
    transform with the heavy id's variate at the Gauss-Laguerre nodes ``x_i``, the light id's variate ``t``
    bisected to the edge ``t_i`` of its preimage ``{t : y = light}`` (an interval ``(0, t_i]``), and
    ``P = sum_i w_i P_gen(E <= t_i)`` with the 64-bit generator's exact CDF. The two ids race at the block level
    when they lie in different blocks, else inside their block."""
    nb = -(-V // block)
    z = _two_id_logits(V, heavy, light, p_light)
    x, w = np.polynomial.laguerre.laggauss(24)  # int_0^inf e^-x f(x) dx ~= sum w_i f(x_i)
    n = x.size
    same_block = heavy // block == light // block

    def draw(t):
        eb, ei = np.ones((n, nb), np.float32), np.ones((n, block), np.float32)
        if same_block:
            ei[:, heavy % block], ei[:, light % block] = x, t
        else:
            eb[:, heavy // block], eb[:, light // block] = x, t
        return np.asarray(_draw_exps(jnp.broadcast_to(jnp.asarray(z), (n, V)), jnp.asarray(eb), jnp.asarray(ei)))

    assert set(np.unique(draw(np.ones(n)))) == {heavy}  # equal variates: the heavier id, never the first one
    lo, hi = np.full(n, -80.0), np.full(n, 5.0)  # log t: the light id wins at lo, the heavy one at hi
    assert np.all(draw(np.exp(lo)) == light) and np.all(draw(np.exp(hi)) == heavy)
    for _ in range(60):
        mid = (lo + hi) / 2
        got = draw(np.exp(mid).astype(np.float32))
        assert np.all((got == light) | (got == heavy))
        lo, hi = np.where(got == light, mid, lo), np.where(got == light, hi, mid)
    prob = np.sum(w * _generator_cdf(np.exp(lo)))
    print(f"P(y = {light}) = {prob:.6e} vs p = {p_light:.1e}: relative error {prob / p_light - 1:+.1e}")
    np.testing.assert_allclose(prob, p_light, rtol=1e-5)


def test_exact_draw_extreme_variates_never_pick_masked_ids():
    """Variates at the generator's extremes (all bits 0 / all bits 1) on every slot, or the smallest variate on the
    masked slots only: the draw is an id with mass (the most probable one when all variates are equal)."""
    V, block = 300, 128
    z = np.full(V, -np.inf, np.float32)
    z[[0, 7, 130, 299]] = [np.log(1e-9), 2.0, 1.0, -30.0]
    e_min, e_max = _exps_of([0, (1 << 64) - 1])
    zz = jnp.broadcast_to(jnp.asarray(z), (2, V))
    for value in (e_min, e_max):
        got = np.asarray(_draw_exps(zz, jnp.full((2, 3), value, jnp.float32), jnp.full((2, block), value, jnp.float32)))
        assert np.all(got == 7)
    masked_small = np.full((2, block), e_max, np.float32)
    masked_small[:, [1, 2, 3, 127]] = e_min  # masked positions inside block 0
    eb = np.array([[e_max, e_min, e_max], [e_max, e_max, e_min]], np.float32)  # block 2 holds only id 299
    got = np.asarray(_draw_exps(zz, jnp.asarray(eb), jnp.asarray(masked_small)))
    assert got.tolist() == [130, 299]
    # a light id at the front wins only when its own variate is small enough: t / e_0 < x / e_7
    ei = np.ones((2, block), np.float32)
    ei[:, 0] = np.float32(1e-9 * np.exp(-2.0)) * np.array([0.99, 1.01], np.float32)
    got = np.asarray(_draw_exps(zz, jnp.ones((2, 3), jnp.float32), jnp.asarray(ei)))
    assert got.tolist() == [0, 7]


def test_exact_draw_monte_carlo_rare_ids():
    """1M draws of a row where ids of probability 1e-5 sit right after a dominant id and at id 0: counts within 5
    binomial standard deviations (+5 draws); rows do not depend on the batch they are drawn in."""
    V, block, n, chunk = 32, 4, 1_000_000, 250_000
    z = np.full(V, -np.inf, np.float32)
    p = np.zeros(V)
    p[[0, 12, 13, 30]] = [1e-5, 1e-5, 1e-3, 1e-4]
    p[11] = 1 - p.sum()
    z[p > 0] = np.log(p[p > 0])
    # the logits are an argument: a closed-over constant row would be constant-folded by XLA (slow compile)
    draw = jax.jit(lambda k, zr: S.inverse_cdf_sample(jax.random.split(k, chunk), jnp.broadcast_to(zr, (chunk, V)),
                                                      block))
    counts = sum(np.bincount(np.asarray(draw(jax.random.key(c), jnp.asarray(z))), minlength=V)
                 for c in range(n // chunk))
    assert counts[p == 0].sum() == 0
    bound = 5 * np.sqrt(n * p * (1 - p)) + 5
    assert np.all(np.abs(counts - n * p) <= bound), (counts[p > 0], n * p[p > 0])
    keys = jax.random.split(jax.random.key(0), 6)
    zz = jnp.broadcast_to(jnp.asarray(z), (6, V))
    np.testing.assert_array_equal(S.inverse_cdf_sample(keys[:3], zz[:3], block),
                                  S.inverse_cdf_sample(keys, zz, block)[:3])


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
    np.testing.assert_allclose(np.asarray(ent), -np.sum(pr * np.where(pr > 0, lp, 0.0), -1), atol=1e-5)  # 0 log 0 = 0
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


def test_score_tokens_equals_full_forward_and_generate():
    """Teacher-forced log-probs equal a full forward of prompt + tokens, and the sampler's own record of them."""
    cfg, params = _tiny(true_vocab_size=200)
    fns = decode.make_model_fns(cfg, attention="dense", cache_dtype="float32")
    rng = np.random.RandomState(3)
    lengths = np.array([9, 4, 6])
    prompts = rng.randint(3, 200, (3, 9))
    out = decode.generate(params, fns, prompts, lengths, jax.random.key(2), 10, S.Temperature(1.0), stop_ids=(5,))
    got = np.asarray(decode.score_tokens(params, fns, prompts, lengths, out.tokens, out.lengths))
    np.testing.assert_allclose(got, np.asarray(out.logprobs), atol=1e-5)
    for b in range(3):
        n = int(out.lengths[b])
        ref, _ = _full_forward_logprobs(params, cfg, prompts[b, : lengths[b]], np.asarray(out.tokens[b, :n]))
        np.testing.assert_allclose(got[b, :n], ref, atol=1e-4)
        assert not got[b, n:].any()
    with pytest.raises(ValueError, match="token_lengths"):
        decode.score_tokens(params, fns, prompts, lengths, out.tokens, np.array([11, 1, 1]))
