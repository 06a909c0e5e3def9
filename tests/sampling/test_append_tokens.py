"""Appending tokens over a cached prefix (transformer.extend, decode.append_tokens): a conversation decoded,
extended by an observation chunk and decoded on equals a full forward of the whole conversation (fp32), per row,
with rows of different prefix and chunk lengths, a row left alone (length 0) and a row subset."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer
from treejax.sampling import decode

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")


_REF_WIDTH = 32  # the rows below: a prompt of at most 6 tokens, 6 decoded and at most 4 appended


@jax.jit
def _padded_logits(params, t, seg):
    h = transformer.forward(params, CFG, t, jnp.arange(_REF_WIDTH)[None, :], seg)
    return jax.nn.log_softmax(transformer.logits(params, CFG, h[0]).astype(jnp.float32), axis=-1)


def _full_logits(params, seq):
    """log-softmax of the next-token distribution after every position of ``seq`` (one full forward, right-padded
    to ``_REF_WIDTH`` with segment id 0: padding attends to nothing and nothing attends to it, so the real tokens'
    forward is the unpadded one, and one jitted program serves every row)."""
    assert len(seq) <= _REF_WIDTH, (len(seq), _REF_WIDTH)
    t, seg = np.zeros((1, _REF_WIDTH), np.int32), np.zeros((1, _REF_WIDTH), np.int32)
    t[0, :len(seq)], seg[0, :len(seq)] = seq, 1
    return np.asarray(_padded_logits(params, jnp.asarray(t), jnp.asarray(seg)))[:len(seq)]


@pytest.mark.parametrize("fns", [FNS, decode.make_model_fns(CFG, attention="ragged", cache_dtype="float32",
                                                             block_size=8)], ids=["dense", "ragged"])
def test_decode_append_decode_equals_a_full_forward(fns):
    params = transformer.init_params(CFG, jax.random.key(1))
    prep = fns.prepare(params)
    prompts = np.array([[1, 5, 9, 2, 7, 3], [1, 11, 3, 0, 0, 0], [1, 2, 0, 0, 0, 0]], np.int32)
    lens = np.array([6, 3, 2], np.int32)
    obs = np.array([[40, 41, 42, 43], [50, 51, 0, 0], [0, 0, 0, 0]], np.int32)
    obs_len = np.array([4, 2, 0], np.int32)  # row 2 gets nothing appended
    R, L = 3, 32
    cache = fns.init_cache(R, L)
    cache, pending, position = decode.prefill_prompts(fns, prep, cache, jnp.asarray(prompts), jnp.asarray(lens),
                                                      jnp.arange(R, dtype=jnp.int32))
    step = jax.jit(fns.step)
    append = jax.jit(lambda *a: decode.append_tokens(fns, *a))
    seqs = [list(prompts[r, :lens[r]]) for r in range(R)]
    got = [[] for _ in range(R)]

    def decode_steps(n, cache, pending, position):
        for _ in range(n):
            logits, cache = step(prep, pending, position, cache)
            lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))
            tok = np.argmax(lp, axis=-1).astype(np.int32)
            for r in range(R):
                got[r].append(lp[r])
                seqs[r].append(int(tok[r]))
            pending, position = jnp.asarray(tok), position + 1
        return cache, pending, position

    cache, pending, position = decode_steps(3, cache, pending, position)
    cache, pending, position = append(prep, cache, jnp.arange(R, dtype=jnp.int32), pending, position,
                                      jnp.asarray(obs), jnp.asarray(obs_len))
    for r in range(R):
        seqs[r] += list(obs[r, :obs_len[r]])
    cache, pending, position = decode_steps(3, cache, pending, position)
    for r in range(R):
        full = _full_logits(params, seqs[r])
        n0 = lens[r] - 1  # the first decoded token's distribution sits after the prompt's last token
        at = [n0, n0 + 1, n0 + 2] + [n0 + 3 + obs_len[r] + i for i in range(3)]
        np.testing.assert_allclose(np.stack(got[r]), full[at], atol=1e-4)
    np.testing.assert_array_equal(np.asarray(position), lens - 1 + 6 + obs_len)


def test_append_to_a_row_subset_and_errors():
    params = transformer.init_params(CFG, jax.random.key(2))
    prep = FNS.prepare(params)
    cache = FNS.init_cache(4, 16)
    prompts = jnp.asarray(np.array([[1, 2, 3], [1, 4, 5]], np.int32))
    cache, pending, position = decode.prefill_prompts(FNS, prep, cache, prompts, jnp.array([3, 3]),
                                                      jnp.array([1, 3], dtype=jnp.int32))
    before = jax.tree.map(np.asarray, cache)
    cache, pend, pos = decode.append_tokens(FNS, prep, cache, jnp.array([3], dtype=jnp.int32), pending[1:],
                                            position[1:], jnp.array([[9, 8]], dtype=jnp.int32), jnp.array([2]))
    after = jax.tree.map(np.asarray, cache)
    for name in ("k", "v"):
        for a, b in zip(before[name], after[name]):
            np.testing.assert_array_equal(a[:3], b[:3])  # rows 0-2 untouched
            assert not np.array_equal(a[3, :, 2:4], b[3, :, 2:4])  # row 3 got slots 2 and 3
    assert int(pend[0]) == 8 and int(pos[0]) == 4
    with pytest.raises(ValueError, match="extend"):
        decode.append_tokens(decode.dataclasses.replace(FNS, extend=None), prep, cache, jnp.array([0]), pending[:1],
                             position[:1], jnp.array([[1]]), jnp.array([1]))
