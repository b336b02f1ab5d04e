"""Speculative decoding and KV pool edge cases: odd ``--speculative-config`` values are
clear errors, a near-zero temperature samples greedily, aborted requests leave no draft
state behind, and bad pool settings (a Mooncake address that is no ``host:port``, a pool
larger than ``/dev/shm``, a non-finite size) fail at once with a message that says so."""

from __future__ import annotations

import os

import pytest
import torch

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import LLMEngine
from seer_engine.kv_connector import local
from seer_engine.kv_connector.factory import make_kv_pool
from seer_engine.kv_connector.mooncake.store import MooncakeStore
from seer_engine.model_executor.sampler import Sampler, SamplingRow
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode.config import SpeculativeConfig


@pytest.mark.parametrize(
    "bad, needle",
    [
        ('{"multi_path": "false"}', "multi_path must be true or false"),
        ('{"min_prob": "x"}', "min_prob must be a number"),
        ('{"min_prob": null}', "min_prob must be a number"),
        ('{"min_prob": NaN}', "min_prob must be a number"),
        ('{"backoff": -1}', r"backoff must be a number in \[0, 1e\+06\]"),
        ('{"backoff": "16"}', "backoff must be a number"),
        ('{"backoff": NaN}', "backoff must be a number"),
        ('{"max_depth": 1099511627776}', r"max_depth must be an integer in 2\.\.4096"),
        ('{"max_depth": 5000}', r"max_depth must be an integer in 2\.\.4096"),
        ('{"prompt_lookup_min": "2"}', "need integers 1 <= prompt_lookup_min"),
        ('{"method": "ngram", "prompt_lookup_min": 2.5, "prompt_lookup_max": 3}', "need integers"),
        ('{"prompt_lookup_max": 1e400}', "need integers"),
        ('{"history_weight": true}', "history_weight must be in"),
        ('{"history_weight": 1e-6}', r"history_weight must be in \[1/65536, 1\]"),
        ('{"history_sequences": true}', "history_sequences must be an integer"),
        ('{"num_speculative_tokens": -3}', r"1\.\.63"),
        ('{"num_speculative_tokens": 1e9}', r"1\.\.63"),
        ('{"num_speculative_tokens": "8"}', r"1\.\.63"),
        ('{"step_cost": [Infinity, 0]}', "step_cost must be"),
        ('{"priority_weight": 0.5}', r"priority_weight must be a number in \[1, 1000\]"),
        ('{"priority_weight": NaN}', "priority_weight must be a number"),
        ('{"priority_weight": "2"}', "priority_weight must be a number"),
    ],
)
def test_speculative_config_wrong_types_are_clear_errors(bad, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(speculative_config=bad)


def test_speculative_config_accepts_integral_numbers():
    spec = SpeculativeConfig.parse('{"min_prob": 0, "history_weight": 1, "max_depth": 4096, "backoff": 0}')
    assert (spec.min_prob, spec.history_weight, spec.max_depth, spec.backoff) == (0, 1, 4096, 0)


def test_the_smallest_history_weight_drafts(tiny_model):
    """Live sequences weigh 1 / history_weight in the C++ trees, which cap a weight at 65536."""
    spec = {"method": "group_suffix", "budget": "fixed", "history_weight": 1 / 65536}
    model = str(tiny_model("qwen3"))
    engine = LLMEngine(EngineConfig(model=model, speculative_config=spec, num_kv_blocks=64))
    prompt = [(5 * i) % 40 + 2 for i in range(24)]  # its greedy output repeats a token
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.stats.draft_tokens_accepted > 0


@pytest.mark.parametrize("temperature", [1e-40, 1e-300])
@pytest.mark.parametrize("logits", [[1.0, 3.0, 2.0, -1.0], [-3.0, -1.0, -2.0, -5.0]])
def test_a_vanishing_temperature_samples_greedily(temperature, logits):
    # logits / temperature overflows: softmax would be all NaN and argmax pick token 0
    row = SamplingRow(temperature, -1, 1.0, 0.0, 7, 5, [], 1)
    out = Sampler()(torch.tensor([logits]), [row])
    assert out.token_ids == [1]
    assert out.logprobs[0][1] == 1  # the sampled token is the top-ranked one


def test_aborted_requests_leave_no_acceptance_behind(tiny_model):
    spec = {"method": "group_suffix", "budget": "fixed", "num_speculative_tokens": 8}
    model = str(tiny_model("qwen3"))
    engine = LLMEngine(EngineConfig(model=model, speculative_config=spec, num_kv_blocks=64, max_num_seqs=8))
    prompt = [(7 * i) % 13 + 3 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("a", prompt, params, group_id="g")
    for _ in range(20):
        engine.step()
    params = SamplingParams(n=2, temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("b", prompt, params, group_id="g")
    for _ in range(3):  # abort mid-speculation: drafts were verified and learnt
        engine.step()
    drafter = engine.drafter
    assert set(drafter._estimates) & {"a", "b-0", "b-1"}
    engine.abort_request(["a", "b"])
    engine.add_request("c", prompt, SamplingParams(temperature=0.0, max_tokens=4), group_id="h")
    engine.step()
    assert set(drafter._estimates) <= {"c"}


@pytest.mark.parametrize(
    "address", ["http://127.0.0.1:50051", "127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:٣", "a b:5", None]
)
def test_mooncake_address_that_is_no_host_port_is_a_usage_error(address):
    with pytest.raises(ValueError, match="host:port"):
        MooncakeStore(address)


def test_local_pool_larger_than_shm_is_refused(monkeypatch):
    real = os.statvfs

    def small_shm(path):
        st = real(path if os.path.exists(path) else "/")
        return os.statvfs_result((*st[:4], 16, *st[5:]))  # f_bavail: 16 blocks

    monkeypatch.setattr(local.os, "statvfs", small_shm)
    with pytest.raises(ValueError, match="does not fit in /dev/shm.*SIGBUS"):
        local.LocalStore.create(1 << 30, 1 << 20)


@pytest.mark.parametrize("gib", [float("nan"), float("inf"), 0, -1])
def test_kv_pool_size_must_be_finite_and_positive(gib):
    with pytest.raises(ValueError, match="--kv-pool-gib must be a finite number > 0"):
        make_kv_pool("local", 4, 1024, capacity_gib=gib)
