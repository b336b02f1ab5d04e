"""Text <-> tokens for one engine: prompts, outputs, stop strings, logprob tokens."""

from __future__ import annotations

import functools
import inspect
import os
import re
from collections.abc import Sequence
from pathlib import Path

from seer_engine.model_executor.model_config import ModelLoadError
from seer_engine.outputs import Logprob, SampleLogprobs
from seer_engine.sampling_params import InvalidRequestError


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._piece_cache: dict[int, str] = {}
        self._byte_pieces: dict[int, bool] = {}
        # Whether streamed text may be decoded a few tokens at a step (``StreamText``):
        # cleaning up spaces before punctuation joins text across any split.
        self.decodes_in_pieces = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Detokenizer:
        from transformers import AutoTokenizer

        path = Path(path)
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise ModelLoadError(f"no tokenizer (tokenizer.json / tokenizer_config.json) in {path}")
        try:
            return cls(AutoTokenizer.from_pretrained(str(path)))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot load the tokenizer in {path}: {e}") from e
        except Exception as e:  # noqa: BLE001 - transformers validates config.json here too
            # and refuses it with a KeyError, TypeError or huggingface_hub's StrictDataclassError.
            raise ModelLoadError(f"transformers refuses the model folder {path}: {e}") from e

    def vocab(self) -> dict[str, int]:
        """Token string -> id (what tells one tokenizer's ids from another's)."""
        return self.tokenizer.get_vocab()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each token as the vocabulary spells it (byte-level marks included)."""
        return [str(t) for t in self.tokenizer.convert_ids_to_tokens(list(token_ids))]

    def piece(self, token_id: int) -> str:
        text = self._piece_cache.get(token_id)
        if text is None:
            text = self._piece_cache[token_id] = self.tokenizer.decode([token_id])
        return text

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(self.tokenizer.all_special_ids)

    def ends_in_byte_piece(self, ids: Sequence[int], skip_special_tokens: bool) -> bool:
        """Whether the last token that shows is a byte-fallback piece (``<0xNN>``): a
        decoder joins a run of them into characters, or, if the run's bytes are not
        UTF-8, turns each into U+FFFD, so a later byte may change the run's text."""
        for tid in reversed(ids):
            if skip_special_tokens and tid in self._special_ids:
                continue
            byte = self._byte_pieces.get(tid)
            if byte is None:
                byte = self._byte_pieces[tid] = bool(_BYTE_PIECE.fullmatch(self.token_strings([tid])[0]))
            return byte
        return False

    def text_lead(self, prompt_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens that may hold the start of a character its output
        finishes (pieces holding U+FFFD); none for a prompt that ends a character."""
        lead: list[int] = []
        for tid in reversed(prompt_ids[-_MAX_LEAD:]):
            if "\ufffd" not in self.piece(tid):
                break
            lead.append(tid)
        return lead[::-1]

    def output_text(self, lead: Sequence[int], ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of output tokens after the prompt's ``text_lead``, as vLLM's detokenizer
        continuing from the prompt gives it: a character the prompt began and the output
        finished is the output's; the prompt's own whole characters are not."""
        if not lead:
            return self.decode(ids, skip_special_tokens)
        head = self.decode(lead, skip_special_tokens).rstrip("\ufffd")
        text = self.decode([*lead, *ids], skip_special_tokens)
        return text[len(head) :] if text.startswith(head) else self.decode(ids, skip_special_tokens)

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The token's own bytes (``text``: its decoded piece). A token that holds part of
        a character decodes to U+FFFD alone; its bytes come from its vocabulary spelling
        (a byte-level alphabet, or a ``<0xNN>`` byte-fallback piece), so that the bytes of
        consecutive tokens join into the text, as OpenAI's logprobs ``bytes`` promise."""
        if "\ufffd" not in text:
            return text.encode("utf-8")
        spelled = str(self.tokenizer.convert_ids_to_tokens(token_id))
        if _BYTE_PIECE.fullmatch(spelled):
            return bytes([int(spelled[3:5], 16)])
        if all(c in _BYTE_LEVEL for c in spelled):
            return bytes(_BYTE_LEVEL[c] for c in spelled)
        return text.encode("utf-8")

    @functools.cached_property
    def chat_template_arguments(self) -> frozenset[str]:
        """Names a template variable may not take: ``apply_chat_template``'s own
        parameters (read from the tokenizer in use), and ``messages``, which it renders."""
        params = inspect.signature(self.tokenizer.apply_chat_template).parameters.values()
        named = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        return frozenset(named | {"messages"})

    def check_template_kwargs(self, template_kwargs: dict) -> None:
        """Template variables may not pass for ``apply_chat_template``'s own arguments."""
        reserved = sorted(set(template_kwargs) & self.chat_template_arguments)
        if reserved:
            message = f"chat_template_kwargs may not set {', '.join(reserved)}"
            raise InvalidRequestError(message, param="chat_template_kwargs")

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
    ) -> str:
        """The conversation as text; ``template_kwargs`` are variables the template reads
        (e.g. Qwen3's ``enable_thinking``); ``tools``: OpenAI tool definitions it renders;
        ``documents``: vLLM's retrieval documents, for templates that render them (Command-R, Granite)."""
        self.check_template_kwargs(template_kwargs or {})
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **(template_kwargs or {}),
        )

    def find_stop_string(
        self,
        output_ids: Sequence[int],
        stops: Sequence[str],
        skip_special_tokens: bool = True,
        lead: Sequence[int] = (),
    ) -> str | None:
        """A stop string that the last output token completed.

        Only a match ending in the last token's text counts: an earlier one (made before
        min_tokens allowed stopping) must not stop the output later, as in vLLM. Stops are
        found in the output's text as the response shows it: with ``skip_special_tokens``
        a special token's text is not there, so it completes no stop string (vLLM's rule).
        Only a window of trailing tokens is decoded, which keeps the check cheap on long
        outputs; the window is wide enough for the longest stop string, counted in UTF-8
        bytes since a byte-level tokenizer may spend a token on every byte. ``lead``: the
        prompt's ``text_lead``, which counts while the window holds the whole output.
        """
        window = 2 * max(len(s.encode("utf-8", "surrogatepass")) for s in stops) + 8
        tail = output_ids[-window:]
        lead = lead if len(tail) == len(output_ids) else ()
        before = self.output_text(lead, tail[:-1], skip_special_tokens)
        hit = new_stop_match(before, self.output_text(lead, tail, skip_special_tokens), stops)
        return hit[1] if hit else None

    def logprobs_to_output(
        self, logprobs: list[dict[int, tuple[float, int]]] | None
    ) -> SampleLogprobs | None:
        if logprobs is None:
            return None
        return [
            {tid: Logprob(lp, rank, self.piece(tid)) for tid, (lp, rank) in step.items()} for step in logprobs
        ]


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (character -> byte): printable Latin-1 bytes stand
    for themselves, the others for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


_BYTE_LEVEL = _byte_level_alphabet()
_MAX_LEAD = 8  # prompt tokens looked at for a character the output may finish
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def new_stop_match(before: str, text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the first stop string in ``text`` that ends in what the
    last token added to ``before`` (the text without it), or None. Of stop strings that
    start at the same place, the first in the request's list (vLLM's order).

    Where the texts differ is found by their common prefix: a last token that completes
    a multi-byte character also changes the replacement character ``before`` ends with.
    Text ending in U+FFFD may be a character still being written, so, as in vLLM's
    incremental detokenizer, that end is left out until text follows it.
    """
    before, shown = before.rstrip("\ufffd"), text.rstrip("\ufffd")
    common = len(os.path.commonprefix([before, shown]))
    hits = [(i, s) for s in stops if (i := shown.find(s, max(0, common - len(s) + 1))) >= 0]
    return min(hits, key=lambda hit: hit[0]) if hits else None
