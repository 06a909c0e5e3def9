"""Batched KV-cache decoding: bucketed prefill of variable-length prompts and a jitted decode loop.

Row protocol (shared with the tree rollout): a row is described by its *pending* token — the last token of its
sequence, whose key/value is not in the cache yet — and that token's position. Prefill writes the first
``len - 1`` prompt tokens; every decode step feeds each row's pending token at its position, writes its KV and
samples the next token from the resulting distribution. A fork therefore copies a cache row plus the pending
token, and re-entering a tree at a segment boundary only resets a row's position (its KV up to there is intact).

Per sampled token ``y_t`` the loop records
  * ``logprobs``           ``log pi(y_t | prefix)``, the policy at temperature 1 on the true vocabulary;
  * ``sampling_logprobs``  ``log q(y_t | prefix)`` under the strategy's distribution (0 for greedy);
  * ``entropy``            ``H(pi(. | prefix))`` (optional).
Randomness: token ``t`` of row ``r`` uses ``fold_in(fold_in(fold_in(fold_in(key, SAMPLE_STREAM), r), epoch), t)``
(:func:`token_keys`), so a row's draws do not depend on the batch it sits in, and the tree rollout (which gives
every re-used row a new ``epoch``) reproduces the linear sampler exactly when it never branches.

Compilation: prompts are padded to a length bucket (:func:`bucket_length`), so only the bucket, the batch size
and the static settings are part of the jit signature. Dead rows are fed position ``L`` (the cache length):
their KV write is dropped and the ragged attention ignores them.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from treejax.models import transformer
from treejax.models.config import ModelConfig
from treejax.parallel.axis_rules import DEFAULT_RULES, Rules
from treejax.sampling import attention as attention_lib
from treejax.sampling import cache as cache_lib
from treejax.sampling import token_stats as token_stats_lib
from treejax.sampling.strategies import Greedy, Strategy, mask_vocab, token_statistics

SAMPLE_STREAM = 0x5A3D  # fold_in constant of the token-sampling key stream

#: XLA options of the sampler's jitted programs. A decode step's matmuls are skinny (rows x hidden): cuBLAS beats
#: XLA's Triton GEMM fusions there (H200, qwen2.5-0.5b decode at 2048 context: 0.49 -> 0.51 of the HBM roofline
#: at 256 rows, 0.62 -> 0.63 at 1024). Ignored by other backends.
SAMPLER_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}

#: Trace counters (incremented when a jitted entry point is traced; tests use them to prove no recompiles).
TRACE_COUNTS: dict[str, int] = {}


def _count_trace(name: str):
    TRACE_COUNTS[name] = TRACE_COUNTS.get(name, 0) + 1


class FinishReason(enum.IntEnum):
    NOT_FINISHED = 0
    STOP = 1  # a stop token was sampled (it is part of the output)
    LENGTH = 2  # max_new_tokens reached


# ----------------------------------------------------------------------------------------------- model functions
@dataclasses.dataclass(frozen=True, eq=False)
class ModelFns:
    """The model as the sampler sees it (static, hashable by identity; injectable for scripted test policies).

    ``init_cache(rows, length) -> cache`` (every leaf has the row axis at position 0 and the slot axis at 2);
    ``prefill(params, tokens [B, Lp], positions [B, Lp], segment_ids [B, Lp], cache, rows [B]) -> cache``;
    ``step(params, tokens [R], positions [R], cache) -> (logits [R, V] fp32, cache)``;
    ``step_hidden`` (optional): the same step also returning the last layer's hidden states ``[R, E]`` (after the
    final norm), ``-> (logits, hidden, cache)``, for per-token statistics that read them
    (:mod:`treejax.sampling.token_stats`).
    ``extend`` (optional): ``(params, tokens [B, C], positions [B, C], valid [B, C], cache, rows [B]) -> cache``,
    a chunk appended over the rows' cached prefix (:func:`append_tokens`; multi-turn observations).
    ``cache_multiple``: allocated cache lengths are rounded up to a multiple of it (the attention block).
    ``init_shared_cache`` (optional): ``(prompts, rows_per_prompt, prefix_length, suffix_length) ->``
    :class:`~treejax.sampling.cache.SharedPrefixCache`; fns that have it take such a cache in ``prefill`` (the
    prompts go to the prefix buffers: ``rows`` are then prompt indices) and ``step`` / ``step_hidden`` (cascade
    attention); the tree sampler's ``TreeConfig.prefix_cache = "shared"`` needs it.
    ``mesh`` / ``rules``: with a mesh, the samplers constrain the cache (:meth:`shard_cache`) and the per-row
    state (:meth:`shard_rows`) to their logical shardings wherever they are rebuilt; params are expected already
    placed by ``transformer.param_logical_axes`` (e.g. ``logical_to_sharding(..., mesh, shapes=params)``).
    ``None``: nothing is constrained.
    """

    init_cache: Callable[[int, int], Any]
    prefill: Callable
    step: Callable
    vocab_size: int
    sampling_vocab_size: int
    cache_multiple: int = 1
    name: str = "model"
    prepare: Callable = lambda params: params  # noqa: E731  once per call, before the decode loops
    mesh: Any = None  # jax.sharding.Mesh | None
    rules: Rules = DEFAULT_RULES
    step_hidden: Callable | None = None
    extend: Callable | None = None
    init_shared_cache: Callable | None = None
    attention: str = "custom"  # the per-row decode attention make_model_fns resolved ("pallas", "pallas_tpu", ...)
    cascade_attention: str | None = None  # the cascade's passes (attention.CASCADE_PASSES; None: no cascade)

    def shard_cache(self, cache):
        """``cache`` constrained to its sharding on :attr:`mesh` (identity without a mesh)."""
        return cache if self.mesh is None else cache_lib.shard_cache(cache, self.mesh, self.rules)

    def shard_rows(self, tree):
        """Arrays with the row axis first, constrained to be sharded over rows (identity without a mesh)."""
        return tree if self.mesh is None else cache_lib.shard_rows(tree, self.mesh, self.rules)


@functools.lru_cache(maxsize=64)
def make_model_fns(config: ModelConfig, attention: str = "auto", block_size: int = 256,
                   cache_dtype: str = "bfloat16", fuse: bool | None = None, mesh=None,
                   rules: Rules = DEFAULT_RULES, cascade: str = "auto", cascade_block_h: int | None = None,
                   cascade_num_warps: int | None = None) -> ModelFns:
    """:class:`ModelFns` of the treejax transformer.

    ``attention`` (:mod:`treejax.sampling.attention`): ``"ragged"`` (online softmax over ``block_size`` KV
    blocks up to the longest live row), ``"pallas"`` (GPU split-K kernel with per-row lengths), ``"pallas_mgpu"``
    (its Mosaic GPU successor, :mod:`treejax.sampling.mgpu_attention`; not yet run on a GPU), ``"pallas_tpu"``
    (treejax's Pallas TPU kernel with per-row lengths, :mod:`treejax.sampling.tpu_attention`; tested in the TPU
    interpreter only), ``"dense"`` (masked attention over the whole allocated cache) or ``"auto"`` (pallas on GPU
    for power-of-two head sizes and 16-bit caches, pallas_tpu on TPU for head sizes that are multiples of 64,
    bf16 caches and ``block_size`` a multiple of 128, ragged otherwise; a kernel that cannot run raises
    ``ValueError`` here).
    ``fuse``: decode with fused q|k|v and gate|up projections (:func:`treejax.models.transformer.
    fuse_projections`); ``None`` = fuse on a single device, or on a mesh whose ``tensor`` axis is 1 (rows split
    over ``data``/``fsdp``); not with tensor parallelism (the concatenation would cross a tensor-sharded heads
    axis) nor for unsharded fns on a multi-device host (their programs stay as they were). ``mesh`` (a
    ``jax.sharding.Mesh``) / ``rules``: run sharded (see
    :class:`ModelFns`; :mod:`treejax.sampling.cache` says how the cache is laid out).
    ``cascade``: the passes of the shared-prefix cache's cascade attention
    (:func:`treejax.sampling.attention.resolve_cascade_impl`): ``"auto"`` = the per-row kernel where ``attention``
    resolved to a kernel (``"pallas"``, ``"pallas_mgpu"``, ``"pallas_tpu"``; no multi-device mesh), else XLA;
    ``"xla"`` forces XLA. ``cascade_block_h`` / ``cascade_num_warps``: the Pallas prefix pass's queries per program
    and warps (``None``: :func:`treejax.sampling.attention.default_prefix_block_h`, the kernel's 4 warps).
    """
    if fuse is None:
        fuse = jax.device_count() == 1 if mesh is None else mesh.shape.get("tensor", 1) == 1
    dtype = jnp.dtype(cache_dtype)
    attention = attention_lib.resolve_impl(attention, head_dim=config.head_dim, cache_dtype=dtype,
                                           block_size=block_size)
    attn_fn = attention_lib.make_decode_attention(attention, block_size, head_dim=config.head_dim, cache_dtype=dtype,
                                                  mesh=mesh, rules=rules)
    cascade_impl = attention_lib.resolve_cascade_impl(cascade, attention, mesh)
    cascade_fn = attention_lib.make_cascade_attention(cascade_impl, block_size, prefix_block_h=cascade_block_h,
                                                      prefix_num_warps=cascade_num_warps)

    def init_cache(rows, length):
        return cache_lib.init_kv_cache(config, rows, length, dtype)

    def init_shared_cache(prompts, rows_per_prompt, prefix_length, suffix_length):
        return cache_lib.init_shared_cache(config, prompts, rows_per_prompt, prefix_length, suffix_length, dtype)

    def prefill(params, tokens, positions, segment_ids, cache, rows):
        if cache_lib.is_shared(cache):  # rows = prompts; the prefix holds the written (non-padding) tokens
            kv = transformer.prefill(params, config, tokens, positions, segment_ids, cache.prefix_kv(), rows)[1]
            written = jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32)
            return cache.with_prefix_kv(kv, cache.prefix_length.at[rows].set(written))
        return transformer.prefill(params, config, tokens, positions, segment_ids, cache, rows)[1]

    def decode_hidden(params, tokens, positions, cache):
        if cache_lib.is_shared(cache):  # cascade attention (Pallas passes where attn_fn is Pallas, else XLA)
            cascade = functools.partial(cascade_fn, prefix_len_P=cache.prefix_length, row_prompt_R=cache.row_prompt,
                                        row_rank_R=cache.row_rank, rows_per_prompt=cache.rows_per_prompt)
            hidden, kv = transformer.decode_step_shared(params, config, tokens, positions, cache.suffix_kv(),
                                                        cache.prefix_kv(), cache.prefix_length[cache.row_prompt],
                                                        cascade)
            return hidden, cache.with_suffix_kv(kv)
        return transformer.decode_step(params, config, tokens, positions, cache, attention_fn=attn_fn)

    def step(params, tokens, positions, cache):
        hidden, cache = decode_hidden(params, tokens, positions, cache)
        return transformer.logits(params, config, hidden), cache

    def step_hidden(params, tokens, positions, cache):
        hidden, cache = decode_hidden(params, tokens, positions, cache)
        return transformer.logits(params, config, hidden), hidden, cache

    def extend(params, tokens, positions, valid, cache, rows):
        if cache_lib.is_shared(cache):
            raise ValueError("extend (appending tokens to cached rows) takes a per-row cache, not a shared-prefix "
                             "cache (the multi-turn sampler runs per-row only)")
        return transformer.extend(params, config, tokens, positions, valid, cache, rows)[1]

    return ModelFns(init_cache, prefill, step, config.vocab_size, config.sampling_vocab_size,
                    cache_multiple=block_size if attention != "dense" else 1,
                    name=f"transformer[{attention}]",
                    prepare=transformer.fuse_projections if fuse else transformer.unstack_layers,
                    mesh=mesh, rules=rules, step_hidden=step_hidden, extend=extend,
                    init_shared_cache=init_shared_cache, attention=attention, cascade_attention=cascade_impl)


def as_model_fns(model: ModelConfig | ModelFns, mesh=None, rules: Rules = DEFAULT_RULES) -> ModelFns:
    """``model`` as :class:`ModelFns`; a ``mesh`` builds (or, for given fns without a mesh, attaches) the sharded
    variant. Fns that already carry a different mesh are an error."""
    if not isinstance(model, ModelFns):
        return make_model_fns(model, mesh=mesh, rules=rules)
    if mesh is None or (model.mesh == mesh and model.rules == rules):
        return model
    if model.mesh is not None:
        raise ValueError(f"ModelFns {model.name!r} already carry a mesh; pass mesh=None or build them for this mesh")
    return _with_mesh(model, mesh, rules)


@functools.lru_cache(maxsize=64)
def _with_mesh(fns: ModelFns, mesh, rules: Rules) -> ModelFns:
    return dataclasses.replace(fns, mesh=mesh, rules=rules)  # cached: the jitted samplers key on the fns object


# ----------------------------------------------------------------------------------------------- helpers
def bucket_length(length: int, minimum: int = 16) -> int:
    """Prompt-length bucket: the next power of two ``>= max(length, minimum)`` (bounded recompiles)."""
    n = max(int(length), minimum)
    return 1 << (n - 1).bit_length()


def resolve_stop_ids(stop_ids, model=None, tokenizer=None) -> tuple[int, ...]:
    """``stop_ids`` as a tuple of ints; ``None`` (unset): the ``tokenizer``'s end-of-sequence ids when one is given
    (what a run with a real tokenizer stops on), else the model config's ``eos_token_ids`` (none for a plain
    :class:`ModelFns`). An explicit empty tuple means no stop ids."""
    if stop_ids is None:
        if tokenizer is not None:
            stop_ids = tokenizer.eos_ids
        else:
            stop_ids = model.eos_token_ids if isinstance(model, ModelConfig) else ()
    return tuple(int(s) for s in stop_ids)


def validate_prompts(prompt_tokens, prompt_lengths) -> tuple[np.ndarray, np.ndarray]:
    """Host-side checks with clear errors; returns int32 numpy arrays (right-padded tokens, lengths)."""
    tokens = np.asarray(prompt_tokens)
    lengths = np.asarray(prompt_lengths)
    if tokens.ndim != 2:
        raise ValueError(f"prompt_tokens must be [P, Lp], got shape {tokens.shape}")
    if lengths.shape != (tokens.shape[0],):
        raise ValueError(f"prompt_lengths must be [P={tokens.shape[0]}], got shape {lengths.shape}")
    if tokens.shape[0] == 0:
        raise ValueError("no prompts given (P = 0)")
    if np.any(lengths <= 0):
        bad = np.nonzero(lengths <= 0)[0].tolist()
        raise ValueError(f"empty prompt(s) at index {bad}: every prompt needs at least one token (e.g. BOS)")
    if np.any(lengths > tokens.shape[1]):
        bad = np.nonzero(lengths > tokens.shape[1])[0].tolist()
        raise ValueError(f"prompt_lengths at {bad} exceed the padded prompt width {tokens.shape[1]}")
    return tokens.astype(np.int32), lengths.astype(np.int32)


def pad_prompts(tokens: np.ndarray, bucket: int, pad_id: int = 0) -> np.ndarray:
    """Right-pads a ``[P, Lp]`` prompt array to its width bucket ``[P, bucket]`` (token lists of different lengths:
    :func:`treejax.data.prompts.pad_token_lists`)."""
    P, Lp = tokens.shape
    out = np.full((P, bucket), pad_id, np.int32)
    out[:, :Lp] = tokens
    return out


def left_to_right_padded(tokens, attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """Converts a left-padded batch (Hugging Face convention) to right-padded tokens + lengths."""
    tokens, mask = np.asarray(tokens), np.asarray(attention_mask).astype(bool)
    out = np.zeros_like(tokens)
    lengths = mask.sum(-1).astype(np.int32)
    for b in range(tokens.shape[0]):
        out[b, : lengths[b]] = tokens[b][mask[b]]
    return out.astype(np.int32), lengths


def token_keys(key: jax.Array, rows_R: jax.Array, epochs_R: jax.Array, t_R: jax.Array) -> jax.Array:
    """Per-row sampling keys ``fold_in(fold_in(fold_in(fold_in(key, SAMPLE_STREAM), row), epoch), t)``."""
    base = jax.random.fold_in(key, SAMPLE_STREAM)

    def one(r, e, t):
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, r), e), t)

    return jax.vmap(one)(rows_R, epochs_R, t_R)


def prefill_prompts(model: ModelFns, params, cache, prompts_PxLb: jax.Array, lengths_P: jax.Array,
                    rows_P: jax.Array):
    """Writes the first ``len - 1`` tokens of each prompt into cache row ``rows_P[p]`` (one padded batch).

    Returns ``(cache, pending_token_P, pending_position_P)``: the last prompt token is fed by the first decode
    step (see module docstring)."""
    P, Lb = prompts_PxLb.shape
    positions = jnp.broadcast_to(jnp.arange(Lb, dtype=jnp.int32)[None, :], (P, Lb))
    segment_ids = (positions < (lengths_P - 1)[:, None]).astype(jnp.int32)
    cache = model.shard_cache(model.prefill(params, prompts_PxLb, positions, segment_ids, cache, rows_P))
    pending = jnp.take_along_axis(prompts_PxLb, (lengths_P - 1)[:, None], axis=1)[:, 0]
    return cache, pending.astype(jnp.int32), (lengths_P - 1).astype(jnp.int32)


def append_tokens(model: ModelFns, params, cache, rows_B: jax.Array, pending_B: jax.Array, position_B: jax.Array,
                  tokens_BxC: jax.Array, length_B: jax.Array):
    """Appends ``length_B[b]`` tokens (``tokens_BxC[b, :length]``, e.g. an environment's observation) to cache row
    ``rows_B[b]`` after its prefix, in one chunk over the cached prefix (never re-prefilling it).

    Row protocol (module docstring): the row's pending token and ``tokens[:length - 1]`` get their KV written at
    positions ``position .. position + length - 1``; the last appended token becomes the new pending token at
    ``position + length``, fed by the next decode step. A row with ``length = 0`` is unchanged. Returns ``(cache,
    pending_B, position_B)``. Needs ``model.extend``."""
    if model.extend is None:
        raise ValueError(f"ModelFns {model.name!r} cannot append tokens to a cached prefix (no extend)")
    B, C = tokens_BxC.shape
    chunk = jnp.concatenate([pending_B[:, None], tokens_BxC[:, :C - 1]], axis=1).astype(jnp.int32)
    offsets = jnp.arange(C, dtype=jnp.int32)[None, :]
    valid = offsets < length_B[:, None]
    cache = model.shard_cache(model.extend(params, chunk, position_B[:, None] + offsets, valid, cache, rows_B))
    last = jnp.take_along_axis(tokens_BxC, jnp.maximum(length_B - 1, 0)[:, None], axis=1)[:, 0]
    pending = jnp.where(length_B > 0, last, pending_B).astype(jnp.int32)
    return cache, pending, (position_B + length_B).astype(jnp.int32)


def decode_token(model: ModelFns, strategy: Strategy, params, cache, pending_R, position_R, live_R, keys_R,
                 with_entropy: bool = True):
    """One decode step for all rows: feed the pending tokens, sample the next ones.

    Dead rows (``~live_R``) are fed position ``L`` (writes dropped). Returns ``(token, policy_logprob,
    sampling_logprob, entropy, cache)``, each ``[R]`` (entropy zeros unless ``with_entropy``)."""
    token, policy, sampling, entropy, _, _, cache = decode_token_stats(model, strategy, params, cache, pending_R,
                                                                    position_R, live_R, keys_R, with_entropy)
    return token, policy, sampling, entropy, cache


def decode_token_stats(model: ModelFns, strategy: Strategy, params, cache, pending_R, position_R, live_R, keys_R,
                       with_entropy: bool = True, top_k: int = 0, token_stats: tuple[str, ...] = (),
                       probe: Any = None):
    """:func:`decode_token` plus the policy's ``top_k`` largest log-probs per row, descending
    (``topk_RxK = top_k(z) - logsumexp(z)`` on the true vocabulary; ``[R, 0]`` when ``top_k = 0``, computing
    nothing) and the ``token_stats`` channels ``[R, C]`` (:mod:`treejax.sampling.token_stats`; ``probe``: the
    quality probe they may read). Returns ``(token, policy_logprob, sampling_logprob, entropy, topk_RxK, extra_RxC,
    cache)``."""
    pos = jnp.where(live_R, position_R, cache_lib.dead_position(cache))
    hidden = None
    if "probe" in token_stats:
        if model.step_hidden is None:
            raise ValueError(f"the per-token statistic 'probe' reads hidden states, which ModelFns {model.name!r} "
                             "do not return (no step_hidden)")
        logits, hidden, cache = model.step_hidden(params, pending_R, pos, cache)
    else:
        logits, cache = model.step(params, pending_R, pos, cache)
    cache = model.shard_cache(cache)
    logits = mask_vocab(logits.astype(jnp.float32), model.sampling_vocab_size)
    processed = strategy.process(logits)
    token = strategy.sample(keys_R, logits)
    policy, sampling, entropy = token_statistics(logits, processed, token, strategy.greedy, with_entropy)
    if top_k > 0:
        k = min(top_k, logits.shape[-1])  # a vocabulary smaller than k: the missing entries are -inf
        topk = lax.top_k(logits, k)[0] - jax.nn.logsumexp(logits, axis=-1)[:, None]
        topk = jnp.pad(topk, ((0, 0), (0, top_k - k)), constant_values=-jnp.inf)
    else:
        topk = jnp.zeros((logits.shape[0], 0), jnp.float32)
    extra = token_stats_lib.compute(token_stats, logits_RxV=logits, hidden_RxE=hidden, params=params, probe=probe)
    return token, policy, sampling, entropy, topk, extra, cache


# ----------------------------------------------------------------------------------------------- linear sampler
@struct.dataclass
class GenerateOutput:
    """Linear sampling result, ``N = max_new_tokens``.

    ``tokens [B, N]`` (pad 0 past the end), ``logprobs [B, N]`` (policy, temperature 1), ``sampling_logprobs
    [B, N]``, ``entropy [B, N]`` (zeros unless requested), ``mask [B, N]`` (True on generated tokens),
    ``lengths [B]``, ``finish_reason [B]`` (:class:`FinishReason`), ``decoded_tokens`` (scalar),
    ``prefilled_tokens`` (scalar); ``probe_logits [B, N]`` (with a ``probe``: ``w . h + b`` on the hidden state
    that sampled each token, :mod:`treejax.sampling.token_stats`; else ``None``)."""

    tokens: jax.Array
    logprobs: jax.Array
    sampling_logprobs: jax.Array
    entropy: jax.Array
    mask: jax.Array
    lengths: jax.Array
    finish_reason: jax.Array
    decoded_tokens: jax.Array
    prefilled_tokens: jax.Array
    probe_logits: jax.Array | None = None

    def last_probe_logit(self) -> jax.Array:
        """``[B]``: the probe at each row's last decoded token (0 for empty rows)."""
        t = jnp.maximum(self.lengths - 1, 0)[:, None]
        return jnp.where(self.lengths > 0, jnp.take_along_axis(self.probe_logits, t, axis=1)[:, 0], 0.0)


def stop_mask(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
    out = jnp.zeros(tokens.shape, bool)
    for s in stop_ids:
        out = out | (tokens == s)
    return out


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "strategy", "stop_ids", "with_entropy"),
                   compiler_options=SAMPLER_COMPILER_OPTIONS)
