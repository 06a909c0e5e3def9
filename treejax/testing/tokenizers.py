"""A tokenizer for tests of text-level logic (stop strings, observations) with a tiny-vocabulary model."""

from __future__ import annotations


class CharTokenizer:
    """Token id ``i`` <-> the character ``chr(48 + i)`` (``'0'``, ``'1'``, ..., ``'n'``), and id ``eos`` (default 63)
    is the end-of-turn token ``"<e>"`` (dropped with ``skip_special_tokens``). Ids must lie in ``[0, 64)``."""

    def __init__(self, eos: int = 63):
        self.eos = eos

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(("" if skip_special_tokens else "<e>") if i == self.eos else chr(48 + i) for i in ids)

    def encode(self, text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith("<e>", i):
                out.append(self.eos)
                i += 3
            else:
                out.append(ord(text[i]) - 48)
                i += 1
        if any(not 0 <= t < 64 for t in out):
            raise ValueError(f"CharTokenizer: {text!r} has characters outside chr(48)..chr(111)")
        return out
