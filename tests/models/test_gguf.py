"""GGUF loading: dequantization checked against an independent numpy implementation, llama.cpp's Q/K
permutation undone (tiny model written with gguf.GGUFWriter), and the real SmolLM2-135M-Instruct Q4_1 GGUF
against transformers' own GGUF loading of the same file (logits + 32-token greedy continuations).

Precision: dequantization against numpy to 1e-6 relative, the written tiny model exactly; the SmolLM2 model in fp32
(``highest`` matmul precision on a GPU, tests/conftest.py): logits within 1e-4 relative of transformers (30 layers
of quantized weights), greedy tokens equal."""

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from treejax.models import gguf_checkpoint, registry, transformer  # noqa: E402
from treejax.models.gguf_checkpoint import load_gguf_checkpoint  # noqa: E402
from treejax.models.hf_checkpoint import CheckpointError  # noqa: E402

QT = gguf.GGMLQuantizationType


# ----------------------------------------------------------------------------------------------- dequantization
def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def ref_q8_0(b):  # [n, 34]: d f16 | int8 q[32]
    return _f16(b[:, :2].copy())[:, :1] * b[:, 2:].view(np.int8).astype(np.float32)


def _nibbles(qs):  # low nibbles are elements 0..15, high nibbles 16..31
    return np.concatenate([qs & 0xF, qs >> 4], axis=1).astype(np.float32)


def ref_q4_0(b):  # [n, 18]: d | q[16]
    return _f16(b[:, :2].copy())[:, :1] * (_nibbles(b[:, 2:]) - 8)


def ref_q4_1(b):  # [n, 20]: d | m | q[16]
    return _f16(b[:, :2].copy())[:, :1] * _nibbles(b[:, 4:]) + _f16(b[:, 2:4].copy())[:, :1]


def ref_q4_k(b):  # [n, 144]: d | dmin | scales[12] | q[128]   (llama.cpp dequantize_row_q4_K)
    out = np.zeros((b.shape[0], 256), np.float32)
    for r in range(b.shape[0]):
        d, dmin = _f16(b[r, 0:2].copy())[0], _f16(b[r, 2:4].copy())[0]
        sc, q = b[r, 4:16].astype(np.int32), b[r, 16:144].astype(np.int32)

        def scale_min(j):
            if j < 4:
                return sc[j] & 63, sc[j + 4] & 63
            return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

        for c in range(4):
            s1, m1 = scale_min(2 * c)
            s2, m2 = scale_min(2 * c + 1)
            qc = q[32 * c: 32 * c + 32]
            out[r, 64 * c: 64 * c + 32] = d * s1 * (qc & 0xF) - dmin * m1
            out[r, 64 * c + 32: 64 * c + 64] = d * s2 * (qc >> 4) - dmin * m2
    return out


def ref_q6_k(b):  # [n, 210]: ql[128] | qh[64] | int8 scales[16] | d   (llama.cpp dequantize_row_q6_K)
    out = np.zeros((b.shape[0], 256), np.float32)
    for r in range(b.shape[0]):
        ql, qh = b[r, :128].astype(np.int32), b[r, 128:192].astype(np.int32)
        sc = b[r, 192:208].view(np.int8).astype(np.float32)
        d = _f16(b[r, 208:210].copy())[0]
        for half in range(2):
            L, H, S, y = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
            for l in range(32):
                i = l // 16
                q1 = ((L[l] & 0xF) | ((H[l] & 3) << 4)) - 32
                q2 = ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32
                q3 = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32
                q4 = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32
                out[r, y + l] = d * S[i] * q1
                out[r, y + l + 32] = d * S[i + 2] * q2
                out[r, y + l + 64] = d * S[i + 4] * q3
                out[r, y + l + 96] = d * S[i + 6] * q4
    return out


REFERENCES = {  # type: (block bytes, block elements, byte offsets of fp16 scale fields, reference)
    "Q8_0": (34, 32, (0,), ref_q8_0), "Q4_0": (18, 32, (0,), ref_q4_0), "Q4_1": (20, 32, (0, 2), ref_q4_1),
    "Q4_K": (144, 256, (0, 2), ref_q4_k), "Q6_K": (210, 256, (208,), ref_q6_k),
}