def _generate_core(params, prompts, lengths, key, probe=None, *, model: ModelFns, max_new_tokens: int,
                   strategy: Strategy, stop_ids: tuple[int, ...], with_entropy: bool) -> GenerateOutput:
    _count_trace("generate")
    B, Lb = prompts.shape
    N = max_new_tokens
    L = attention_lib.round_cache_length(Lb + N, model.cache_multiple)
    cache = model.shard_cache(model.init_cache(B, L))
    rows = jnp.arange(B, dtype=jnp.int32)
    params = model.prepare(params)
    cache, pending, position = prefill_prompts(model, params, cache, prompts, lengths, rows)
    epochs = jnp.zeros((B,), jnp.int32)
    f32 = jnp.zeros((B, N), jnp.float32)
    state = dict(t=jnp.int32(0), cache=cache, pending=pending, position=position, done=jnp.zeros((B,), bool),
                 reason=jnp.zeros((B,), jnp.int32), tokens=jnp.zeros((B, N), jnp.int32), logp=f32, slogp=f32,
                 ent=f32, mask=jnp.zeros((B, N), bool), probe=f32)
    row_keys = ("pending", "position", "done", "reason", "tokens", "logp", "slogp", "ent", "mask", "probe")
    stats = ("probe",) if probe is not None else ()

    def shard(s):  # per-row state sharded like the cache rows (identity without a mesh)
        return dict(s, **model.shard_rows({k: s[k] for k in row_keys}))

    state = shard(state)

    def cond(s):
        return (s["t"] < N) & ~jnp.all(s["done"])

    def body(s):
        t = s["t"]
        live = ~s["done"]
        keys = token_keys(key, rows, epochs, jnp.full((B,), t, jnp.int32))
        tok, lp, slp, ent, _, extra, cache = decode_token_stats(model, strategy, params, s["cache"], s["pending"],
                                                                s["position"], live, keys, with_entropy, 0, stats,
                                                                probe)
        tok = jnp.where(live, tok, 0)
        stopped = live & stop_mask(tok, stop_ids)
        at_len = live & ~stopped & (t + 1 >= N)
        reason = jnp.where(stopped, int(FinishReason.STOP), jnp.where(at_len, int(FinishReason.LENGTH), s["reason"]))
        zero = jnp.zeros_like(lp)
        return shard(dict(t=t + 1, cache=cache, pending=jnp.where(live, tok, s["pending"]),
                          position=s["position"] + live.astype(jnp.int32), done=s["done"] | stopped | at_len,
                          reason=reason, tokens=s["tokens"].at[:, t].set(tok),
                          logp=s["logp"].at[:, t].set(jnp.where(live, lp, zero)),
                          slogp=s["slogp"].at[:, t].set(jnp.where(live, slp, zero)),
                          ent=s["ent"].at[:, t].set(jnp.where(live & with_entropy, ent, zero)),
                          mask=s["mask"].at[:, t].set(live),
                          probe=s["probe"].at[:, t].set(jnp.where(live, extra[:, 0], zero)) if stats
                          else s["probe"]))

    s = lax.while_loop(cond, body, state)
    n = jnp.sum(s["mask"], axis=-1).astype(jnp.int32)
    return GenerateOutput(tokens=s["tokens"], logprobs=s["logp"], sampling_logprobs=s["slogp"], entropy=s["ent"],
                          mask=s["mask"], lengths=n, finish_reason=s["reason"], decoded_tokens=jnp.sum(n),
                          prefilled_tokens=jnp.sum(lengths - 1), probe_logits=s["probe"] if stats else None)


