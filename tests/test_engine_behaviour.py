"""Engine behaviour: block sharing, preemption, seeds, stops, aborts, priorities, errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from seer_engine import LLM, InvalidRequestError, SamplingParams
from seer_engine.model_executor.model_config import ModelLoadError


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(str(model_path), max_num_batched_tokens=256)


def _run_to_end(engine):
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    return outs


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    kv = engine.kv_manager
    prompt = list(range(10, 10 + 40))  # two full blocks of 16 and a partial one
    children = engine.add_request("shared", prompt, SamplingParams(n=8, max_tokens=8, seed=3))
    engine.step()
    engine.step()
    tables = [kv.block_ids(c.request_id) for c in children]
    assert all(len(t) >= 3 for t in tables)
    first_two = {tuple(t[:2]) for t in tables}
    assert len(first_two) == 1, f"prompt blocks not shared: {tables}"
    shared_blocks = [kv.pool.blocks[b] for b in tables[0][:2]]
    assert all(b.ref_cnt == 8 for b in shared_blocks)
    assert len({t[2] for t in tables}) == 8, "the partial last block is private"
    outs = _run_to_end(engine)
    assert len(outs) == 1 and len(outs[0].outputs) == 8
    assert [o.index for o in outs[0].outputs] == list(range(8))
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_seeded_sampling_ignores_batch_composition(model_path):
    target = list(range(20, 45))
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234, max_tokens=32)
    alone = LLM(str(model_path)).generate([target], params)[0].outputs[0].token_ids
    others = [list(range(30, 30 + n)) for n in (5, 60, 17, 33)]
    crowd = LLM(str(model_path), max_num_batched_tokens=24).generate(
        others + [target] + others,
        [SamplingParams(temperature=1.0, max_tokens=40, seed=i) for i in range(4)]
        + [params]
        + [SamplingParams(temperature=0.5, max_tokens=20) for _ in range(4)],
    )
    assert crowd[4].outputs[0].token_ids == alone
    unseeded = LLM(str(model_path)).generate([target], params.clone(seed=4321))[0]
    assert unseeded.outputs[0].token_ids != alone


def test_preemption_by_recompute_keeps_outputs(model_path):
    prompts = [list(range(40 + i, 80 + i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    roomy = LLM(str(model_path)).generate(prompts, params)
    tight = LLM(str(model_path), num_kv_blocks=16)
    outs = tight.generate(prompts, params)
    stats = tight.engine.scheduler.stats
    assert stats.preemptions > 0 and stats.recomputed_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]
    kv = tight.engine.kv_manager
    assert kv.num_free_blocks == kv.pool.num_blocks


def test_stop_conditions(llm):
    prompt = list(range(50, 70))
    free_run = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    tokens = free_run.outputs[0].token_ids
    assert len(tokens) == 30 and free_run.outputs[0].finish_reason == "length"

    stop_id = tokens[5]
    first = tokens.index(stop_id)
    by_id = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))
    assert by_id[0].outputs[0].token_ids == tokens[: first + 1]
    assert by_id[0].outputs[0].finish_reason == "stop"
    assert by_id[0].outputs[0].stop_reason == stop_id

    late = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, min_tokens=first + 2, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert len(late.token_ids) > first + 1 and stop_id not in late.token_ids[: first + 2]

    text = free_run.outputs[0].text
    middle = len(text) // 2
    stop_str = text[middle : middle + 3]
    assert len(stop_str.strip()) == 3, f"pick a printable stop string from {text!r}"
    first_at = text.find(stop_str)
    out = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop=[stop_str], ignore_eos=True)
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == text[:first_at]
    assert len(out.token_ids) < 30
    kept = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=30, stop=[stop_str], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: first_at + 3]


def test_eos_stops_unless_ignored(llm):
    engine = llm.engine
    prompt = list(range(50, 70))
    tokens = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = tokens[0].outputs[0].token_ids
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({tokens[4]})  # pretend this token is the model's EOS
    try:
        stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
        ignored = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[
            0
        ].outputs[0]
    finally:
        engine.eos_token_ids = saved
    assert stopped.token_ids == tokens[: tokens.index(tokens[4]) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason is None
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"


def test_abort_returns_partial_tokens(llm):
    engine = llm.engine
    engine.add_request("long", list(range(10, 30)), SamplingParams(max_tokens=500, ignore_eos=True))
    for _ in range(6):
        engine.step()
    [out] = engine.abort_request("long")
    assert out.outputs[0].finish_reason == "abort"
    assert 0 < len(out.outputs[0].token_ids) < 500
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks


def test_priority_policy_orders_admission(model_path):
    llm = LLM(str(model_path), scheduling_policy="priority", max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2)):
        engine.add_request(rid, list(range(10, 20)), params, priority=prio)
    order = [o.request_id for o in _run_to_end(engine)]
    assert order == ["high", "mid", "low"]


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(n=0), "n must"),
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_tokens=10, max_tokens=5), "min_tokens"),
        (dict(logprobs=50), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(seed="x"), "seed"),
    ],
)
def test_invalid_sampling_params_are_named(kwargs, needle):
    with pytest.raises(InvalidRequestError, match=needle):
        SamplingParams(**kwargs)


def test_invalid_prompts_are_named(llm):
    engine = llm.engine
    vocab = engine.vocab_size
    with pytest.raises(InvalidRequestError, match=f"token id {vocab} is out of the vocabulary"):
        llm.generate([[1, 2, vocab]])
    with pytest.raises(InvalidRequestError, match="token id -1"):
        llm.generate([[1, -1]])
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        llm.generate([[5] * engine.max_model_len])
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([""])
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("dup", [1, 2], SamplingParams())
        engine.add_request("dup", [1, 2], SamplingParams())
    engine.abort_request("dup")
    assert not engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_prompts_are_taken_in_each_form_vllms_llm_takes(llm):
    import numpy as np

    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    ids = [5, 6, 7]
    expected = llm.generate([ids], greedy)[0].outputs[0].token_ids
    for prompt in ({"prompt_token_ids": ids}, np.array(ids), list(np.array(ids))):
        (out,) = llm.generate(prompt, greedy)
        assert (out.prompt_token_ids, out.outputs[0].token_ids) == (ids, expected)
    text, tokens = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], greedy)
    assert text.prompt == "Hello" and tokens.prompt_token_ids == ids
    assert len(llm.generate((p for p in ["a", "b"]), greedy)) == 2
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        llm.generate({"text": "Hello"}, greedy)


def test_a_samples_finished_is_a_method_as_in_vllm(llm):
    (out,) = llm.generate("Hello", SamplingParams(max_tokens=2))
    assert out.finished is True and out.outputs[0].finished() is True


def test_chat_renders_each_conversation_with_the_chat_template(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    first = [{"role": "user", "content": "hi"}]
    second = [*first, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    outs = llm.chat([first, second], greedy)
    for conversation, out in zip([first, second], outs):
        text = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        alone = llm.generate(text, greedy.clone(add_special_tokens=False))[0]
        assert out.prompt == text and out.prompt_token_ids == alone.prompt_token_ids
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.chat(first, greedy)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    (as_parts,) = llm.chat([{"role": "user", "content": parts}], greedy)
    assert as_parts.prompt == llm.chat([{"role": "user", "content": "hi\nthere"}], greedy)[0].prompt
    with pytest.raises(InvalidRequestError, match="a 'text' content part needs its 'text' field"):
        llm.chat([{"role": "user", "content": [{"type": "text"}]}], greedy)
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs may not set tokenize"):
        llm.chat(first, greedy, chat_template_kwargs={"tokenize": True})


def test_a_sampling_params_list_of_the_wrong_type_is_named(llm):
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got str"):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=1), "x"])  # type: ignore[list-item]
    conversations = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be a SamplingParams, got str"):
        llm.chat(conversations, [SamplingParams(max_tokens=1), "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.chat(conversations, [SamplingParams(max_tokens=1)])


def test_vllm_offline_inputs_priority_and_a_set_of_stop_ids(llm):
    """As vLLM's LLM: a priority under fcfs scheduling is refused, not ignored; stop ids
    may come as a set."""
    with pytest.raises(ValueError, match="priority needs scheduling_policy='priority'"):
        llm.generate(["a", "b"], SamplingParams(max_tokens=1), priority=[0, 1])
    assert len(llm.generate(["a"], SamplingParams(max_tokens=1), priority=[0])) == 1
    rows = np.array([[5, 6, 7], [8, 9, 10]])
    outs = llm.generate(rows, SamplingParams(max_tokens=1))
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [8, 9, 10]]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (free,) = llm.generate("Hello", greedy)
    stop_id = free.outputs[0].token_ids[3]
    as_set = greedy.clone(stop_token_ids={stop_id})
    assert as_set.stop_token_ids == [stop_id]
    (out,) = llm.generate("Hello", as_set)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id


def test_chat_documents_reach_the_template(llm):
    template = "{% for d in documents %}[{{ d.title }}]{% endfor %}{{ messages[0].content }}"
    documents = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    messages = [{"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, greedy, chat_template=template, documents=documents)
    assert out.prompt == "[a][b]Hi"


def test_bad_model_folders_are_named(tmp_path, model_path):
    with pytest.raises(ModelLoadError, match="not a directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))
    import json
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(model_path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        LLM(str(bad))
    (bad / "config.json").write_text("[]")
    with pytest.raises(ModelLoadError, match="holds a JSON list, not an object"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": "64"}))
    with pytest.raises(ModelLoadError, match="field of the wrong type"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    for f in bad.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        LLM(str(bad))

    from safetensors.torch import load_file, save_file

    partial = tmp_path / "partial"
    shutil.copytree(model_path, partial)
    weights = load_file(str(partial / "model.safetensors"))
    dropped = sorted(weights)[3]
    del weights[dropped]
    save_file(weights, str(partial / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="incomplete"):
        LLM(str(partial))


def test_eos_ids_outside_the_vocabulary_are_ignored(tmp_path, model_path):
    """A generation config may list EOS ids the model cannot emit (past its vocabulary,
    or negative): they never stop an output, and min_tokens does not ban them (which
    indexed past the logits, or banned the last token)."""
    import json
    import shutil

    folder = tmp_path / "odd-eos"
    shutil.copytree(model_path, folder)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, vocab + 5, -1]}))
    llm = LLM(str(folder))
    assert 2 in llm.engine.eos_token_ids and all(0 <= e < vocab for e in llm.engine.eos_token_ids)
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, min_tokens=8))[0].outputs[0]
    assert len(out.token_ids) == 8


def test_a_broken_generation_config_is_named(tmp_path, model_path):
    """A generation_config.json that is not a JSON object fails the load naming that
    file, not config.json (which is fine)."""
    import shutil

    folder = tmp_path / "bad-gen"
    shutil.copytree(model_path, folder)
    gen = folder / "generation_config.json"
    for text, match in [
        ('{"eos_token_id": [0, 1', "generation_config.json is not valid JSON"),
        ("[2]", "generation_config.json holds a JSON list, not an object"),
        (b"\xff\xfe{", "generation_config.json is not valid JSON"),
    ]:
        gen.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(ModelLoadError, match=match):
            LLM(str(folder))


def test_a_config_transformers_refuses_is_a_load_error(tmp_path, model_path):
    """transformers validates config.json while loading the tokenizer and raises its own
    errors (KeyError, huggingface_hub's StrictDataclassError): a ModelLoadError carrying
    its message, which the CLI reports in one line, not a traceback."""
    import json
    import shutil

    folder = tmp_path / "refused"
    shutil.copytree(model_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}
    for change, match in [
        ({"rope_parameters": llama3}, "Missing required keys in `rope_parameters`"),
        ({"rms_norm_eps": None}, "rms_norm_eps"),
    ]:
        (folder / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ModelLoadError, match=match):
            LLM(str(folder))


def test_a_quantized_checkpoint_is_refused_by_name(tmp_path, model_path):
    """A quantization_config (an FP8 checkpoint here: float8 weights with their scales)
    is refused naming the method, not by the first scale tensor no parameter matches."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "fp8"
    shutil.copytree(model_path, folder)
    weights = load_file(str(folder / "model.safetensors"))
    for name in [n for n in weights if n.endswith("_proj.weight")]:
        weights[name] = weights[name].to(torch.float8_e4m3fn)
        weights[name.replace(".weight", ".weight_scale_inv")] = torch.ones(1, 1)
    save_file(weights, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    with pytest.raises(
        ModelLoadError,
        match=r"quantized checkpoint \(quant_method 'fp8', per the quantization_config in .*config\.json",
    ):
        LLM(str(folder))


def test_streaming_reports_progress_every_step(llm):
    engine = llm.engine
    engine.reset_prefix_cache()  # sample 1 then waits one step for sample 0's prompt block
    engine.add_request(
        "s",
        list(range(10, 30)),
        SamplingParams(n=2, max_tokens=6, temperature=0, ignore_eos=True),
        stream=True,
    )
    seen, steps = [], 0
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
        steps += 1
    lengths = [len(o.outputs[0].token_ids) for o in seen]
    assert lengths == sorted(lengths) and lengths[-1] == 6 and len(seen) == steps == 7
    assert [len(o.outputs[1].token_ids) for o in seen] == [0, 1, 2, 3, 4, 5, 6]
    assert [o.finished for o in seen] == [False] * 6 + [True]
    assert seen[-1].outputs[1].finish_reason == "length" and seen[0].outputs[0].finish_reason is None
    assert seen[-1].outputs[0].text.startswith(seen[2].outputs[0].text)


def test_streaming_with_logprobs_converts_each_entry_once(llm, monkeypatch):
    """A streaming request reports every sample's logprobs so far at every step; the
    engine thread converts only the new entries, not the whole output again (which made
    a long stream with logprobs cost quadratic time on the thread every request shares),
    and the stream ends with the logprobs of the same request run without streaming,
    a stop string's cut included."""
    engine = llm.engine
    converted = []
    to_output = engine.outputs.detokenizer.logprobs_to_output
    monkeypatch.setattr(
        engine.outputs.detokenizer,
        "logprobs_to_output",
        lambda entries: converted.append(len(entries or [])) or to_output(entries),
    )
    prompt, tokens = list(range(40, 50)), 48
    base = SamplingParams(n=2, max_tokens=tokens, temperature=1.0, seed=3, ignore_eos=True, logprobs=2)
    stop = llm.generate([prompt], base)[0].outputs[1].text[-12:-6]  # sample 1 (at least) ends early
    for params in (base, dataclasses.replace(base, stop=[stop])):
        plain = llm.generate([prompt], params)[0]
        converted.clear()
        engine.add_request("streamed-logprobs", prompt, params, stream=True)
        last = _run_to_end(engine)[-1]
        assert sum(converted) <= 2 * tokens, "each entry converted once"
        for streamed, expected in zip(last.outputs, plain.outputs, strict=True):
            assert streamed.token_ids == expected.token_ids and streamed.text == expected.text
            assert streamed.logprobs == expected.logprobs
            assert len(streamed.logprobs) == len(streamed.token_ids)


def test_truncation_samplers_collapse_to_greedy_at_their_limits(llm):
    prompt = list(range(60, 80))
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    expected = greedy[0].outputs[0].token_ids
    for kwargs in (dict(top_k=1), dict(top_p=1e-6), dict(top_p=1e-300), dict(min_p=1.0)):
        params = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True, **kwargs)
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        assert out == expected, kwargs
    wide = llm.generate([prompt], SamplingParams(temperature=1.5, seed=5, max_tokens=12, ignore_eos=True))
    assert wide[0].outputs[0].token_ids != expected


def test_top_k_keeps_samples_inside_the_top_k(llm):
    import torch

    from seer_engine.model_executor.sampler import Sampler, SamplingRow

    logits = torch.randn(1, 50)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    for seed in range(40):
        row = SamplingRow(1.0, 3, 1.0, 0.0, seed, 7, [], None)
        assert Sampler()(logits, [row]).token_ids[0] in allowed
    nucleus = SamplingRow(1.0, -1, 0.5, 0.0, 0, 7, [], None)
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    keep = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    nucleus_set = set(order[:keep].tolist())
    for seed in range(40):
        nucleus.seed = seed
        assert Sampler()(logits, [nucleus]).token_ids[0] in nucleus_set


def test_min_p_truncates_before_top_p_as_in_vllm():
    """vLLM applies min_p first and top-p to what it keeps: with probabilities .5, .3, .2,
    min_p .5 keeps .5 and .3 (.625 and .375 after renormalizing), and top_p .6 then only
    the first; top-p first would keep both."""
    import torch

    from seer_engine.model_executor.sampler import apply_min_p_top_k_top_p

    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    kept = apply_min_p_top_k_top_p(logits.clone(), -1, 0.6, 0.5)
    assert torch.isfinite(kept).tolist() == [True, False, False]


def test_a_step_scoring_a_prompt_counts_its_logit_rows(model_path):
    """A modeled clock prices a step by its shape: a prompt scored for prompt_logprobs
    computes logits at each scored position (the LM head over those rows), besides the
    sampled token's row; a prefix-cache hit makes the request compute its prompt again."""
    engine = LLM(str(model_path), max_num_batched_tokens=16).engine
    prompt = list(range(10, 10 + 24))
    engine.add_request("plain", prompt, SamplingParams(max_tokens=1))
    engine.step()  # 16 prompt positions: none reaches the last token
    assert engine.last_step_shape.logit_tokens == 0
    engine.step()
    assert engine.last_step_shape.logit_tokens == 1
    _run_to_end(engine)
    engine.add_request("scored", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    engine.step()  # positions 0-15 score prompt tokens 1-16
    assert engine.last_step_shape.logit_tokens == 16
    (out,) = engine.step()  # positions 16-22 score tokens 17-23; position 23 samples
    assert engine.last_step_shape.logit_tokens == 7 + 1
    assert out.finished and len(out.prompt_logprobs) == len(prompt)
