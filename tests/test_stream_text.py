"""A streamed sample's text decoded a few tokens at a step (engine/stream_text.py)
equals the whole decode at every step, on a byte-level BPE and on a SentencePiece-style
tokenizer with byte fallback, and costs each step the new tokens, not the output."""

from __future__ import annotations

import random

import pytest

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.detokenizer import Detokenizer
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.engine.stream_text import StreamText
from seer_engine.sampling_params import SamplingParams


def _sentencepiece_style() -> Detokenizer:
    """A Llama-like tokenizer: "▁" for spaces, <0xNN> byte pieces, a decoder that drops
    the first token's leading space."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    pieces += ["▁", "▁the", "▁a", "a", "b", ".", ",", "▁.", "é", "中", "文", "▁x", "y", "\n"]
    tok = Tokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True, unk_token="<unk>")
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    return Detokenizer(fast)


@pytest.fixture(scope="module")
def byte_level(tiny_model) -> Detokenizer:
    return Detokenizer.from_pretrained(tiny_model("qwen3"))


def _random_outputs(detok: Detokenizer, rng: random.Random, count: int, length: int) -> list[list[int]]:
    """Token sequences rich in what breaks decoding in pieces: specials, lone bytes of
    multi-byte characters, spaces."""
    vocab = len(detok.tokenizer)
    specials = sorted(set(detok.tokenizer.all_special_ids))
    partial = [t for t in range(vocab) if "\ufffd" in detok.piece(t)]
    out = []
    for _ in range(count):
        seq = []
        for _ in range(length):
            r = rng.random()
            pool = specials if r < 0.1 else partial if r < 0.4 and partial else range(vocab)
            seq.append(rng.choice(pool))
        out.append(seq)
    return out


@pytest.mark.parametrize("tokenizer", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_is_the_whole_decode_at_every_step(request, tokenizer, skip_special_tokens):
    detok = request.getfixturevalue("byte_level") if tokenizer == "byte_level" else _sentencepiece_style()
    assert detok.decodes_in_pieces
    rng = random.Random(7)
    settled_somewhere = False
    for seq in _random_outputs(detok, rng, count=40, length=60):
        lead = detok.text_lead(_random_outputs(detok, rng, 1, 4)[0])
        stream = StreamText(detok, lead, skip_special_tokens)
        n = 0
        while n < len(seq):
            n += rng.choice([1, 1, 1, 2, 3])  # a step adds one token, or several (speculation)
            want = detok.output_text(lead, seq[:n], skip_special_tokens)
            assert stream.text(seq[:n]) == want, (seq[:n], lead)
        settled_somewhere |= stream.settled_tokens > 8
    assert settled_somewhere  # the pieces path ran, not only whole decodes
    assert detok.decodes_in_pieces  # no check found a difference


class _CountingDetokenizer(Detokenizer):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.decoded_tokens = 0

    def decode(self, token_ids, skip_special_tokens=True):
        self.decoded_tokens += len(token_ids)
        return super().decode(token_ids, skip_special_tokens)


def test_a_streamed_sample_decodes_about_each_token_a_bounded_number_of_times(tiny_model):
    """A 400-token stream through the engine: every step's text equals the whole decode,
    and the tokens decoded in all grow with the output, not with its square."""
    model = tiny_model("qwen3")
    engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=64))
    detok = _CountingDetokenizer(engine.outputs.detokenizer.tokenizer)
    engine.outputs.detokenizer = detok
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=400, ignore_eos=True)
    engine.add_request("r", list(range(10, 30)), params, stream=True)
    texts: list[tuple[list[int], str]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append((list(out.outputs[0].token_ids), out.outputs[0].text))
    assert len(texts) == 400
    decoded_by_stream = detok.decoded_tokens
    for ids, text in texts:
        assert text == Detokenizer.output_text(detok, [], ids)
    assert decoded_by_stream < 40 * 400  # whole decodes at every step: 400 * 401 / 2 = 80,200


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_whole(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model("qwen3")), clean_up_tokenization_spaces=True)
    detok = Detokenizer(tok)
    assert not detok.decodes_in_pieces
    ids = detok.encode("a , b . c ? d ! e 's")
    stream = StreamText(detok, [], True)
    assert [stream.text(ids[:n]) for n in range(1, len(ids) + 1)] == [
        detok.decode(ids[:n]) for n in range(1, len(ids) + 1)
    ]


class _NonLocal(Detokenizer):
    """Text that depends on the whole output: upper case from 12 tokens on."""

    def decode(self, token_ids, skip_special_tokens=True):
        text = super().decode(token_ids, skip_special_tokens)
        return text.upper() if len(token_ids) >= 12 else text


def test_a_tokenizer_whose_pieces_differ_is_caught_and_decoded_whole(byte_level):
    detok = _NonLocal(byte_level.tokenizer)
    ids = detok.encode("hello world, this is a test of a stream of text " * 4)
    stream = StreamText(detok, [], True)
    texts = [stream.text(ids[:n]) for n in range(1, len(ids) + 1)]
    assert not detok.decodes_in_pieces  # the check at 16 tokens saw the difference
    assert texts[15:] == [detok.decode(ids[:n]) for n in range(16, len(ids) + 1)]