class FakeTensor:
    def __init__(self, name, data, qtype):
        self.name, self.data, self.tensor_type = name, data, qtype


@pytest.mark.parametrize("qname", sorted(REFERENCES))
def test_dequantize_matches_independent_reference(qname):
    nbytes, nelem, f16_fields, ref = REFERENCES[qname]
    rows, blocks = 3, 4
    rng = np.random.RandomState(0)
    raw = rng.randint(0, 256, (rows * blocks, nbytes)).astype(np.uint8)
    for off in f16_fields:  # finite, sane fp16 scales instead of random bit patterns
        raw[:, off: off + 2] = rng.uniform(-0.1, 0.1, rows * blocks).astype(np.float16).view(np.uint8).reshape(-1, 2)
    data = raw.reshape(rows, blocks * nbytes)
    ours = gguf_checkpoint.dequantize(FakeTensor("t", data, QT[qname]))
    expected = ref(raw).reshape(rows, blocks * nelem)
    assert ours.shape == (rows, blocks * nelem) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qname", ["F32", "F16", "BF16"])
def test_dequantize_float_types(qname):
    import ml_dtypes

    x = np.random.RandomState(1).randn(4, 32).astype(np.float32)
    stored = {"F32": x, "F16": x.astype(np.float16), "BF16": x.astype(ml_dtypes.bfloat16)}[qname]
    data = stored.view(np.uint8).reshape(4, -1) if qname == "BF16" else stored
    ours = gguf_checkpoint.dequantize(FakeTensor("t", data, QT[qname]))
    np.testing.assert_array_equal(ours, stored.astype(np.float32))


def llama_cpp_permute(w, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.RandomState(2).randn(3 * 16, 8)
    np.testing.assert_array_equal(gguf_checkpoint.unpermute_qk(llama_cpp_permute(w, 9, 3), 3), w)
    w = np.random.RandomState(3).randn(4 * 16, 8)
    np.testing.assert_array_equal(gguf_checkpoint.unpermute_qk(llama_cpp_permute(w, 4), 4), w)


# ----------------------------------------------------------------------------------------------- tiny written GGUF
def write_tiny_llama_gguf(path, model, quant_ffn: bool, arch="llama"):
    """Converts an HF Llama to GGUF the way convert_hf_to_gguf.py does (Q/K permuted), optionally Q8_0."""
    hc = model.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(hc.num_hidden_layers)
    w.add_context_length(hc.max_position_embeddings)
    w.add_embedding_length(hc.hidden_size)
    w.add_feed_forward_length(hc.intermediate_size)
    w.add_head_count(hc.num_attention_heads)
    w.add_head_count_kv(hc.num_key_value_heads)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(hc.rms_norm_eps)
    w.add_rope_dimension_count(hc.head_dim)
    w.add_vocab_size(hc.vocab_size)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    for name, arr in sd.items():
        if name in names:
            gname = names[name]
        else:
            gname = gguf_checkpoint.gguf_name(name)
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, hc.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, hc.num_attention_heads, hc.num_key_value_heads)
        if quant_ffn and "mlp." in name:
            w.add_tensor(gname, gguf.quants.quantize(arr, QT.Q8_0), raw_dtype=QT.Q8_0)
        else:
            w.add_tensor(gname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_hf_llama():
    hc = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=5000.0,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hc).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("quant_ffn", [False, True])
