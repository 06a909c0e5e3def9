"""Load a GGUF file (llama.cpp format) into treejax params, with the ``gguf`` package.

Tensor names (numpy view of a GGUF tensor is ``[rows=out, cols=in]``, like an HF ``nn.Linear`` weight):

    token_embd.weight  [V, E]            -> embed              output.weight [V, E] -> lm_head (absent = tied)
    blk.{l}.attn_norm / ffn_norm         -> attn_norm / mlp_norm                output_norm -> final_norm
    blk.{l}.attn_q / attn_k / attn_v     -> wq / wk / wv  (+ .bias -> bq/bk/bv; attn_{q,k}_norm -> q_norm/k_norm)
    blk.{l}.attn_output                  -> wo
    blk.{l}.ffn_gate / ffn_up / ffn_down -> w_gate / w_up / w_down

Dequantization uses ``gguf.quants.dequantize`` (llama.cpp's own Python reference). For block formats,
with ``d``/``m`` the fp16 block scale/min and ``q`` the packed integers:
    Q8_0: x = d·q (q int8, 32/block)        Q4_0: x = d·(q − 8) (q 4-bit)       Q4_1: x = d·q + m
    Q4_K: super-block of 256 = 8 sub-blocks of 32, 6-bit sub-scales s_j/mins m_j: x = d·s_j·q − dmin·m_j
    Q6_K: 16 sub-blocks of 16 with int8 scales s_j, 6-bit q: x = d·s_j·(q − 32)
``tests/models/test_gguf.py`` checks these against an independent numpy implementation.

Row permutation (Llama only). llama.cpp's ``convert_hf_to_gguf.py`` reorders the output rows of ``q_proj``
and ``k_proj`` from HF's rotate-half RoPE layout to GGML's interleaved-pair layout:

    W_gguf = W_hf.reshape(n, 2, H/2, E).swapaxes(1, 2).reshape(n·H, E)      (n = heads, or kv heads for K)

and this loader applies the inverse ``W_hf = W_gguf.reshape(n, H/2, 2, E).swapaxes(1, 2).reshape(n·H, E)``.
Qwen2 / Qwen3 are converted without the permutation (GGML runs them in NEOX rotate-half mode).
"""

from __future__ import annotations

import os

import numpy as np

from treejax.models.config import ARCHITECTURES, ModelConfig
from treejax.models.hf_checkpoint import CheckpointError, TensorSpec, load_stacked_params, tensor_specs

#: Tensor types whose dequantization ``tests/models/test_gguf.py`` verifies independently.
VERIFIED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf():
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - gguf is a hard dependency
        raise ImportError("loading GGUF files needs the `gguf` package: pip install gguf") from e
    return gguf


def open_gguf(path: str):
    """``gguf.GGUFReader`` for ``path`` (memory-mapped), with file errors naming the path."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing file {path}")
    try:
        return _gguf().GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/struct errors on malformed files
        raise CheckpointError(f"{path}: cannot read GGUF file, it is truncated or corrupt ({e!r})") from None


class _HeaderField:
    """A GGUF metadata value read by :func:`read_gguf_header`: ``contents()`` like ``gguf``'s ``ReaderField``
    (scalars and strings; an array's elements are skipped and ``data`` is only sized like it)."""

    def __init__(self, value, count: int = 1):
        self.value, self.data = value, range(count)

    def contents(self):
        return self.value


class _HeaderTensor:
    def __init__(self, name: str):
        self.name = name


class GGUFHeader:
    """``fields`` and ``tensors`` (names only) of a GGUF file, read by :func:`read_gguf_header` without building
    the tokenizer's arrays or mapping tensor data: enough for :func:`config_from_gguf`."""

    def __init__(self, fields: dict, tensors: list):
        self.fields, self.tensors = fields, tensors


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _read_value(f, vtype: int):
    """One GGUF value from file ``f``: a scalar, a string, or ``(None, count)`` for an array (skipped)."""
    import struct

    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == 8:
        (n,) = struct.unpack("<Q", f.read(8))
        return f.read(n).decode("utf-8", errors="replace")
    if vtype == 9:
        etype, count = struct.unpack("<IQ", f.read(12))
        if etype in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[etype]), 1)
        else:
            for _ in range(count):
                _read_value(f, etype)
        return _HeaderField(None, count)
    raise CheckpointError(f"unknown GGUF value type {vtype}")


