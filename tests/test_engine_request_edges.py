"""Engine request edges: stop strings after min_tokens and at max_tokens, long multi-byte stop strings,
clashing sample ids, infinite temperatures, requests to a sleeping engine, a weight update from
an empty path, KV computed over stale KV after a weight update, a partial character's token bytes."""

from __future__ import annotations

import pytest

from seer_engine import LLM, InvalidRequestError, SamplingParams
from seer_engine.engine.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(str(tiny_model("qwen3")), max_num_batched_tokens=256)


def test_a_stop_string_before_min_tokens_does_not_stop_the_output_later(llm):
    prompt = list(range(50, 70))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    texts = [llm.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    min_tokens = 10
    early = texts[min_tokens]  # stop strings completed here do not count: up to min_tokens
    # A one-character stop string seen up to min_tokens and again after it.
    stop = next(c for c in early if c.isalnum() and c in texts[-1][len(early) :])
    at = texts[-1].index(stop, len(early))
    length = next(i for i in range(min_tokens + 1, len(texts)) if len(texts[i]) > at)

    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=40, min_tokens=min_tokens, stop=[stop], ignore_eos=True),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == tokens[:length]
    assert out.text == texts[-1][:at]


def test_a_stop_string_completed_by_the_min_tokens_th_token_does_not_stop(llm):
    """As vLLM: stop strings count once the output has more than min_tokens tokens, as
    EOS and stop token ids, banned up to the min_tokens-th token, do."""
    prompt = list(range(50, 70))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    texts = [llm.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    added = [texts[i][len(texts[i - 1]) :] if i else "" for i in range(len(texts))]
    k = next(i for i in range(1, len(tokens)) if added[i].strip() and "\ufffd" not in texts[i])
    stop = added[k]
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=40, min_tokens=k, stop=[stop], ignore_eos=True)
    )[0].outputs[0]
    later = texts[-1].find(stop, len(texts[k]))
    if later < 0:
        assert out.token_ids == tokens and out.finish_reason == "length"
    else:
        assert out.stop_reason == stop and out.text == texts[-1][:later]


def test_a_request_whose_sample_id_is_in_use_is_refused_and_changes_nothing(llm):
    engine = llm.engine
    prompt = list(range(10, 20))
    engine.add_request("x", prompt, SamplingParams(n=2, max_tokens=4, seed=1))
    engine.add_request("y-1", prompt, SamplingParams(max_tokens=4, seed=2))
    with pytest.raises(InvalidRequestError, match="'x-0'"):
        engine.add_request("x-0", prompt, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="'y-1'"):
        engine.add_request("y", prompt, SamplingParams(n=2, max_tokens=4))
    outs = []
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        outs.extend(engine.step())
    assert not engine.has_unfinished_requests()
    assert sorted((o.request_id, len(o.outputs)) for o in outs) == [("x", 2), ("y-1", 1)]
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_an_infinite_temperature_is_refused():
    # With min_tokens, inf turned banned logits into NaNs and the row silently went greedy.
    with pytest.raises(InvalidRequestError, match="temperature"):
        SamplingParams(temperature=float("inf"))