def generate(params, model: ModelConfig | ModelFns, prompts, lengths, key: jax.Array, max_new_tokens: int,
             strategy: Strategy = Greedy(), stop_ids: tuple[int, ...] | None = None,
             with_entropy: bool = False, mesh=None, rules: Rules = DEFAULT_RULES, probe=None) -> GenerateOutput:
    """Linear sampling of ``max_new_tokens`` after each right-padded prompt (``prompts [B, Lp]``, ``lengths [B]``).

    ``stop_ids`` default to the model config's ``eos_token_ids``. A row stops after sampling a stop token (kept in
    the output) or after ``max_new_tokens``. One compiled program per (batch, prompt bucket, settings); the loop
    exits early when every row is done. ``mesh`` / ``rules``: sample sharded on a ``jax.sharding.Mesh`` (cache
    rows over ``data x fsdp``, KV heads over ``tensor``, see :mod:`treejax.sampling.cache`; place ``params`` by
    ``transformer.param_logical_axes`` first); same as passing ``make_model_fns(config, mesh=mesh)``.
    ``probe`` (``{"w": [E], "b": []}``, e.g. ARRoL's quality head): also record its logit at every token
    (``GenerateOutput.probe_logits``; the fns need ``step_hidden``).
    """
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    fns = as_model_fns(model, mesh, rules)
    stop_ids = resolve_stop_ids(stop_ids, model)
    tokens, lens = validate_prompts(prompts, lengths)
    bucket = bucket_length(tokens.shape[1])
    return _generate_core(params, jnp.asarray(pad_prompts(tokens, bucket)), jnp.asarray(lens), key, probe, model=fns,
                          max_new_tokens=int(max_new_tokens), strategy=strategy, stop_ids=stop_ids,
                          with_entropy=bool(with_entropy))


