"""The sampler's greedy decoding on the real SmolLM2-135M-Instruct (embedded GGUF, fp32) equals transformers'
greedy ``generate`` on the same dequantized weights: 32 new tokens, padded batch of chat prompts.

Precision: fp32 weights and cache (``highest`` matmul precision on a GPU, tests/conftest.py): tokens equal."""

import os

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from treejax.models import registry  # noqa: E402
from treejax.sampling import decode  # noqa: E402
from treejax.sampling.strategies import Greedy  # noqa: E402

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Compute 17 * 23."}],
]


@pytest.mark.slow  # ~115 s on 2 cores; greedy SmolLM2 vs transformers runs by default in tests/models/test_gguf.py
def test_smollm2_sampler_greedy_matches_transformers_generate():
    path = registry.embedded_model_path("smollm2-135m-instruct")
    config, params, tok = registry.load_model("smollm2-135m-instruct", param_dtype="float32")
    folder, fname = os.path.dirname(path), os.path.basename(path)
    hf_config = transformers.AutoConfig.from_pretrained(folder, gguf_file=fname)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as hf_load_gguf

    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    tensors = hf_load_gguf(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    model.eval()
    seqs = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in PROMPTS]
    L = max(map(len, seqs))
    left = np.zeros((len(seqs), L), np.int64)
    mask = np.zeros((len(seqs), L), np.int64)
    for i, s in enumerate(seqs):
        left[i, L - len(s):] = s
        mask[i, L - len(s):] = 1
    with torch.no_grad():
        ref = model.generate(torch.tensor(left), attention_mask=torch.tensor(mask), max_new_tokens=32,
                             do_sample=False, pad_token_id=config.pad_token_id, eos_token_id=None).numpy()[:, L:]
    right, lengths = decode.left_to_right_padded(left, mask)
    fns = decode.make_model_fns(config, block_size=64, cache_dtype="float32")
    out = decode.generate(params, fns, right, lengths, jax.random.key(0), 32, Greedy(), stop_ids=())
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