def test_written_gguf_unpermutes_qk(tmp_path, tiny_hf_llama, quant_ffn):
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, tiny_hf_llama, quant_ffn)
    config, params = load_gguf_checkpoint(str(path))
    assert not config.tie_word_embeddings and config.num_kv_heads == 2
    np.testing.assert_allclose(np.asarray(params["layers"]["wq"][1]),
                               tiny_hf_llama.model.layers[1].self_attn.q_proj.weight.detach().numpy().T.reshape(
                                   64, 4, 16), rtol=0, atol=0)
    toks = np.random.RandomState(0).randint(0, 96, (2, 9))
    with torch.no_grad():
        ref = tiny_hf_llama(torch.tensor(toks)).logits.numpy()
    pos = np.broadcast_to(np.arange(9), toks.shape)
    ours = np.asarray(transformer.logits(params, config, transformer.forward(params, config, jnp.asarray(toks),
                                                                             jnp.asarray(pos))))
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    # Q8_0 rounding of the MLP weights moves the logits slightly; unquantized must match to fp32 precision.
    assert err <= (2e-2 if quant_ffn else 1e-5), err


def test_gguf_errors(tmp_path, tiny_hf_llama):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf_checkpoint(str(tmp_path / "nope.gguf"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, tiny_hf_llama, quant_ffn=False)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated"):
        load_gguf_checkpoint(str(tmp_path / "cut.gguf"))
    write_tiny_llama_gguf(tmp_path / "gemma.gguf", tiny_hf_llama, quant_ffn=False, arch="gemma")
    with pytest.raises(CheckpointError, match=r"gemma\.gguf.*unsupported architecture.*'gemma'"):
        load_gguf_checkpoint(str(tmp_path / "gemma.gguf"))


# ----------------------------------------------------------------------------------------------- real SmolLM2
PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Compute 17 * 23."}],
]
GREEDY_STEPS = 32


@pytest.fixture(scope="module")
def smollm2():
    """treejax's load of the embedded GGUF (fp32) and transformers' own GGUF loading of the same file."""
    path = registry.embedded_model_path("smollm2-135m-instruct")
    config, params, tok = registry.load_model("smollm2-135m-instruct", param_dtype="float32")
    folder, fname = os.path.dirname(path), os.path.basename(path)
    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=fname)
    if transformers.utils.is_accelerate_available():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    else:  # from_pretrained(gguf_file=...) insists on `accelerate`; this is the same dequantize + permute path.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as hf_load_gguf

        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
        tensors = hf_load_gguf(path, return_tensors=True, model_to_load=model)["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
        model.tie_weights()
    model.eval()
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in PROMPTS]
    return dict(config=config, params=params, tok=tok, model=model, prompts=prompts)