# ----------------------------------------------------------------------------------------------- teacher forcing
@functools.partial(jax.jit, static_argnames=("model",), compiler_options=SAMPLER_COMPILER_OPTIONS)
def _score_core(params, prompts, lengths, tokens, token_lengths, *, model: ModelFns) -> jax.Array:
    _count_trace("score_tokens")
    B, Lb = prompts.shape
    T = tokens.shape[1]
    L = attention_lib.round_cache_length(Lb + T, model.cache_multiple)
    cache = model.shard_cache(model.init_cache(B, L))
    params = model.prepare(params)
    cache, pending, position = prefill_prompts(model, params, cache, prompts, lengths, jnp.arange(B, dtype=jnp.int32))

    def body(s):
        t, cache, pending, logp = s
        live = t < token_lengths
        logits, cache = model.step(params, pending, jnp.where(live, position + t, L), cache)
        logits = mask_vocab(logits.astype(jnp.float32), model.sampling_vocab_size)
        lp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, t][:, None], axis=1)[:, 0]
        return (t + 1, model.shard_cache(cache), jnp.where(live, tokens[:, t], pending),
                logp.at[:, t].set(jnp.where(live, lp, 0.0)))

    s = lax.while_loop(lambda s: s[0] < jnp.max(token_lengths), body,
                       (jnp.int32(0), cache, pending, jnp.zeros((B, T), jnp.float32)))
    return s[3]


