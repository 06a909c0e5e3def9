"""Test set-up: 8 fake CPU devices for sharding tests, strict rank promotion, slow/gpu markers."""

import os

# Must happen before jax initialises its backends.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
    """GPU-only tests are skipped where no GPU is present."""
    has_gpu = any(d.platform == "gpu" for d in jax.devices()) if os.environ.get("JAX_PLATFORMS") != "cpu" else False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random Llama with SmolLM2's real tokenizer, exported as an HF folder (for runs of the whole loop)."""
    from treejax.models import presets, transformer
    from treejax.models.export import export_hf
    from treejax.models.registry import embedded_model_path
    from treejax.models.tokenizer import TextTokenizer

    tok = TextTokenizer.from_gguf(embedded_model_path("smollm2-135m-instruct"))
    cfg = presets.tiny_config("smollm2-135m", vocab_size=49152, eos_token_ids=tuple(tok.eos_ids), pad_token_id=2)
    params = transformer.init_params(cfg, jax.random.key(0))
    folder = str(tmp_path_factory.mktemp("tiny_hf"))
    export_hf(params, cfg, folder, tok)
    return folder
