"""The shared-prefix cascade attention with both passes through the Pallas split-K kernel
(``cascade_decode_attention(impl="pallas")``) against a float64 dense reference and the XLA cascade, and how the
model fns choose the passes.

Off the GPU the kernel runs in Pallas' interpreter; on a GPU (``TREEJAX_TEST_DEVICE=gpu``) the same tests run the
compiled Triton kernel, and the ``gpu`` tests add bfloat16 caches and the model's decode step.

Tolerances: float32 caches 1e-5 absolute (summation order and the kernel's ``l + eps`` normalization only; TF32
anywhere would give 1e-4..1e-2). bfloat16 caches: against fp32 attention of the stored values (q rounded to
bf16), ``2**-5 * max|v|`` as in ``test_attention.py`` (q, the probabilities and the kernel's per-split outputs are
rounded to bf16).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets
from treejax.models import transformer as T
from treejax.sampling import attention as A
from treejax.sampling import cache as cache_lib
from treejax.sampling import decode
from treejax.sampling.tree_config import (SHARED_PREFIX_MIN_PROMPT, SHARED_PREFIX_MIN_PROMPT_PALLAS,
                                          auto_shared_prefix)

INTERPRET = jax.default_backend() != "gpu"  # the compiled Triton kernel where there is one


def _problem(seed, *, P, W, K, G, H, Lp, Ls, n_P, dtype=np.float32, rows=None):
    """Random prefix/suffix caches, rows in a random physical order (a sub-batch of ``rows`` of the ``P W``),
    dead rows (position ``Lp + Ls``). Returns the cascade's inputs, the live mask and the logical suffix slots."""
    rng = np.random.default_rng(seed)
    R = P * W
    n_P = np.asarray(n_P, np.int32)
    k_pre, v_pre = (rng.normal(size=(P, K, Lp, H)).astype(np.float32) for _ in range(2))
    k_suf, v_suf = (rng.normal(size=(R, K, Ls, H)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(R, K * G, H)).astype(np.float32)
    logical = np.arange(R)
    prompt, rank = logical // W, logical % W
    j = rng.integers(0, Ls, size=R).astype(np.int32)
    j[:2] = [0, Ls - 1]  # first and last suffix slot
    dead = np.zeros(R, bool)
    dead[rng.choice(R, size=max(1, R // 6), replace=False)] = True
    j_in = np.where(dead, Lp + Ls - n_P[prompt], j).astype(np.int32)  # a dead row's position is Lp + Ls
    perm = rng.permutation(R)[:rows or R]  # physical row i holds logical row perm[i]
    cast = functools.partial(jnp.asarray, dtype=dtype)
    inputs = (jnp.asarray(q[perm][:, None]), cast(k_suf[perm]), cast(v_suf[perm]), jnp.asarray(j_in[perm]),
              cast(k_pre), cast(v_pre))
    fields = dict(prefix_len_P=jnp.asarray(n_P), row_prompt_R=jnp.asarray(prompt[perm], jnp.int32),
                  row_rank_R=jnp.asarray(rank[perm], jnp.int32), rows_per_prompt=W)
    return inputs, fields, ~dead[perm], j[perm]


def _reference(inputs, fields, j_R):
    """float64 softmax attention of each row over prefix[prompt, :n] ++ suffix[row, :j+1] of the stored values
    (q rounded to the cache dtype), GQA: head h reads KV head h // G."""
    def f64(x):
        return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)

    k_suf, v_suf, k_pre, v_pre = (f64(inputs[i]) for i in (1, 2, 4, 5))
    q = f64(inputs[0].astype(inputs[1].dtype))[:, 0]
    n_P, prompt_R = np.asarray(fields["prefix_len_P"]), np.asarray(fields["row_prompt_R"])
    R, Q, H = q.shape
    K = k_pre.shape[1]
    out = np.zeros((R, Q, H))
    for r in range(R):
        p = prompt_R[r]
        keys = np.concatenate([k_pre[p, :, :n_P[p]], k_suf[r, :, :j_R[r] + 1]], axis=1)  # [K, n + j + 1, H]
        vals = np.concatenate([v_pre[p, :, :n_P[p]], v_suf[r, :, :j_R[r] + 1]], axis=1)
        s = np.einsum("kgh,ksh->kgs", q[r].reshape(K, Q // K, H), keys) / np.sqrt(H)
        w = np.exp(s - s.max(-1, keepdims=True))
        out[r] = np.einsum("kgs,ksh->kgh", w / w.sum(-1, keepdims=True), vals).reshape(Q, H)
    return out


def _run(impl, inputs, fields, **kw):
    W = fields["rows_per_prompt"]
    f = A.make_cascade_attention(impl, kw.pop("block_size", 16), interpret=INTERPRET, **kw)
    dyn = {k: v for k, v in fields.items() if k != "rows_per_prompt"}
    return np.asarray(jax.jit(lambda i, d: f(*i, rows_per_prompt=W, **d))(inputs, dyn))


@pytest.mark.parametrize("block_h", [None, 16])
def test_pallas_cascade_float32_matches_reference_and_xla(block_h):
    """GQA (3 query heads per KV head), W G = 24 queries per prompt and KV head (block_h None -> 32: one padded
    program; 16: two programs, the second half masked), prompts of lengths 0, 7, 40 and the full 64 slots (4
    kernel splits of 16: empty and partial splits), rows permuted and sliced to a sub-batch, dead rows."""
    inputs, fields, live, j = _problem(0, P=4, W=8, K=2, G=3, H=16, Lp=64, Ls=32, n_P=[0, 7, 40, 64], rows=27)
    assert A.default_prefix_block_h(24) == 32
    got = _run("pallas", inputs, fields, prefix_block_h=block_h)
    assert got.shape == (27, 1, 6, 16) and got.dtype == np.float32
    assert np.all(np.isfinite(got))  # dead rows too
    assert live.sum() >= 20 and (~live).sum() >= 1
    want = _reference(inputs, fields, j)
    np.testing.assert_allclose(got[live, 0], want[live], rtol=0, atol=1e-5)
    xla = _run("xla", inputs, fields)
    np.testing.assert_allclose(got[live, 0], xla[live, 0], rtol=0, atol=1e-5)


def test_pallas_lse_empty_rows_merge_with_weight_zero():
    """A row of length 0 (a prompt with an empty prefix): the kernel gives l = 0, m = finfo.min, o = 0 -> lse = -inf,
    and the merge returns the other side exactly, no NaN; non-empty rows: lse = log sum_j e^{s_j}."""
    rng = np.random.default_rng(1)
    B, K, G, H, L = 3, 2, 5, 16, 32
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(B, K, G, H), (B, K, L, H), (B, K, L, H)])
    length = jnp.asarray([0, 9, 32])
    o, lse = A._pallas_attention_lse(q, k, v, length, block_size=16, block_h=16, interpret=INTERPRET)
    o, lse = np.asarray(o), np.asarray(lse)
    assert np.all(np.isneginf(lse[0])) and np.all(o[0] == 0)
    s = np.einsum("bkgh,bklh->bkgl", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(H)
    for b, n in [(1, 9), (2, 32)]:
        np.testing.assert_allclose(lse[b], np.log(np.exp(s[b, ..., :n]).sum(-1)), rtol=0, atol=1e-5)
    other_o, other_lse = jnp.asarray(o[1:2].repeat(3, 0)), jnp.asarray(lse[1:2].repeat(3, 0))
    merged = np.asarray(A.merge_attention(jnp.asarray(o), jnp.asarray(lse), other_o, other_lse))
    assert np.all(np.isfinite(merged))
    np.testing.assert_array_equal(merged[0], np.asarray(other_o)[0])
    both_empty = np.asarray(A.merge_attention(jnp.asarray(o[:1]), jnp.asarray(lse[:1]), jnp.asarray(o[:1]),
                                              jnp.asarray(lse[:1])))
    assert np.all(both_empty == 0)


def test_cascade_choice():
    """The cascade takes the Pallas passes exactly where the per-row attention is Pallas and no multi-device mesh
    is given; "xla" forces XLA; CPU model fns record "xla". The auto rule shares from 256-token prompts with the
    Pallas cascade, from 1,024 with the XLA one, and never the XLA cascade against the per-row kernel."""
    assert A.resolve_cascade_impl("auto", "pallas") == "pallas"
    assert A.resolve_cascade_impl("auto", "ragged") == "xla"
    assert A.resolve_cascade_impl("auto", "dense") == "xla"
    assert A.resolve_cascade_impl("xla", "pallas") == "xla"
    mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    assert A.resolve_cascade_impl("auto", "pallas", mesh1) == "pallas"
    if jax.device_count() >= 2:
        mesh2 = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
        assert A.resolve_cascade_impl("auto", "pallas", mesh2) == "xla"
    with pytest.raises(ValueError, match="cascade must be one of"):
        A.resolve_cascade_impl("pallas", "pallas")
    with pytest.raises(ValueError, match="cascade impl must be"):
        A.make_cascade_attention("auto")
    assert [A.default_prefix_block_h(n) for n in (1, 16, 17, 112, 128, 500)] == [16, 16, 32, 128, 128, 128]
    cfg = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
    if jax.default_backend() != "gpu":
        assert decode.make_model_fns(cfg, block_size=16).cascade_attention == "xla"
    assert decode.make_model_fns(cfg, block_size=16, cascade="xla").cascade_attention == "xla"
    for attention in ("pallas", "ragged"):  # a Pallas cascade is taken from 256-token prompts whatever the per-row
        assert auto_shared_prefix(SHARED_PREFIX_MIN_PROMPT_PALLAS, 4, attention, "pallas")
        assert not auto_shared_prefix(SHARED_PREFIX_MIN_PROMPT_PALLAS // 2, 4, attention, "pallas")
        assert auto_shared_prefix(SHARED_PREFIX_MIN_PROMPT, 4, attention, "xla") == (attention != "pallas")
    with pytest.raises(ValueError, match="block_h must be a power of two"):
        A._pallas_attention_lse(jnp.zeros((1, 1, 2, 16)), jnp.zeros((1, 1, 16, 16)), jnp.zeros((1, 1, 16, 16)),
                                jnp.ones((1,), jnp.int32), block_size=16, block_h=24, interpret=True)


# ----------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("block_h", [16, 32, 64, 128])
def test_pallas_cascade_bfloat16_on_gpu(block_h):
    """Compiled kernel, bfloat16 caches, qwen2.5-0.5b's head layout (14 query / 2 KV heads, H = 64, W = 16: W G =
    112 queries per prompt and KV head), prompts up to the full prefix capacity, the sweep's block_h values."""
    inputs, fields, live, j = _problem(2, P=6, W=16, K=2, G=7, H=64, Lp=512, Ls=144, n_P=[0, 1, 100, 255, 400, 512],
                                       dtype=jnp.bfloat16, rows=80)
    got = _run("pallas", inputs, fields, block_size=256, prefix_block_h=block_h)
    xla = _run("xla", inputs, fields, block_size=256)
    assert np.all(np.isfinite(got))
    want = _reference(inputs, fields, j)
    atol = 2.0**-5 * max(float(jnp.max(jnp.abs(inputs[i].astype(jnp.float32)))) for i in (2, 5))  # max |v|
    np.testing.assert_allclose(got[live, 0], want[live], rtol=0, atol=atol)
    np.testing.assert_allclose(xla[live, 0], want[live], rtol=0, atol=atol)
    np.testing.assert_allclose(got[live, 0], xla[live, 0], rtol=0, atol=2 * atol)


@pytest.mark.gpu
def test_model_step_pallas_cascade_on_gpu():
    """make_model_fns with the Pallas per-row attention takes the Pallas cascade; its shared-cache decode step
    (bf16 cache) gives the XLA cascade's logits to bf16 rounding (2% of the largest logit; 0.2% measured in
    Pallas' interpreter)."""
    cfg = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
    params = T.init_params(cfg, jax.random.key(0))
    fns = decode.make_model_fns(cfg, attention="pallas", block_size=16, cache_dtype="bfloat16")
    ref = decode.make_model_fns(cfg, attention="pallas", block_size=16, cache_dtype="bfloat16", cascade="xla")
    assert (fns.cascade_attention, ref.cascade_attention) == ("pallas", "xla")
    P, W = 3, 4
    prompts = jnp.asarray(np.random.RandomState(1).randint(60, 250, (P, 40)), jnp.int32)
    lengths = jnp.asarray([6, 1, 40], jnp.int32)
    cache = fns.init_shared_cache(P, W, 48, 32)
    cache, tok_P, pos_P = decode.prefill_prompts(fns, params, cache, prompts, lengths, jnp.arange(P, dtype=jnp.int32))
    perm = jnp.asarray(np.random.default_rng(3).permutation(P * W)[:9], jnp.int32)
    cache = cache_lib.map_rows(lambda x: x[perm], cache)
    tok, pos = tok_P[perm // W], pos_P[perm // W]
    caches = [cache, cache]
    for _ in range(4):
        outs = []
        for i, f in enumerate((fns, ref)):
            logits, caches[i] = jax.jit(f.step)(params, tok, pos, caches[i])
            outs.append(np.asarray(logits))
        finite = np.isfinite(outs[1])  # the padded vocabulary's logits are -inf in both
        scale = float(np.abs(outs[1][finite]).max())
        np.testing.assert_array_equal(np.isfinite(outs[0]), finite)
        np.testing.assert_allclose(outs[0][finite], outs[1][finite], rtol=0, atol=2e-2 * scale)
        tok, pos = jnp.argmax(outs[1], axis=-1).astype(jnp.int32), pos + 1
