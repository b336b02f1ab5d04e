"""History-seeded group suffix trees: a group's tree starts with earlier iterations'
responses to its prompt, at a lower weight than live siblings, so drafts work from a
response's first token; replicas seeded through the draft server draft exactly as one
shared, seeded proposer; speculation stays lossless."""

from __future__ import annotations

import random

import pytest

from seer_engine.core.request import Request
from seer_engine.sampling_params import SamplingParams
from seer_engine.spec_decode.config import SpeculativeConfig
from seer_engine.spec_decode.draft_server import DraftServer, HistorySeed, ReplicaProposer
from seer_engine.spec_decode.proposers import NgramProposer, SuffixProposer
from seer_engine.spec_decode.suffix_tree import HISTORY_KEY, PROMPT_KEY

CONFIG = SpeculativeConfig(method="group_suffix", max_depth=16, min_prob=0.0, history_weight=0.25)
PROMPT = list(range(100, 120))  # no repeats: its tail continues only in the seeds


def _request(sid: str, output: list[int] | None = None, group: str = "g") -> Request:
    return Request(
        f"{sid}-c0", list(PROMPT), SamplingParams(), max_tokens=10_000, seed=0, group_id=group,
        sequence_id=sid, output_token_ids=list(output or []),
    )  # fmt: skip


def test_seeds_draft_from_the_first_token_at_a_lower_weight():
    earlier = [[50, 51, 52, 53, 54, 55], [50, 51, 52, 60, 61, 62], [50, 51, 52, 53, 54, 55]]
    proposer = SuffixProposer(CONFIG, grouped=True)
    assert proposer.seed_group("g", PROMPT, earlier) == sum(map(len, earlier))
    tree = proposer.trees.tree("g")
    assert tree.sequence_weight(PROMPT_KEY) == CONFIG.live_weight == 4
    assert [tree.sequence_weight(HISTORY_KEY - j) for j in range(3)] == [1, 1, 1]
    # A response with no token yet drafts what earlier responses began with.
    first = proposer.propose(_request("s0"), 3, multi_path=False)
    assert first.tokens == [50, 51, 52]
    # One live sibling (weight 4) outvotes two earlier responses (weight 1 each).
    proposer.observe(_request("s1", [50, 51, 52, 60, 70, 71]))
    live = _request("s2", [50, 51, 52])
    proposer.observe(live)  # the engine observes a response before drafting for it
    after = proposer.propose(live, 3, multi_path=False)
    assert after.tokens == [60, 70, 71]
    # Seeding again keeps what is there; finishing the group frees the seeds with it.
    assert proposer.seed_group("g", PROMPT, earlier) == 0
    proposer.finish_group("g")
    assert len(proposer.trees) == 0


def test_seeding_is_grouped_only_and_capped():
    config = SpeculativeConfig(method="group_suffix", history_sequences=2)
    proposer = SuffixProposer(config, grouped=True)
    assert proposer.seed_group("g", PROMPT, [[1], [2, 2], [3, 3, 3]]) == 5  # the newest two
    assert sorted(proposer.trees.tree("g").sequence_keys()) == [HISTORY_KEY - 1, HISTORY_KEY, PROMPT_KEY]
    assert SuffixProposer(config, grouped=False).seed_group("g", PROMPT, [[1, 2]]) == 0
    assert NgramProposer(config).seed_group("g", PROMPT, [[1, 2]]) == 0
    with pytest.raises(ValueError, match="history_weight"):
        SpeculativeConfig(history_weight=0.0)
    with pytest.raises(ValueError, match="history_sequences"):
        SpeculativeConfig(history_sequences=-1)


def _grow(req: Request, rng: random.Random, n: int) -> None:
    for _ in range(n):
        out = req.output_token_ids
        tok = out[-3] if len(out) >= 3 and rng.random() < 0.6 else rng.randrange(3, 9)
        req.append_output_token(tok)


def test_seeded_replicas_match_one_seeded_shared_proposer():
    """Two instances run a seeded group's siblings; the seed goes to the draft server
    before the first step, every replica gets it once, and replicas hold the shared
    proposer's tree node for node and propose its drafts."""
    rng = random.Random(3)
    earlier = [[rng.randrange(3, 9) for _ in range(30)] for _ in range(3)]
    shared = SuffixProposer(CONFIG, grouped=True)
    shared.seed_group("g", PROMPT, earlier)
    server = DraftServer()
    server.seed("g", PROMPT, earlier)
    replicas = [ReplicaProposer(CONFIG, grouped=True) for _ in range(2)]
    reqs = {f"s{i}": _request(f"s{i}") for i in range(4)}
    for step in range(20):
        for i, rep in enumerate(replicas):
            updates = server.updates_for(i, ["g"])
            assert sum(type(r) is HistorySeed for r in updates) == (step == 0), "the seed comes once"
            rep.apply(updates)
        for k, req in enumerate(reqs.values()):
            _grow(req, rng, rng.randint(1, 3))
            replicas[k % 2].observe(req)
            shared.observe(req)
        for i, rep in enumerate(replicas):
            server.publish(i, rep.take_updates())
    for i, rep in enumerate(replicas):
        rep.apply(server.updates_for(i, ["g"]))
        assert rep.trees.tree("g").dump() == shared.trees.tree("g").dump()
        assert rep.stats.seed_tokens == sum(map(len, earlier))
    fresh = _request("s9")
    for req in [*reqs.values(), fresh]:
        for budget, multi in ((6, False), (12, True)):
            want = shared.propose(req, budget, multi)
            assert all(rep.propose(req, budget, multi) == want for rep in replicas)
    assert shared.propose(fresh, 6, False).tokens, "a fresh response drafts from the seeds"
    assert server.stats.seeded_groups == 1
    server.finish_group("g")
    for rep in replicas:
        rep.finish_group("g")
        rep.apply([HistorySeed("g", tuple(PROMPT), ((1, 2),))])  # late: ignored
        assert len(rep.trees) == 0


def test_a_full_tree_stops_growing_and_drafts_from_the_context():
    """A C++ tree counts its weighted tokens in an int32: at the lowest history_weight a
    live token weighs 65536 and a group holds 32767 tokens. Past that the tree keeps what
    it holds (seeds too), and drafts continue a response's real context, never its stored
    sequence, which stopped short of it."""
    proposer = SuffixProposer(SpeculativeConfig(min_prob=0.0, history_weight=1 / 65536), grouped=True)
    a = _request("a", [5, 6, 7, 8] * 4000)
    proposer.observe(a)
    proposer.observe(_request("b", [9] * 20_000))  # would overflow: the tree is full
    assert proposer.trees.full("g")
    assert proposer.seed_group("g", PROMPT, [[1, 2, 3]]) == 0
    a.append_output_token(5)
    proposer.observe(a)
    assert proposer.propose(a, 3, multi_path=False).tokens == [6, 7, 8]
    proposer.finish_group("g")
    assert not proposer.trees.full("g")
