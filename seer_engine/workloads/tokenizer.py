"""The trace tokenizer: ``tokenizers`` plus an exact fast path for byte-level BPE.

Why the fast path stays beside ``tokenizers``: loading and tokenizing the whole
``qwen3-8b-mcq-cot.jsonl.gz`` (4,485 responses, 7,259,663 tokens, the same ids either
way) takes 10.3-12.5 s with ``Tokenizer.encode_batch`` alone and 2.3-2.4 s with the fast
path (4-5x; 2-core x86_64 CPU machine shared with other jobs; ``encode_batch`` on all
responses in one call: 9.6-10.7 s). ``tokenizers`` spends most of that time in its
Oniguruma regex pre-tokenizer, and whole-trace loads (tests, ``trace-stats``, the
acceptance fit) would pay the difference each time. Command (repo root, FAST = True
or False; False sends every text to ``encode_batch``)::

    python -c "import time; from seer_engine.workloads.tokenizer import get_tokenizer; \
    from seer_engine.workloads.traces import load_trace, tokenize_groups; \
    t = time.perf_counter(); tok = get_tokenizer(); tok.fast = FAST; \
    tokenize_groups(load_trace('qwen3-8b-mcq-cot.jsonl.gz', tok)); print(time.perf_counter() - t)"
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from functools import lru_cache
from itertools import chain
from pathlib import Path

from seer_engine.workloads.paths import default_tokenizer_path


def _byte_level_alphabet() -> list[str]:
    """Byte -> printable character map used by byte-level BPE (the GPT-2 convention)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


# The byte-level pre-tokenizer's regex (contractions, letters, digits, other symbols,
# whitespace runs) with its Unicode classes spelled out for ASCII plus the non-ASCII
# characters of the text at hand. Python's ``re`` runs it several times faster than
# tokenizers' Oniguruma runs the \p{L}/\p{N} original, and splits identically.
_ASCII_WS = "\t\n\x0b\x0c\r "
_UNICODE_WS = frozenset("\x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | frozenset(
    chr(c) for c in range(0x2000, 0x200B)
)
# ASCII separators whose whitespace class differs between regex flavours: texts
# containing them take the reference path.
_AMBIGUOUS_WS = re.compile("[\x1c-\x1f]")


@lru_cache(maxsize=4096)
def _pretoken_pattern(extra: frozenset[str]) -> re.Pattern[str]:
    """The pre-tokenizer regex, exact for ASCII plus the characters in ``extra``."""
    import unicodedata

    def cls(chars: Iterable[str]) -> str:
        return "".join(re.escape(c) for c in sorted(chars))

    letters = "A-Za-z" + cls(c for c in extra if unicodedata.category(c).startswith("L"))
    digits = "0-9" + cls(c for c in extra if unicodedata.category(c).startswith("N"))
    ws = re.escape(_ASCII_WS) + cls(extra & _UNICODE_WS)
    return re.compile(
        rf"'s|'t|'re|'ve|'m|'ll|'d| ?[{letters}]+| ?[{digits}]+| ?[^{ws}{letters}{digits}]+"
        rf"|[{ws}]+(?![^{ws}])|[{ws}]+"
    )


class TraceTokenizer:
    """The trace tokenizer with a fast exact path for byte-level BPE (what the traces use).

    It splits with an equivalent Python regex and BPE-encodes each distinct piece
    once (pieces repeat heavily): the same ids about 4.5x faster than
    ``tokenizers`` (figures in the module docstring). Trust is earned, not assumed:
    the first few texts, and the first text containing each new non-ASCII character, are compared with
    ``tokenizers``; a difference routes those texts (or everything, for ASCII) to
    ``tokenizers``, as are special-token text and other tokenizer types.
    """

    _SPOT_CHECKS = 4

    def __init__(self, path: str | os.PathLike) -> None:
        from seer_engine.model_executor.tiny_model import read_tokenizer_file

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"trace tokenizer not found: {self.path}")
        self.tokenizer = read_tokenizer_file(self.path)
        self.vocab_size: int = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._specials = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        self._pieces: dict[str, tuple[int, ...]] = {}
        self._alphabet = _byte_level_alphabet()
        self._spot_checks_left = self._SPOT_CHECKS
        self._verified: set[str] = set()
        self._refused: set[str] = set()
        self.fast = self._fast_path_applies()

    def _fast_path_applies(self) -> bool:
        """Only a plain byte-level BPE (no normalizer, regex pre-tokenizer) splits like our regex."""
        cfg = json.loads(self.tokenizer.to_str())
        model = cfg.get("model") or {}
        pre = cfg.get("pre_tokenizer") or {}
        return (
            model.get("type") == "BPE"
            and not model.get("dropout")
            and not model.get("continuing_subword_prefix")
            and not model.get("end_of_word_suffix")
            and cfg.get("normalizer") is None
            and pre.get("type") == "ByteLevel"
            and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)
        )

    def _reference(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def _encode_fast(self, text: str, pattern: re.Pattern[str]) -> list[int]:
        """Split with ``pattern``; BPE-encode only pieces not seen before."""
        pieces = pattern.findall(text)
        cache = self._pieces
        try:
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))
        except KeyError:
            model, alphabet = self.tokenizer.model, self._alphabet
            for piece in pieces:
                if piece not in cache:
                    mapped = "".join(alphabet[b] for b in piece.encode("utf-8"))
                    cache[piece] = tuple(t.id for t in model.tokenize(mapped))
            return list(chain.from_iterable(map(cache.__getitem__, pieces)))

    def _try_fast(self, text: str) -> list[int] | None:
        """Ids by the fast path, or None when the text must go to ``tokenizers``."""
        if not self.fast or _AMBIGUOUS_WS.search(text) or any(s in text for s in self._specials):
            return None
        extra = frozenset() if text.isascii() else frozenset(c for c in set(text) if ord(c) > 127)
        if extra & self._refused:
            return None
        ids = self._encode_fast(text, _pretoken_pattern(extra))
        unverified = extra - self._verified
        if self._spot_checks_left > 0 or unverified:
            self._spot_checks_left = max(0, self._spot_checks_left - 1)
            ref = self._reference(text)
            if ids != ref:
                if not unverified:
                    warnings.warn(
                        f"fast tokenization differs from tokenizers for {self.path.name}; "
                        "using tokenizers only",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    self.fast = False
                self._refused |= unverified
                return ref
            self._verified |= unverified
        return ids

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return self.encode_many([text])[0]

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; identical to ``Tokenizer.encode_batch(texts)``."""
        out: list[list[int] | None] = [self._try_fast(text) for text in texts]
        slow = [i for i, ids in enumerate(out) if ids is None]
        if slow:
            encoded = self.tokenizer.encode_batch([texts[i] for i in slow], add_special_tokens=False)
            for i, enc in zip(slow, encoded):
                out[i] = enc.ids
        return out  # type: ignore[return-value]


_TOKENIZERS: dict[Path, TraceTokenizer] = {}


def get_tokenizer(path: str | os.PathLike | None = None) -> TraceTokenizer:
    """One shared :class:`TraceTokenizer` per file, so its piece cache is reused."""
    resolved = Path(path or default_tokenizer_path()).resolve()
    tok = _TOKENIZERS.get(resolved)
    if tok is None:
        tok = _TOKENIZERS[resolved] = TraceTokenizer(resolved)
    return tok
