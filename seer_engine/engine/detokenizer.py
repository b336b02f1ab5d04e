"""Text <-> tokens for one engine: prompts, outputs, stop strings, logprob tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from seer_engine.model_executor.model_config import ModelLoadError
from seer_engine.outputs import Logprob, SampleLogprobs


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._piece_cache: dict[int, str] = {}

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

    def vocab(self) -> dict[str, int]:
        """Token string -> id (what tells one tokenizer's ids from another's)."""
        return self.tokenizer.get_vocab()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str:
        text = self._piece_cache.get(token_id)
        if text is None:
            text = self._piece_cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def find_stop_string(self, output_ids: Sequence[int], stops: Sequence[str]) -> str | None:
        """A stop string in the tail of the output (checked every step, so new matches only).

        Only a window of trailing tokens is decoded, which keeps the check cheap on long
        outputs; the window is wide enough for the longest stop string.
        """
        window = 2 * max(len(s) for s in stops) + 8
        tail = self.decode(output_ids[-window:], skip_special_tokens=False)
        hits = [(tail.find(s), s) for s in stops if s in tail]
        return min(hits)[1] if hits else None

    def logprobs_to_output(
        self, logprobs: list[dict[int, tuple[float, int]]] | None
    ) -> SampleLogprobs | None:
        if logprobs is None:
            return None
        return [
            {tid: Logprob(lp, rank, self.piece(tid)) for tid, (lp, rank) in step.items()} for step in logprobs
        ]
