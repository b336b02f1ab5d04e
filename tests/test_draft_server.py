"""The distributed grouped draft server: replicas that sync through a ``DraftServer``
hold the same trees and propose the same drafts as one shared ``SuffixProposer``;
updates are incremental, never echoed, never appended twice; gaps and overlaps are
handled; finished groups are freed; records pickle."""

from __future__ import annotations

import pickle
import random

import pytest

from seer_engine.core.request import Request
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.draft_server import (
    DraftServer,
    ReplicaProposer,
    ReplicaSpec,
    TokenAppend,
)
from seer_engine.spec_decode.proposers import SuffixProposer
from seer_engine.spec_decode.suffix_tree import PROMPT_KEY

CONFIG = SpeculativeConfig(method="group_suffix", max_depth=16, min_prob=0.0)
PROMPT = [(7 * i) % 11 + 3 for i in range(20)]


def _request(sid: str, group: str = "g", output: list[int] | None = None, chunk: int = 0) -> Request:
    """A chunk of response ``sid``: its own request id, the response's tokens so far."""
    return Request(
        f"{sid}-c{chunk}",
        list(PROMPT),
        SamplingParams(),
        max_tokens=10_000,
        seed=0,
        group_id=group,
        sequence_id=sid,
        output_token_ids=list(output or []),
    )


def _grow(req: Request, rng: random.Random, n: int) -> None:
    """Repetitive tokens over a tiny vocabulary: siblings share substrings, trees branch."""
    for _ in range(n):
        out = req.output_token_ids
        tok = out[-3] if len(out) >= 3 and rng.random() < 0.6 else rng.randrange(3, 9)
        req.append_output_token(tok)


def _dump(proposer: SuffixProposer, tree) -> list:
    t = proposer.trees.tree(tree)
    return [] if t is None else t.dump()


def _drafts(proposer: SuffixProposer, reqs: list[Request]) -> list:
    out = []
    for req in reqs:
        for budget, multi in ((6, False), (12, True)):
            out.append(proposer.propose(req, budget, multi))  # tokens, parents, probs, match length
    return out


def _running(placement: dict[tuple[str, str], int], inst: int) -> list[str]:
    return sorted({gid for (_, gid), i in placement.items() if i == inst})


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("lag", [False, True])
def test_replicas_match_one_shared_proposer(grouped, lag):
    """Three instances run the siblings of two groups, one response moving between
    instances mid-way (a new chunk). Each step every instance publishes and fetches the
    groups it runs now (``lag``: about half of the fetches are skipped, so replicas are
    stale, and the moved response resumes on an instance that lacks some of its
    tokens). In sync, a replica holds the shared proposer's trees node for node and
    proposes the same drafts."""
    rng = random.Random(1)
    shared = SuffixProposer(CONFIG, grouped)
    replicas = [ReplicaProposer(CONFIG, grouped) for _ in range(3)]
    server = DraftServer()
    # (response, group) -> instance running it; "g0" moves from 0 to 2 at step 12
    placement = {
        ("g0", "g"): 0,
        ("g1", "g"): 1,
        ("g2", "g"): 2,
        ("g3", "g"): 1,
        ("h0", "h"): 0,
        ("h1", "h"): 2,
    }
    reqs = {sid: _request(sid, gid) for sid, gid in placement}
    trees = lambda gids: gids if grouped else [sid for sid, gid in placement if gid in gids]
    for step in range(30):
        if step == 12:  # g0's chunk ends on instance 0, the next one runs on instance 2
            reqs["g0"] = _request("g0", "g", reqs["g0"].output_token_ids, chunk=1)
            placement[("g0", "g")] = 2
        for (sid, _), inst in placement.items():
            if step < 3 and sid == "g3":  # a late sibling
                continue
            _grow(reqs[sid], rng, rng.randint(1, 3))
            replicas[inst].observe(reqs[sid])
            shared.observe(reqs[sid])
        for i, rep in enumerate(replicas):
            server.publish(i, rep.take_updates())
        for i, rep in enumerate(replicas):
            if lag and rng.random() < 0.5:
                continue
            rep.apply(server.updates_for(i, _running(placement, i)))
            if not lag:
                for tree in trees(_running(placement, i)):
                    assert _dump(rep, tree) == _dump(shared, tree)
    for i, rep in enumerate(replicas):  # a last round over every group
        server.publish(i, rep.take_updates())
    for i, rep in enumerate(replicas):
        rep.apply(server.updates_for(i, ["g", "h"]))
        for tree in trees(["g", "h"]):
            assert _dump(rep, tree) == _dump(shared, tree)
    want = _drafts(shared, list(reqs.values()))
    assert any(d.tokens for d in want) and any(not d.is_path for d in want), "the drafts are not all empty"
    for rep in replicas:
        assert _drafts(rep, list(reqs.values())) == want
        assert rep.stats.gap_records == 0, "the server's per-group log order rules gaps out"
    # Each replica numbered the sequences in its own order: keys differ, drafts do not.
    assert len({tuple(rep._seq_keys[s] for s in reqs) for rep in replicas}) > 1
    # A context no one has observed (a fresh sibling) drafts the same too.
    fresh = _request("g9", "g", reqs["g1"].output_token_ids[:7])
    assert _drafts(replicas[1], [fresh]) == _drafts(shared, [fresh])
    if lag:
        assert sum(rep.stats.overlap_tokens for rep in replicas) > 0, "stale replicas got overlaps"