def score_tokens(params, model: ModelConfig | ModelFns, prompts, lengths, tokens, token_lengths) -> jax.Array:
    """float32 ``[B, T]``: ``log pi(tokens[b, t] | prompt_b, tokens[b, :t])`` under the policy at temperature 1 on
    the true vocabulary (as :func:`generate` records it), for ``t < token_lengths[b]`` (0 after), by teacher forcing
    through the sampler: each prompt prefilled once, then one decode step per token. Scores a response under a
    prompt it was not sampled from (NudgeRL's plain prompt, :mod:`treejax.rl.nudge`) in the sampler's numerics."""
    fns = as_model_fns(model)
    p, lens = validate_prompts(prompts, lengths)
    toks = np.asarray(tokens, np.int32)
    n = np.asarray(token_lengths, np.int32)
    if toks.ndim != 2 or toks.shape[0] != p.shape[0] or n.shape != (p.shape[0],) or (n > toks.shape[1]).any():
        raise ValueError(f"score_tokens: tokens {toks.shape} and token_lengths {n.shape} must be [B, T] and [B] with "
                         f"lengths <= T for B = {p.shape[0]} prompts")
    bucket = bucket_length(p.shape[1])
    return _score_core(params, jnp.asarray(pad_prompts(p, bucket)), jnp.asarray(lens), jnp.asarray(toks),
                       jnp.asarray(n), model=fns)
