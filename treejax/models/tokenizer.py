"""Tokenizer wrapper over Hugging Face ``tokenizers`` with HF-compatible chat templates.

Two sources:
  * an HF folder: ``tokenizer.json`` (+ ``tokenizer_config.json`` for special tokens / chat template,
    ``chat_template.jinja`` as transformers v5 writes it, ``generation_config.json`` for extra EOS ids);
  * GGUF metadata (``tokenizer.ggml.*``): byte-level BPE (``tokenizer.ggml.model == "gpt2"``) rebuilt from
    ``tokens`` / ``merges`` / ``token_type``; tokens of type CONTROL (3) become special added tokens and
    USER_DEFINED (4) plain added tokens, as llama.cpp matches both whole. The pre-tokenizer follows
    ``tokenizer.ggml.pre`` the way llama.cpp does (e.g. ``smollm``: every digit its own piece, then GPT-2's
    byte-level regex — the pre-tokenizer of SmolLM2's own ``tokenizer.json``).

Chat templates render with the same Jinja environment as ``transformers`` (sandboxed, ``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, a non-HTML-escaping ``tojson``, ``raise_exception``, ``strftime_now``)
and the special-token strings (``bos_token``, ``eos_token``, ...) in the context.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from treejax.errors import ModelFileError

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Chat-turn terminators: when the chat template closes turns with one of these, generation stops on it.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_pre_tokenizer(pre: str | None, source: str):
    """llama.cpp's ``tokenizer.ggml.pre`` -> an equivalent ``tokenizers`` pre-tokenizer."""
    if pre in (None, "default", "gpt2", "gpt-2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    split = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
             "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"{source}: unsupported tokenizer.ggml.pre={pre!r} (known: default, gpt2, smollm, "
                         "starcoder, llama-bpe, llama3, qwen2, deepseek-r1-qwen)")
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _token_content(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return value.get("content")


def _compile_template(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(template)


class TextTokenizer:
    """Encode/decode, special ids and chat-template rendering around a ``tokenizers.Tokenizer``."""

    def __init__(self, tokenizer: Tokenizer, special_tokens: dict[str, str | None], chat_template: str | None = None,
                 add_bos_token: bool = False, extra_eos_ids: Sequence[int] = (), source: str | None = None):
        self._tok = tokenizer
        self.source = source  #: the folder or file it was read from (for error messages), if known
        self.special_tokens = {k: special_tokens.get(k) for k in _SPECIAL_NAMES}
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._extra_eos = tuple(int(i) for i in extra_eos_ids)
        self._template = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_folder(cls, folder: str) -> "TextTokenizer":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ModelFileError(f"missing file {path} (only fast tokenizers / tokenizer.json are supported)")
        from treejax.models.hf_checkpoint import CheckpointError  # a user's broken file: one line in the CLIs

        try:
            tok = Tokenizer.from_file(path)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot parse tokenizer ({e}); the folder needs the tokenizer.json "
                                  "that transformers' save_pretrained writes") from None
        cfg = {}
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path) as f:
                    cfg = json.load(f)
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from None
        stm_path = os.path.join(folder, "special_tokens_map.json")
        specials = {}
        if os.path.isfile(stm_path):
            with open(stm_path) as f:
                specials = {k: _token_content(v) for k, v in json.load(f).items() if k in _SPECIAL_NAMES}
        specials.update({k: _token_content(cfg[k]) for k in _SPECIAL_NAMES if cfg.get(k) is not None})
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        jinja_path = os.path.join(folder, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path) as f:
                template = f.read()
        extra_eos = []
        gen_path = os.path.join(folder, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            extra_eos = [] if eos is None else (eos if isinstance(eos, list) else [eos])
        return cls(tok, specials, template, bool(cfg.get("add_bos_token", False)), extra_eos, source=folder)

    @classmethod
    def from_gguf(cls, reader_or_path) -> "TextTokenizer":
        """Rebuilds the tokenizer embedded in a GGUF file (``reader_or_path``: path or ``GGUFReader``)."""
        from treejax.models.gguf_checkpoint import field_value, open_gguf

        reader = open_gguf(reader_or_path) if isinstance(reader_or_path, str) else reader_or_path
        source = reader_or_path if isinstance(reader_or_path, str) else "GGUF"
        kind = field_value(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"{source}: unsupported tokenizer.ggml.model={kind!r} (only byte-level BPE 'gpt2')")
        tokens = field_value(reader, "tokenizer.ggml.tokens")
        merges = field_value(reader, "tokenizer.ggml.merges")
        if not tokens or merges is None:
            raise ValueError(f"{source}: tokenizer.ggml.tokens / tokenizer.ggml.merges missing")
        types = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
        bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ", 1)) for m in merges],
                         fuse_unk=False, byte_fallback=False)
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = _byte_level_pre_tokenizer(field_value(reader, "tokenizer.ggml.pre"), source)
        tok.decoder = decoders.ByteLevel()
        byte_alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        # CONTROL tokens spelled outside the byte alphabet are llama.cpp mislabels (not matchable text).
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                                if ty == 3 and set(t) <= byte_alphabet])
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types) if ty == 4])

        def token(key):
            i = field_value(reader, f"tokenizer.ggml.{key}")
            return None if i is None else tokens[int(i)]

        specials = {"bos_token": token("bos_token_id"), "eos_token": token("eos_token_id"),
                    "unk_token": token("unknown_token_id"), "pad_token": token("padding_token_id")}
        add_bos = bool(field_value(reader, "tokenizer.ggml.add_bos_token", False))
        if add_bos and specials["bos_token"] is not None:
            b = specials["bos_token"]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, tok.token_to_id(b))])
        return cls(tok, specials, field_value(reader, "tokenizer.chat_template"), add_bos,
                   source=reader_or_path if isinstance(reader_or_path, str) else None)

    # ------------------------------------------------------------------ ids
    def _id(self, name: str) -> int | None:
        t = self.special_tokens.get(name)
        return None if t is None else self._tok.token_to_id(t)

    @property
    def bos_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def pad_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """EOS id, then ids from ``generation_config.json``, then the chat template's turn terminator."""
        ids = [self._id("eos_token"), *self._extra_eos]
        for t in _TURN_END_TOKENS:
            if self.chat_template and t in self.chat_template:
                ids.append(self._tok.token_to_id(t))
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def vocab_size(self) -> int:
        """True vocabulary size (max id + 1, added tokens included); model embeddings may be padded beyond it."""
        return max(self._tok.get_vocab(with_added_tokens=True).values()) + 1

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return self._tok.decode_batch([[int(i) for i in ids] for ids in batch],
                                      skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs) -> str | list[int]:
        """Renders ``messages`` with the chat template (transformers' semantics); ``tokenize=True`` returns
        ids encoded without adding special tokens (the template writes them itself)."""
        if not self.chat_template:
            from treejax.errors import ConfigError

            where = f" of {self.source}" if self.source else ""
            raise ConfigError(f"the tokenizer{where} has no chat template, and treejax formats every prompt with one: "
                              "give a model whose folder has tokenizer_config.json with a chat_template (or "
                              "chat_template.jinja), as transformers' save_pretrained writes for chat models")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        context = {k: v for k, v in self.special_tokens.items() if v is not None}
        context.update(kwargs)
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     tools=context.pop("tools", None), documents=context.pop("documents", None),
                                     **context)
        return self.encode(text) if tokenize else text

    # ------------------------------------------------------------------ save
    def save_pretrained(self, folder: str) -> None:
        """Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
        (loadable by ``transformers.AutoTokenizer`` and :meth:`from_hf_folder`)."""
        os.makedirs(folder, exist_ok=True)
        self._tok.save(os.path.join(folder, "tokenizer.json"))
        added = {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                          "single_word": t.single_word, "special": t.special}
                 for i, t in sorted(self._tok.get_added_tokens_decoder().items())}
        specials = {k: v for k, v in self.special_tokens.items() if v is not None}
        cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos_token,
               "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": 10 ** 30,
               "added_tokens_decoder": added, **specials}
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=2, ensure_ascii=False)
        with open(os.path.join(folder, "special_tokens_map.json"), "w") as f:
            json.dump(specials, f, indent=2, ensure_ascii=False)
