"""The growing text of one streamed sample, decoded a few tokens at a step.

Decoding the whole output at every step costs a streamed sample time in proportion to
its length, at every step. ``StreamText`` keeps the text of the output up to a settled
token and decodes only the tokens after it, with a few settled ones before them as
context: a SentencePiece decoder drops the first token's leading space, and a
character's first bytes may lie in the tokens before. What the new tokens add to the
context's own text is appended, as vLLM's incremental detokenizer does. A token is
settled only once the text up to it ends in a whole character and not in a run of
byte-fallback pieces, whose text a later byte may still change.

Whether text decoded in pieces equals the whole decode depends on the tokenizer; every
time the output doubles in length the text is checked against the whole decode, and a
``Detokenizer`` whose pieces ever differ decodes whole from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from seer_engine.engine.detokenizer import Detokenizer

logger = logging.getLogger(__name__)

CONTEXT_TOKENS = 4  # settled tokens decoded again before the new ones
MAX_CONTEXT_TOKENS = 64  # more that show no text (skipped special tokens): decode whole
FIRST_CHECK = 16  # output length of the first check against the whole decode


class StreamText:
    def __init__(self, detokenizer: Detokenizer, lead: Sequence[int], skip_special_tokens: bool) -> None:
        """``lead``: the prompt's ``text_lead`` (``Detokenizer.text_lead``)."""
        self.detokenizer = detokenizer
        self.lead = list(lead)
        self.skip_special_tokens = skip_special_tokens
        self.settled_tokens = 0
        self.settled_text = ""
        self.next_check = FIRST_CHECK

    def text(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, the sample's output so far (it only grows)."""
        detok = self.detokenizer
        if (
            not detok.decodes_in_pieces
            or self.settled_tokens <= CONTEXT_TOKENS
            or len(ids) < self.settled_tokens
        ):
            return self._settle(ids, self._whole(ids))
        start, context = self.settled_tokens, ""
        while not context and start > 0 and self.settled_tokens - start < MAX_CONTEXT_TOKENS:
            # Context with text of its own: a decoder drops the leading space of the
            # first token that shows, which must not be a new one.
            start = max(0, start - CONTEXT_TOKENS)
            context = detok.decode(ids[start : self.settled_tokens], self.skip_special_tokens)
        piece = detok.decode(ids[start:], self.skip_special_tokens)
        if not context or not piece.startswith(context):
            return self._settle(ids, self._whole(ids))
        text = self.settled_text + piece[len(context) :]
        if len(ids) >= self.next_check:
            self.next_check = 2 * len(ids)
            whole = self._whole(ids)
            if whole != text:
                detok.decodes_in_pieces = False
                logger.warning("this tokenizer's text decoded in pieces differs from its whole decode; "
                               "streamed samples are decoded whole from now on")  # fmt: skip
                return self._settle(ids, whole)
        return self._settle(ids, text)

    def _whole(self, ids: Sequence[int]) -> str:
        return self.detokenizer.output_text(self.lead, ids, self.skip_special_tokens)

    def _settle(self, ids: Sequence[int], text: str) -> str:
        if not text.endswith("\ufffd") and not self.detokenizer.ends_in_byte_piece(
            ids, self.skip_special_tokens
        ):
            self.settled_tokens, self.settled_text = len(ids), text
        return text