def test_a_seed_outside_64_bits_is_refused_not_folded_onto_another():
    for seed in (2**63, 2**64 + 5, -(2**63) - 1):
        with pytest.raises(InvalidRequestError, match="seed must be a 64-bit signed integer"):
            SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_a_sleeping_engine_refuses_requests_until_it_wakes(tiny_model):
    llm = LLM(str(tiny_model("qwen3")), max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    awake = llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids
    llm.engine.sleep()
    with pytest.raises(InvalidRequestError, match="wake_up"):
        llm.generate([[5, 6, 7]], params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.wake_up()
    assert llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids == awake


def test_a_stop_string_of_many_multibyte_characters_is_found(llm):
    # The tiny BPE spends a token per byte here: 30 tokens for 10 characters.
    detok = llm.engine.detokenizer
    stop = "日本語のテキストです"
    output = detok.encode("abc ") + detok.encode(stop)
    assert len(output) > 2 * len(stop) + 8
    assert detok.find_stop_string(output, [stop]) == stop
    assert detok.find_stop_string(output[:-1], [stop]) is None


def test_stop_strings_starting_at_one_place_go_by_the_requests_order():
    """The earliest match wins; of matches that start at one place, the stop string first
    in the request's list (vLLM's order), whatever their length or spelling."""
    from seer_engine.engine.detokenizer import new_stop_match

    assert new_stop_match("x", "xabc", ["abc", "ab"]) == (1, "abc")
    assert new_stop_match("x", "xabc", ["ab", "abc"]) == (1, "ab")
    assert new_stop_match("x", "xabc", ["c", "zz", "b"]) == (2, "b")


def test_a_partial_characters_replacement_mark_completes_no_stop_string(llm):
    """As vLLM's incremental detokenizer: text ending in U+FFFD waits for the tokens that
    may complete its character, so a stop string with U+FFFD matches only a mark that
    stays (a byte that starts no character, once text follows it), never the bytes of a
    character still being written; the output is cut where that match starts."""
    from seer_engine.engine.detokenizer import new_stop_match

    detok = llm.engine.detokenizer
    char = detok.encode("日")
    assert len(char) == 3 and detok.decode(char) == "日"
    for k in range(1, 4):
        assert detok.find_stop_string(char[:k], ["\ufffd"]) is None, k
    assert detok.find_stop_string(char, ["日"]) == "日"
    stray = char[1:2]  # a continuation byte alone: never a character
    assert detok.find_stop_string(detok.encode("ab") + stray, ["\ufffd"]) is None
    assert detok.find_stop_string(detok.encode("ab") + stray + detok.encode("x"), ["\ufffd"]) == "\ufffd"
    assert new_stop_match("ab\ufffd", "ab\ufffdx", ["\ufffd"]) == (2, "\ufffd")


def test_a_character_begun_by_the_prompt_and_finished_by_the_output_is_the_outputs(llm):
    """As vLLM's detokenizer, which starts from the prompt's last tokens: a prompt given
    as token ids may end inside a character; the output token that finishes it gives the
    character, not U+FFFD, and a stop string can match it."""
    detok = llm.engine.detokenizer
    ids = detok.encode("Hello 日本")
    prompt, last = ids[:-1], ids[-1]
    assert detok.decode(prompt).endswith("\ufffd") and detok.decode([last]) == "\ufffd"
    base = dict(max_tokens=2, allowed_token_ids=[last], ignore_eos=True)
    out = llm.generate([prompt], SamplingParams(**{**base, "max_tokens": 1}))[0].outputs[0]
    assert out.text == "本" and out.token_ids == [last]
    out = llm.generate([prompt], SamplingParams(**base, stop=["本"]))[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text, out.token_ids) == ("stop", "本", "", [last])
    out = llm.generate([prompt], SamplingParams(**base, stop=["本"], include_stop_str_in_output=True))
    assert out[0].outputs[0].text == "本"
    clean = llm.generate([detok.encode("Hello")], SamplingParams(**base))[0].outputs[0]
    assert clean.text == detok.decode([last, last])  # a prompt ending a character lends nothing


def test_an_interrupted_generate_leaves_nothing_behind(tiny_model, monkeypatch):
    llm = LLM(str(tiny_model("qwen3")), max_model_len=64)
    engine, step, calls = llm.engine, llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=8, ignore_eos=True))
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks
    [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert out.prompt_token_ids == [5, 6, 7]
    with pytest.raises(ValueError, match="priorities"):
        llm.generate([[5], [6]], priority=[0])


def test_a_stop_string_completed_by_the_last_allowed_token_stops_the_output(llm):
    prompt = list(range(50, 70))
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    tokens = free.outputs[0].token_ids
    texts = [llm.tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    # A two-character stop string that the k-th token completes, seen nowhere before.
    k, stop = next(
        (k, texts[k][-2:])
        for k in range(8, len(tokens))
        if texts[k][-2:].isalnum() and texts[k].find(texts[k][-2:]) == len(texts[k]) - 2
    )
    for max_tokens in (k, k + 3):  # at max_tokens, as before it
        out = llm.generate(
            [prompt], SamplingParams(temperature=0, max_tokens=max_tokens, stop=[stop], ignore_eos=True)
        )[0].outputs[0]
        assert out.token_ids == tokens[:k]
        assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, texts[k][:-2])


def test_a_text_prompt_the_model_has_no_embedding_for_is_refused(tiny_model, tmp_path):
    """A tokenizer larger than the model's vocabulary: a text prompt that tokenizes past it
    gets an error naming the id, as a token-id prompt does, not an IndexError mid-step."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = tiny_model("llama")
    model = AutoModelForCausalLM.from_pretrained(src)
    small = 600
    model.resize_token_embeddings(small)
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    llm = LLM(str(tmp_path))
    text = "The rollout phase of synchronous reinforcement learning decides the iteration time."
    ids = llm.engine.detokenizer.tokenizer.encode(text)
    assert max(ids) >= small, "the prompt must reach past the model's vocabulary"
    first = next(i for i in ids if i >= small)
    with pytest.raises(InvalidRequestError, match=f"token id {first}, outside the model's vocabulary"):
        llm.generate([text], SamplingParams(max_tokens=4))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4


def test_a_weight_update_from_an_empty_path_is_refused_not_read_from_the_working_directory(
    llm, tiny_model, monkeypatch
):
    """``Path("")`` is ``.``: an empty ``model_path`` (a trainer's unset variable) loaded the
    checkpoint the server happened to run in; it is refused and the weights stay."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
    monkeypatch.chdir(tiny_model("qwen3", seed=1))  # same shapes, other weights
    for empty in ("", "  "):
        with pytest.raises(InvalidRequestError, match="model_path is empty"):
            llm.engine.update_weights(empty)
    assert llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids == before


def test_kv_computed_after_a_weight_update_over_stale_kv_is_not_shared(tiny_model):
    """A request running across a weight update keeps its KV (partial rollouts), and the
    blocks it fills afterwards attend to that stale KV: they must not enter the prefix
    cache, or a later request with the same context gets outputs of neither model."""
    old, new = tiny_model("qwen3"), tiny_model("qwen3", seed=1)
    llm = LLM(str(old), block_size=4, num_kv_blocks=64, max_model_len=128)
    engine, prompt = llm.engine, list(range(50, 58))
    engine.add_request("long", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.update_weights(str(new))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    context = prompt + outputs["long"].outputs[0].token_ids[:16]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(str(new), block_size=4, num_kv_blocks=64).generate([context], greedy)[0]
    for _ in range(2):  # the second one finds the first one's blocks in the prefix cache
        assert llm.generate([context], greedy)[0].outputs[0].token_ids == expected.outputs[0].token_ids
    assert engine.kv_manager.prefix_hits > 0


@pytest.mark.parametrize(
    ("spelled", "raw"), [("<0xE6>", b"\xe6"), ("\u00e4\u00bd", b"\xe4\xbd"), ("\u0120\u00c3", b" \xc3")]
)
def test_a_partial_characters_token_bytes_come_from_its_spelling(spelled, raw):
    """SentencePiece byte fallback and GPT-2's byte-level alphabet: a token that decodes to
    U+FFFD alone still has its own bytes (chat logprobs' ``bytes``)."""

    class Spelling:
        @staticmethod
        def convert_ids_to_tokens(token_id: int) -> str:
            return spelled

    assert Detokenizer(Spelling()).token_bytes(7, "\ufffd") == raw
    assert Detokenizer(Spelling()).token_bytes(7, "é") == "é".encode()


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_special_tokens_text_completes_a_stop_string_only_where_the_text_shows_it(llm, skip_special_tokens):
    """vLLM's rule: stop strings are found in the output's text; skipped special tokens
    are not in it, so their text completes no stop string."""
    special = llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = SamplingParams(
        max_tokens=3,
        ignore_eos=True,
        allowed_token_ids=[special],
        stop=["<|im_start|>"],
        skip_special_tokens=skip_special_tokens,
    )
    out = llm.generate([[50, 51, 52]], params)[0].outputs[0]
    assert out.text == ""
    if skip_special_tokens:
        assert (out.finish_reason, out.stop_reason, out.token_ids) == ("length", None, [special] * 3)
    else:
        assert (out.finish_reason, out.stop_reason, out.token_ids) == ("stop", "<|im_start|>", [special])