def _right_pad(seqs, length, pad):
    toks = np.full((len(seqs), length), pad, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return toks, mask


def test_smollm2_config(smollm2):
    c = smollm2["config"]
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == ("llama", 30, 576, 9, 3)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.eos_token_ids == (2,) and c.bos_token_id == 1 and c.true_vocab_size is None
    assert c.num_params() == sum(x.size for x in jax.tree.leaves(smollm2["params"]))


def test_smollm2_logits_match_transformers_gguf(smollm2):
    c, params, model = smollm2["config"], smollm2["params"], smollm2["model"]
    L = max(map(len, smollm2["prompts"]))
    toks, mask = _right_pad(smollm2["prompts"], L, c.pad_token_id)
    pos = np.broadcast_to(np.arange(L), toks.shape)
    ours = np.asarray(transformer.logits(params, c, transformer.forward(params, c, jnp.asarray(toks),
                                                                        jnp.asarray(pos), jnp.asarray(mask))))
    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    for i, s in enumerate(smollm2["prompts"]):
        n = len(s)
        err = np.abs(ours[i, :n] - ref[i, :n]).max() / np.abs(ref[i, :n]).max()
        assert err <= 1e-4, f"prompt {i}: max relative logits error {err:.2e}"


@pytest.mark.slow  # the default run checks the logits against transformers (test above); this decodes 32 tokens
def test_smollm2_greedy_32_tokens_match_transformers(smollm2):
    """treejax: greedy loop over the full forward (fixed padded length: one compilation, logits only at each
    row's last token); transformers: an argmax loop over its own KV-cached forward. No EOS stop on either side."""
    c, params, model = smollm2["config"], smollm2["params"], smollm2["model"]
    prompts = smollm2["prompts"][:2]
    L = max(map(len, prompts)) + GREEDY_STEPS

    @jax.jit
    def next_tokens(p, t, seg, last):
        pos = jnp.broadcast_to(jnp.arange(L)[None, :], t.shape)
        h = transformer.forward(p, c, t, pos, seg)
        h_last = jnp.take_along_axis(h, last[:, None, None], axis=1)[:, 0]
        return jnp.argmax(transformer.logits(p, c, h_last), axis=-1)

    seqs = [list(s) for s in prompts]
    for _ in range(GREEDY_STEPS):
        toks, mask = _right_pad(seqs, L, c.pad_token_id)
        nxt = np.asarray(next_tokens(params, jnp.asarray(toks), jnp.asarray(mask),
                                     jnp.asarray([len(s) - 1 for s in seqs])))
        for s, t in zip(seqs, nxt):
            s.append(int(t))
    ours = [s[len(p):] for s, p in zip(seqs, prompts)]
    for i, p in enumerate(prompts):
        theirs, ids, past = [], torch.tensor([p], dtype=torch.long), None
        with torch.no_grad():  # plain argmax loop (generate() would bend EOS logits), KV-cached for speed
            for _ in range(GREEDY_STEPS):
                out = model(ids, past_key_values=past, use_cache=True)
                past, ids = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                theirs.append(int(ids[0, 0]))
        assert ours[i] == theirs, (f"prompt {i}: treejax {smollm2['tok'].decode(ours[i])!r} vs transformers "
                                   f"{smollm2['tok'].decode(theirs)!r}")


@pytest.mark.slow  # a 1.5B model in fp32, treejax's load then transformers' (one at a time: ~8 GB peak, ~3 min)
def test_qwen15_coder_logits_match_transformers_gguf():
    """The offline 1.5B model (``qwen2.5-coder-1.5b-instruct``, assembled from its PyPI part packages): treejax's
    GGUF reader (Q4_K / Q6_K dequantization, Qwen2 biases, untied head) against transformers' own GGUF loading,
    logits on chat prompts in fp32."""
    import gc

    from treejax.models import parts

    try:
        parts.part_paths(parts.PARTED_MODELS["qwen2.5-coder-1.5b-instruct"])
    except Exception as e:  # noqa: BLE001 -- the parts are an optional install
        pytest.skip(f"the 1.5B part packages are not installed: {e}")
    config, params, tok = registry.load_model("qwen2.5-coder-1.5b-instruct", param_dtype="float32")
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_kv_heads) == ("qwen2", 28, 1536, 2)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in PROMPTS[:2]]
    L = max(map(len, prompts))
    toks, mask = _right_pad(prompts, L, config.pad_token_id)
    pos = np.broadcast_to(np.arange(L), toks.shape)
    ours = np.asarray(transformer.logits(params, config, transformer.forward(params, config, jnp.asarray(toks),
                                                                             jnp.asarray(pos), jnp.asarray(mask))))
    del params
    gc.collect()
    path = registry._resolve("qwen2.5-coder-1.5b-instruct")
    folder, fname = os.path.dirname(path), os.path.basename(path)
    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=fname)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as hf_load_gguf

    with torch.device("meta"):  # no second copy of the weights: the dequantized tensors are assigned in place
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tensors = hf_load_gguf(path, return_tensors=True, model_to_load=model)["tensors"]
    result = model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False, assign=True)
    assert not result.missing_keys and not result.unexpected_keys
    del tensors
    model.model.rotary_emb = type(model.model.rotary_emb)(config=hf_config)  # its buffers were on the meta device
    model.eval()
    with torch.no_grad():
        ref = model(torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    for i, s in enumerate(prompts):
        n = len(s)
        err = np.abs(ours[i, :n] - ref[i, :n]).max() / np.abs(ref[i, :n]).max()
        agree = (ours[i, :n].argmax(-1) == ref[i, :n].argmax(-1)).mean()
        print(f"prompt {i}: {n} tokens, max relative logits error {err:.2e}, argmax agreement {agree:.1%}")
        assert err <= 1e-4, f"prompt {i}: max relative logits error {err:.2e}"
        assert agree > 0.99