def test_updates_are_incremental_and_not_echoed():
    rng = random.Random(2)
    a, b, c = (ReplicaProposer(CONFIG, grouped=True) for _ in range(3))
    server = DraftServer()
    ra, rb = _request("s0"), _request("s1")
    _grow(ra, rng, 5)
    a.observe(ra)
    server.publish(0, a.take_updates())
    assert a.take_updates() == [], "take_updates clears the outbox"
    assert server.updates_for(0, ["g"]) == [], "a source never gets its own records"
    first = server.updates_for(1, ["g"])
    assert first == [TokenAppend("g", "s0", 0, tuple(ra.output_token_ids), tuple(PROMPT))]
    assert server.updates_for(1, ["g"]) == [], "nothing new"
    assert server.updates_for(1, ["other"]) == []
    b.apply(first)
    # Two more steps of s0 and one of s1 before instance 1 asks again: only the new
    # tokens, s0's two steps merged into one record.
    _grow(ra, rng, 2)
    a.observe(ra)
    server.publish(0, a.take_updates())
    _grow(ra, rng, 3)
    a.observe(ra)
    _grow(rb, rng, 4)
    b.observe(rb)
    server.publish(0, a.take_updates())
    server.publish(1, b.take_updates())
    second = server.updates_for(1, ["g"])
    assert second == [TokenAppend("g", "s0", 5, tuple(ra.output_token_ids[5:]))]
    b.apply(second)
    # A third instance that asks for the first time gets everything from the start,
    # the prompt once (only the replica that built the tree sends it).
    third = server.updates_for(2, ["g"])
    assert [(r.sequence_id, r.start, len(r.tokens)) for r in third] == [("s0", 0, 10), ("s1", 0, 4)]
    assert [r.prompt_token_ids is not None for r in third] == [True, False]
    c.apply(third)
    assert _dump(c, "g") == _dump(b, "g")
    assert b.stats.overlap_tokens == 0 and b.stats.applied_tokens == 10
    stats = server.stats
    assert (stats.published_records, stats.published_tokens) == (4, 14)
    assert (stats.served_records, stats.served_tokens, stats.served_prompt_tokens) == (4, 24, 2 * len(PROMPT))