def read_gguf_header(path: str) -> GGUFHeader:
    """The metadata and tensor names of GGUF file ``path`` (format v2/v3: magic, version, tensor and key counts,
    the key/value pairs, then each tensor's name, dimensions, type and offset), without the tokenizer's arrays:
    ~0.1 s where ``gguf.GGUFReader`` takes seconds on a 49k-token vocabulary. Errors name the path."""
    import struct

    if not os.path.isfile(path):
        raise FileNotFoundError(f"missing file {path}")
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise CheckpointError(f"{path}: not a GGUF file")
            version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
            if version < 2:
                raise CheckpointError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            fields = {}
            for _ in range(n_kv):
                key = _read_value(f, 8)
                value = _read_value(f, struct.unpack("<I", f.read(4))[0])
                fields[key] = value if isinstance(value, _HeaderField) else _HeaderField(value)
            tensors = []
            for _ in range(n_tensors):
                name = _read_value(f, 8)
                (dims,) = struct.unpack("<I", f.read(4))
                f.seek(8 * dims + 4 + 8, 1)
                tensors.append(_HeaderTensor(name))
    except (struct.error, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read the GGUF header, the file is truncated or corrupt ({e})") from None
    return GGUFHeader(fields, tensors)


def field_value(reader, key: str, default=None):
    """Python value of a GGUF metadata field (strings decoded, 1-element scalars unwrapped)."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _f32(x) -> float:
    """GGUF stores floats as float32; round-trip to the shortest decimal (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def config_from_gguf(reader, path: str = "<gguf>", param_dtype: str = "float32",
                     compute_dtype: str | None = None) -> ModelConfig:
    """Hyper-parameters from the ``{arch}.*`` metadata keys; tied embeddings iff ``output.weight`` is absent."""
    arch = field_value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: unsupported architecture general.architecture={arch!r}; "
                              f"supported: {ARCHITECTURES}")

    def get(key, default=None, required=True):
        value = field_value(reader, f"{arch}.{key}", default)
        if value is None and required:
            raise CheckpointError(f"{path}: required metadata key {arch}.{key} is missing")
        return value

    scaling = get("rope.scaling.type", required=False)
    if scaling not in (None, "none"):
        raise CheckpointError(f"{path}: unsupported field {arch}.rope.scaling.type={scaling!r} (only plain RoPE)")
    if get("attention.sliding_window", required=False):
        raise CheckpointError(f"{path}: unsupported field {arch}.attention.sliding_window="
                              f"{get('attention.sliding_window')} (only full causal attention)")
    names = {t.name for t in reader.tensors}
    E, Q = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", E // Q, required=False))
    rot = get("rope.dimension_count", required=False)
    if rot is not None and int(rot) != head_dim:
        raise CheckpointError(f"{path}: unsupported partial rotary embedding ({arch}.rope.dimension_count={rot} "
                              f"!= head_dim {head_dim})")
    vocab = get("vocab_size", required=False)
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
        vocab = len(tokens.data)
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    try:
        return ModelConfig(
            architecture=arch, vocab_size=int(vocab), hidden_size=E,
            intermediate_size=int(get("feed_forward_length")), num_layers=int(get("block_count")),
            num_heads=Q, num_kv_heads=int(get("attention.head_count_kv", Q, required=False)), head_dim=head_dim,
            rope_theta=_f32(get("rope.freq_base", 10000.0, required=False)),
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in names,
            qkv_bias="blk.0.attn_q.bias" in names, qk_norm="blk.0.attn_q_norm.weight" in names,
            max_position_embeddings=int(get("context_length", 4096, required=False)),
            param_dtype=param_dtype, compute_dtype=compute_dtype or param_dtype,
            bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            pad_token_id=field_value(reader, "tokenizer.ggml.padding_token_id"),
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def gguf_name(hf_name: str) -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight``."""
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}"


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K row permutation (see the module docstring); ``w: [n_heads*H, ...]``."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(tensor, path: str = "<gguf>") -> np.ndarray:
    """fp32 numpy array ``[rows, cols]`` (numpy order: reversed GGML ``ne``) of one ``ReaderTensor``."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
    try:
        out = gguf.quants.dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise CheckpointError(f"{path}: tensor {tensor.name!r} has GGML type {qtype.name}, which gguf "
                              f"{getattr(gguf, '__version__', '')} cannot dequantize") from None
    return np.asarray(out, dtype=np.float32)


def load_gguf_checkpoint(path: str, param_dtype: str = "float32", compute_dtype: str | None = None,
                         shardings: dict | None = None) -> tuple[ModelConfig, dict]:
    """``(ModelConfig, params)`` from a GGUF file; each parameter kind is dequantized, stacked and placed
    (``shardings`` like :func:`treejax.models.hf_checkpoint.load_hf_checkpoint`) before the next is read."""
    reader = open_gguf(path)
    config = config_from_gguf(reader, path, param_dtype, compute_dtype)
    tensors = {t.name: t for t in reader.tensors}
    specs = tensor_specs(config)
    expected = {gguf_name(s.hf_name(l)) for s in specs for l in range(config.num_layers if s.stacked else 1)}
    unexpected = sorted(n for n in tensors if n not in expected and not n.endswith("rope_freqs.weight"))
    if unexpected:
        raise CheckpointError(f"{path}: tensors {unexpected[:5]} have no place in a {config.architecture} model "
                              "with this metadata")

    def fetch(spec: TensorSpec, layer: int) -> np.ndarray:
        name = gguf_name(spec.hf_name(layer))
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name!r}")
        w = dequantize(tensors[name], path)
        if w.shape != spec.hf_shape:
            raise CheckpointError(f"tensor {name!r} in {path} has shape {w.shape}, expected {spec.hf_shape} "
                                  "from the GGUF metadata")
        if config.architecture == "llama" and spec.key[-1] in ("wq", "wk"):
            w = unpermute_qk(w, config.num_heads if spec.key[-1] == "wq" else config.num_kv_heads)
        return w

    return config, load_stacked_params(config, fetch, specs, shardings)