def test_resumed_response_appends_only_new_tokens():
    rng = random.Random(3)
    a, b = ReplicaProposer(CONFIG, grouped=True), ReplicaProposer(CONFIG, grouped=True)
    server = DraftServer()
    first = _request("s0")
    _grow(first, rng, 10)
    a.observe(first)
    server.publish(0, a.take_updates())
    b.apply(server.updates_for(1, ["g"]))
    tree = b.trees.tree("g")
    assert tree.num_tokens() == len(PROMPT) + 10
    # The response resumes on instance 1 with its 10 tokens and generates 5 more.
    second = _request("s0", output=first.output_token_ids, chunk=1)
    b.observe(second)
    assert b.take_updates() == [], "its 10 tokens were already there: nothing new to send"
    _grow(second, rng, 5)
    b.observe(second)
    assert tree.num_tokens() == len(PROMPT) + 15
    assert tree.sequence_length(b._seq_keys["s0"]) == 15
    sent = b.take_updates()
    assert [(r.start, len(r.tokens), r.prompt_token_ids) for r in sent] == [(10, 5, None)]
    # Back on instance 0, which has the first 10 tokens of its own: only the 5 new.
    server.publish(1, sent)
    a.apply(server.updates_for(0, ["g"]))
    assert a.trees.tree("g").num_tokens() == len(PROMPT) + 15
    assert _dump(a, "g") == _dump(b, "g")
    # A chunk resuming here before its tokens were observed drafts from its real end.
    third = _request("s0", output=second.output_token_ids + [3, 4, 5], chunk=2)
    a.propose(third, 4, False)
    assert a._appended["s0"] == 18


def test_gaps_and_overlaps():
    rep = ReplicaProposer(CONFIG, grouped=True)
    toks = [5, 6, 7, 5, 6, 7, 8, 5, 6, 7, 8, 9]
    rep.apply([TokenAppend("g", "s", 0, tuple(toks[:5]), tuple(PROMPT))])
    rep.apply([TokenAppend("g", "s", 3, tuple(toks[3:7]))])  # overlaps 2, adds 2
    rep.apply([TokenAppend("g", "s", 0, tuple(toks[:3]))])  # fully covered
    key = rep._seq_keys["s"]
    tree = rep.trees.tree("g")
    assert tree.sequence_length(key) == 7 and rep._appended["s"] == 7
    assert rep.stats.overlap_tokens == 2 + 3
    before = tree.dump()
    rep.apply([TokenAppend("g", "s", 9, tuple(toks[9:]))])  # starts beyond the 7 it has: dropped
    assert rep.stats.gap_records == 1 and tree.dump() == before and rep._appended["s"] == 7
    # The response itself running here fills the gap from its own tokens.
    rep.observe(_request("s", output=toks))
    assert tree.sequence_length(key) == 12 and tree.num_tokens() == len(PROMPT) + 12
    ref = SuffixProposer(CONFIG, grouped=True)
    ref.observe(_request("s", output=toks))
    assert _dump(ref, "g") == tree.dump()
    assert rep.take_updates() == [TokenAppend("g", "s", 7, tuple(toks[7:]))]
    # A gap for a sequence never seen leaves no state behind.
    rep.apply([TokenAppend("g", "t", 4, (1, 2))])
    assert "t" not in rep._seq_keys and rep.stats.gap_records == 2


@pytest.mark.parametrize("grouped", [True, False])
def test_finish_group_frees_server_and_replicas(grouped):
    rng = random.Random(4)
    a, b = ReplicaProposer(CONFIG, grouped), ReplicaProposer(CONFIG, grouped)
    server = DraftServer()
    reqs = [_request("s0"), _request("s1"), _request("k0", group="k")]
    for req in reqs:
        _grow(req, rng, 6)
        a.observe(req)
    server.publish(0, a.take_updates())
    b.apply(server.updates_for(1, ["g", "k"]))
    _grow(reqs[0], rng, 2)
    a.observe(reqs[0])  # unsent when the group finishes
    server.finish_group("g")
    assert server.num_records("g") == 0 and server.num_groups == 1 and server.updates_for(1, ["g"]) == []
    late = [TokenAppend("g", "s0", 6, (3, 3))]
    for rep in (a, b):
        rep.finish_group("g")
        rep.apply(late)  # in flight when the group finished: ignored
        assert set(rep._seq_keys) == {"k0"} and set(rep._appended) == {"k0"}
        assert len(rep.trees) == 1 and ("k" if grouped else "k0") in rep.trees
    assert b.stats.finished_records == 1
    assert a.take_updates() == [], "the finished group's unsent records are dropped"
    # The id is reused (a later iteration): a request of the group lifts the tombstone.
    again = _request("s5")
    _grow(again, rng, 3)
    b.observe(again)
    b.apply([TokenAppend("g", "s6", 0, (4, 4, 4))])
    assert b._appended == {"k0": 6, "s5": 3, "s6": 3}
    sent = b.take_updates()
    assert sent[0].prompt_token_ids == tuple(PROMPT), "the rebuilt tree's prompt goes out again"
    # Or the worker reopens it when given a request of the group, before its first step.
    a.apply([TokenAppend("g", "s7", 0, (4, 4), tuple(PROMPT))])
    assert "s7" not in a._appended
    a.reopen("g")
    a.apply([TokenAppend("g", "s7", 0, (4, 4), tuple(PROMPT))])
    assert a._appended["s7"] == 2 and PROMPT_KEY in a.trees.tree("g" if grouped else "s7")


def test_records_pickle():
    rng = random.Random(5)
    rep = ReplicaSpec.of(CONFIG).open()
    assert isinstance(rep, ReplicaProposer) and rep.grouped
    assert ReplicaSpec.of(SpeculativeConfig(method="ngram")) is None
    assert not ReplicaSpec.of(SpeculativeConfig(method="suffix")).open().grouped
    req = _request("s0")
    _grow(req, rng, 4)
    rep.observe(req)
    records = rep.take_updates()
    back = pickle.loads(pickle.dumps(records))
    assert back == records and isinstance(back[0], TokenAppend) and back[0].end == 4
    other = ReplicaProposer(CONFIG, grouped=True)
    other.apply(back)
    assert PROMPT_KEY in other.trees.tree("g") and _dump(other, "g") == _dump(rep, "g")
    assert pickle.loads(pickle.dumps(ReplicaSpec(CONFIG))).open().grouped


def test_engines_in_step_draft_from_each_other(tiny_model):
    """Two engines, each with its own replica, synced through the server every step as
    instance processes would be: the later sibling drafts from the earlier one's tokens
    on the other engine, and greedy outputs are those of an engine without drafts."""
    from seer_engine.engine.config import EngineConfig
    from seer_engine.engine.llm_engine import LLMEngine

    model = str(tiny_model("qwen3"))
    spec = SpeculativeConfig(method="group_suffix", budget="fixed", num_speculative_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = [(5 * i) % 40 + 2 for i in range(24)]
    plain = LLMEngine(EngineConfig(model=model, num_kv_blocks=64))
    plain.add_request("ref", prompt, params)
    want = None
    while plain.has_unfinished_requests():
        want = next((o.outputs[0].token_ids for o in plain.step() if o.finished), want)
    server = DraftServer()
    replicas = [ReplicaSpec.of(spec).open() for _ in range(2)]
    config = EngineConfig(model=model, num_kv_blocks=64, speculative_config=spec)
    engines = [LLMEngine(config, proposer=rep) for rep in replicas]
    engines[0].add_request("a", prompt, params, group_id="g")
    outputs = {}
    for step in range(100):
        if step == 12:
            engines[1].add_request("b", prompt, params, group_id="g")
        for i, (engine, rep) in enumerate(zip(engines, replicas)):
            rep.apply(server.updates_for(i, ["g"]))
            outputs.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
            server.publish(i, rep.take_updates())
        if len(outputs) == 2:
            break
    assert outputs == {"a": want, "b": want}
    assert engines[1].scheduler.stats.draft_tokens_accepted >= 10
    assert replicas[1].stats.applied_tokens >= 20 and server.stats.served_tokens >= 20
    server.finish_group("g")
    for rep in replicas:
        rep.finish_group("g")
        assert len(rep.trees) == 0
    assert server.num_groups == 0
