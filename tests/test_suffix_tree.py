"""The C++ group suffix tree against its pure-Python reference, plus its contracts.

Random groups over tiny vocabularies make repeats, ties and branching common, which is
where counting, matching and tie-breaking bugs show up.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seer_engine.spec_decode._suffix_tree_ref import RefGroupSuffixTree
from seer_engine.spec_decode.suffix_tree import (
    PROMPT_KEY,
    DraftTree,
    GroupSuffixTree,  # the C++ class, re-exported
    GroupSuffixTrees,
)

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def groups(draw: st.DrawFn) -> tuple[int, int, dict[int, list[int]]]:
    """(max_depth, vocab, {seq key: tokens})."""
    max_depth = draw(st.integers(2, 8))
    vocab = draw(st.integers(1, 4))
    seqs = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=24), min_size=1, max_size=4))
    return max_depth, vocab, {key - 1: s for key, s in enumerate(seqs)}  # keys from -1


@st.composite
def contexts(draw: st.DrawFn, vocab: int, seqs: dict[int, list[int]]) -> list[int]:
    """Either random tokens or a prefix of a stored sequence (long matches)."""
    s = draw(st.sampled_from(list(seqs.values())))
    prefix = s[: draw(st.integers(0, len(s)))]
    noise = draw(st.lists(st.integers(0, vocab), max_size=10))  # `vocab` itself: unseen
    return draw(st.sampled_from([noise, prefix, prefix + noise[:1]]))


spec_args = st.tuples(
    st.integers(-1, 12),  # budget
    st.booleans(),  # multi_path
    st.sampled_from([0.0, 0.05, 0.2, 0.5]),  # min_prob
    st.sampled_from([0.0, 0.5, 1.0, 2.5]),  # max_spec_factor
    st.sampled_from([-1, 0, 1, 3, 10]),  # max_match_len
)


def build(cls: type, max_depth: int, seqs: dict[int, list[int]]) -> GroupSuffixTree | RefGroupSuffixTree:
    tree = cls(max_depth)
    for key, s in seqs.items():
        tree.add_sequence(key, s)
    return tree


def check_draft_shape(draft: tuple, budget: int, min_prob: float, max_depth: int) -> None:
    tokens, parents, probs, match_len = draft
    assert len(tokens) == len(parents) == len(probs) <= max(budget, 0)
    depth: list[int] = []
    for i, (par, p) in enumerate(zip(parents, probs, strict=True)):
        assert -1 <= par < i  # parents before children
        assert min_prob <= p <= 1.0
        if par >= 0:
            assert p <= probs[par]
        depth.append(1 if par < 0 else depth[par] + 1)
    assert match_len + max(depth, default=0) <= max_depth
    siblings = [(par, tok) for par, tok in zip(parents, tokens, strict=True)]
    assert len(set(siblings)) == len(siblings)  # no duplicate child under one parent


# -- agreement with the reference -------------------------------------------------------


@SETTINGS
@given(groups())
def test_counts_match_reference(group: tuple[int, int, dict[int, list[int]]]) -> None:
    max_depth, _, seqs = group
    tree, ref = build(GroupSuffixTree, max_depth, seqs), build(RefGroupSuffixTree, max_depth, seqs)
    assert tree.dump() == ref.dump()
    assert tree.num_nodes() == ref.num_nodes()
    assert tree.num_tokens() == ref.num_tokens() == tree.count([])
    for path, c in ref.dump():
        assert tree.count(path) == c
    assert tree.count([0] * (max_depth + 1)) == 0  # deeper than the trie


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_speculate_matches_reference(data: st.DataObject) -> None:
    max_depth, vocab, seqs = data.draw(groups())
    tree, ref = build(GroupSuffixTree, max_depth, seqs), build(RefGroupSuffixTree, max_depth, seqs)
    for _ in range(3):
        ctx = data.draw(contexts(vocab, seqs))
        args = data.draw(spec_args)
        got = tree.speculate(ctx, *args)
        assert got == ref.speculate(ctx, *args)
        check_draft_shape(got, args[0], args[2], max_depth)
        # The fast path (context = a stored sequence, no walk) gives the same draft.
        key = data.draw(st.sampled_from(list(seqs)))
        assert tree.speculate_sequence(key, *args) == ref.speculate_sequence(key, *args)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_backed_off_drafts_match_reference(data: st.DataObject) -> None:
    max_depth, vocab, seqs = data.draw(groups())
    weights = {key: data.draw(st.integers(1, 3)) for key in seqs}
    tree = build_weighted(GroupSuffixTree, max_depth, seqs, weights)
    ref = build_weighted(RefGroupSuffixTree, max_depth, seqs, weights)
    for _ in range(3):
        ctx = data.draw(contexts(vocab, seqs))
        args = (*data.draw(spec_args), data.draw(st.sampled_from([0.5, 2.0, 16.0])))
        got = tree.speculate(ctx, *args)
        assert got == ref.speculate(ctx, *args)
        key = data.draw(st.sampled_from(list(seqs)))
        assert tree.speculate_sequence(key, *args) == ref.speculate_sequence(key, *args)
        tokens, parents, probs, _ = got
        assert len(tokens) <= max(args[0], 0)
        for i, (par, p) in enumerate(zip(parents, probs, strict=True)):
            assert -1 <= par < i and args[2] <= p <= 1.0
            assert par < 0 or p <= probs[par]


def test_backed_off_drafts_follow_a_growing_and_shrinking_tree() -> None:
    """Nodes with many children keep their leaders between drafts (a cache keyed by the
    node's child total): drafts after appends and removals still equal a fresh reference."""
    rng = random.Random(7)
    tree, ref = GroupSuffixTree(12), RefGroupSuffixTree(12)
    live: list[int] = []
    for round_ in range(60):
        key = rng.randrange(6)
        tokens = [
            rng.randrange(3) if rng.random() < 0.5 else rng.randrange(40) for _ in range(rng.randint(1, 30))
        ]
        if key in live and rng.random() < 0.25:
            tree.remove_sequence(key)
            ref.remove_sequence(key)
            live.remove(key)
        elif key in live:
            tree.extend(key, tokens)
            ref.extend(key, tokens)
        else:
            weight = rng.randint(1, 3)
            tree.add_sequence(key, tokens, weight)
            ref.add_sequence(key, tokens, weight)
            live.append(key)
        for _ in range(4):
            ctx = [rng.randrange(3) for _ in range(rng.randint(1, 6))]
            args = (rng.choice([4, 16, 40, 70]), rng.random() < 0.8, rng.choice([0.0, 0.01]), 0.0, -1, 16.0)
            assert tree.speculate(ctx, *args) == ref.speculate(ctx, *args), (round_, ctx, args)
    # Token 0 follows itself and 1 and 2 with dozens of successors: the cached path ran.
    assert len({path[1] for path, _ in tree.dump() if len(path) == 2 and path[0] == 0}) > 8


def test_token_ids_past_the_root_table_match_reference() -> None:
    """The root finds its children with token ids below 2**20 in a table, larger ones in
    its own edge list: counts, dump order, drafts and removals agree with the reference
    across both, including ids at the boundary and the largest int32."""
    rng = random.Random(11)
    vocab = [0, 3, (1 << 20) - 1, 1 << 20, (1 << 20) + 7, 2**31 - 1]
    tree, ref = GroupSuffixTree(6), RefGroupSuffixTree(6)
    for key in range(4):
        tokens = [rng.choice(vocab) for _ in range(30)]
        tree.add_sequence(key, tokens, key + 1)
        ref.add_sequence(key, tokens, key + 1)
    cases = [(8, True, 0.0, 0.0, -1, 0.0), (8, True, 0.01, 0.0, -1, 16.0), (8, False, 0.0, 0.0, -1, 2.0)]
    for step in range(3):
        assert tree.dump() == ref.dump() and tree.num_nodes() == ref.num_nodes()
        assert [tree.count([t]) for t in vocab] == [ref.count([t]) for t in vocab]
        for _ in range(10):
            ctx = [rng.choice(vocab) for _ in range(rng.randint(1, 4))]
            for args in cases:
                assert tree.speculate(ctx, *args) == ref.speculate(ctx, *args), (step, ctx, args)
        tree.remove_sequence(step)
        ref.remove_sequence(step)


def test_append_extends_or_adds_with_a_weight() -> None:
    tree = GroupSuffixTree(8)
    tree.append(5, [1, 2], 3)  # new: added at weight 3
    tree.append(5, [1], 7)  # present: extended, its weight kept
    assert tree.sequence_weight(5) == 3 and tree.sequence_length(5) == 3
    assert tree.count([1]) == 6 and tree.count([1, 2, 1]) == 3
    with pytest.raises(ValueError):
        tree.append(6, [1], 0)
    assert 6 not in tree


@SETTINGS
@given(st.data())
def test_incremental_extend_equals_building_at_once(data: st.DataObject) -> None:
    max_depth, vocab, seqs = data.draw(groups())
    # Cut every sequence into chunks and interleave the extends across sequences.
    queues: dict[int, list[list[int]]] = {}
    for key, s in seqs.items():
        cuts = sorted(data.draw(st.lists(st.integers(0, len(s)), max_size=5)))
        bounds = [0, *cuts, len(s)]
        queues[key] = [s[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    rng = data.draw(st.randoms(use_true_random=False))
    inc = GroupSuffixTree(max_depth)
    while queues:
        key = rng.choice(sorted(queues))
        inc.extend(key, queues[key].pop(0))
        if not queues[key]:
            del queues[key]
    whole = build(GroupSuffixTree, max_depth, seqs)
    assert inc.dump() == whole.dump()
    assert inc.num_nodes() == whole.num_nodes()
    for key, s in seqs.items():
        assert inc.sequence_length(key) == len(s)
    ctx = data.draw(contexts(vocab, seqs))
    for multi in (False, True):
        assert inc.speculate(ctx, 8, multi, 0.0) == whole.speculate(ctx, 8, multi, 0.0)


@SETTINGS
@given(st.data())
def test_remove_sequence_equals_never_adding_it(data: st.DataObject) -> None:
    max_depth, vocab, seqs = data.draw(groups())
    gone = data.draw(st.sampled_from(list(seqs)))
    tree = build(GroupSuffixTree, max_depth, seqs)
    tree.remove_sequence(gone)
    kept = {k: s for k, s in seqs.items() if k != gone}
    ref = build(GroupSuffixTree, max_depth, kept)
    assert tree.dump() == ref.dump()
    assert tree.num_nodes() == ref.num_nodes()
    assert gone not in tree and tree.num_sequences() == len(kept)
    ctx = data.draw(contexts(vocab, seqs))
    assert tree.speculate(ctx, 6, True, 0.0) == ref.speculate(ctx, 6, True, 0.0)
    # Freed nodes are recycled: adding it back restores the original tree exactly.
    tree.add_sequence(gone, seqs[gone])
    assert tree.dump() == build(GroupSuffixTree, max_depth, seqs).dump()


# -- drafting semantics on small hand-checked examples ---------------------------------


def test_single_and_multi_path_on_a_branch() -> None:
    tree = GroupSuffixTree(16)
    tree.add_sequence(0, [5, 6, 7, 8])
    tree.add_sequence(1, [5, 6, 9, 9])
    tree.add_sequence(2, [5, 6, 7, 8])
    # Single path: most frequent child, probabilities multiply along the path.
    assert tree.speculate([1, 5, 6], 4, False, 0.0) == ([7, 8], [-1, 0], [2 / 3, 2 / 3], 2)
    # Multi-path: the 9 branch (1/3) ranks below the 7 -> 8 path (2/3 each).
    assert tree.speculate([1, 5, 6], 3, True, 0.0) == (
        [7, 8, 9],
        [-1, 0, -1],
        [2 / 3, 2 / 3, 1 / 3],
        2,
    )
    assert tree.speculate([1, 5, 6], 9, True, 0.0)[:2] == ([7, 8, 9, 9], [-1, 0, -1, 2])
    # min_prob prunes the 9 branch; a larger budget then cannot add it back.
    assert tree.speculate([1, 5, 6], 10, True, 0.5)[0] == [7, 8]
    # Equal probabilities: the smaller token wins.
    tree.add_sequence(3, [5, 6, 9, 9])
    assert tree.speculate([5, 6], 1, False, 0.0)[0] == [7]


def test_backoff_doubts_a_deep_match_seen_once() -> None:
    tree = GroupSuffixTree(16)
    tree.add_sequence(0, [1, 2, 3, 7])  # [1, 2, 3] went on with 7 once
    for key in range(1, 5):
        tree.add_sequence(key, [9, 3, 8])  # [3] went on with 8 four times
    # The longest match alone: [1, 2, 3] -> 7 is certain, and 8 is never drafted.
    assert tree.speculate([1, 2, 3], 2, True, 0.0) == ([7], [-1], [1.0], 3)
    # Backed off (b = 4): p_1 = {8: 4/9, 7: 1/9}; p_2 = p_3 = (count + 4 p_1) / (1 + 4).
    tokens, parents, probs, match = tree.speculate([1, 2, 3], 2, True, 0.0, 0.0, -1, 4.0)
    p1_7, p1_8 = 1 / 9, 4 / 9
    p2_7, p2_8 = (1 + 4 * p1_7) / 5, 4 * p1_8 / 5
    assert (tokens, parents, match) == ([7, 8], [-1, -1], 3)
    assert probs == pytest.approx([(1 + 4 * p2_7) / 5, 4 * p2_8 / 5])
    # Nothing ever follows 7 or 8, so a larger budget adds no node.
    assert tree.speculate([1, 2, 3], 5, True, 0.0, 0.0, -1, 4.0)[0] == [7, 8]
    # A heavy backoff lets the well-attested 8 outrank the deep match.
    assert tree.speculate([1, 2, 3], 1, False, 0.0, 0.0, -1, 1000.0)[0] == [8]


def test_match_is_longest_suffix_with_a_continuation() -> None:
    tree = GroupSuffixTree(8)
    tree.add_sequence(0, [1, 2, 3, 4, 9])
    tree.add_sequence(1, [7, 3, 4, 5])
    # [2, 3, 4] occurs and continues with 9; [7, 3, 4] would match the other sequence.
    assert tree.speculate([2, 3, 4], 1, False, 0.0) == ([9], [-1], [1.0], 3)
    assert tree.speculate([7, 3, 4], 1, False, 0.0) == ([5], [-1], [1.0], 3)
    assert tree.speculate([0, 3, 4], 2, True, 0.0) == ([5, 9], [-1, -1], [0.5, 0.5], 2)
    # A suffix that occurs only at a sequence's end has no continuation: shorter match.
    assert tree.speculate([4, 5], 1, False, 0.0)[3] == 0
    assert tree.speculate([3, 4, 9], 1, False, 0.0)[3] == 0
    # max_match_len caps the match; max_spec_factor caps the draft by the match.
    # [3] -> 4 always, then [3, 4] -> 5 or 9 (tie: the smaller token).
    assert tree.speculate([1, 2, 3], 4, False, 0.0, 0.0, 1) == ([4, 5], [-1, 0], [1.0, 0.5], 1)
    assert tree.speculate([1, 2], 4, False, 0.0, 1.0)[0] == [3, 4]
    assert tree.speculate([], 4, False, 0.0) == ([], [], [], 0)
    assert GroupSuffixTree(8).speculate([1, 2], 4, True, 0.0) == ([], [], [], 0)


def test_own_trailing_occurrence_does_not_dilute_probabilities() -> None:
    # The requester's own sequence ends with the context; only continuations count.
    tree = GroupSuffixTree(8)
    tree.add_sequence(0, [1, 2, 3])
    tree.add_sequence(1, [1, 2])
    assert tree.count([1, 2]) == 2
    assert tree.speculate([1, 2], 1, False, 0.9) == ([3], [-1], [1.0], 2)


# -- group vs per-request trees ---------------------------------------------------------


def test_group_tree_drafts_a_siblings_continuation_per_request_tree_does_not() -> None:
    prompt = [1, 2, 3, 4]
    sibling = [10, 11, 12, 13, 14, 15, 16]
    mine = [10, 11, 12]
    trees = GroupSuffixTrees(max_depth=32, min_prob=0.1)
    # Seer: one tree per group holds the prompt and every sibling's output.
    trees.append("g", PROMPT_KEY, prompt)
    trees.append("g", 0, sibling)
    trees.append("g", 1, mine)
    draft = trees.speculate("g", prompt + mine, budget=4)
    assert draft == DraftTree([13, 14, 15, 16], [-1, 0, 1, 2], [1.0] * 4, 3)
    assert trees.speculate_sequence("g", 1, budget=4) == draft
    # Per-request baseline: the same class, a tree holding one request's own tokens.
    trees.append(("req", 1), PROMPT_KEY, prompt)
    trees.append(("req", 1), 1, mine)
    assert len(trees.speculate(("req", 1), prompt + mine, budget=4)) == 0
    assert len(trees.speculate_sequence(("req", 1), 1, budget=4)) == 0
    # ...which still drafts from the request's own repetitions.
    trees.append(("req", 1), 1, [7, 10, 11])
    own = trees.speculate(("req", 1), prompt + mine + [7, 10, 11], budget=2)
    assert own.tokens == [12, 7] and own.match_len == 2


def test_wrapper_trims_context_and_accepts_arrays() -> None:
    np = pytest.importorskip("numpy")
    trees = GroupSuffixTrees(max_depth=8, max_match_len=3)
    trees.append(7, 0, np.array([1, 2, 3, 4, 5, 1, 2, 3, 4, 6], dtype=np.int64))
    long_ctx = list(range(100, 200)) + [2, 3, 4]
    draft = trees.speculate(7, np.array(long_ctx), budget=1, min_prob=0.0)
    assert draft.match_len == 3 and draft.tokens == [5]
    assert trees.speculate(7, long_ctx, 1, max_match_len=1).match_len == 1
    assert trees.speculate("unknown", long_ctx, 4) == DraftTree()
    assert trees.speculate_sequence(7, 1, 4) == DraftTree()  # no such sequence yet
    trees.append(7, 1, np.array([9, 2, 3]))
    own = trees.speculate_sequence(7, 1, 4, max_match_len=2)
    assert own.match_len == 2 and own.tokens[0] == 4
    assert own == trees.speculate(7, [9, 2, 3], 4, max_match_len=2)
    assert trees.speculate(7, long_ctx, 0) == DraftTree([], [], [], 3)


def test_free_drops_the_tree() -> None:
    trees = GroupSuffixTrees(max_depth=8)
    trees.append("a", 0, [1, 2, 3, 1, 2, 3])
    trees.append("b", 0, [4, 5, 6])
    nodes_b = trees.tree("b").num_nodes()
    trees.free("a")
    assert "a" not in trees and len(trees) == 1
    assert trees.num_nodes() == nodes_b
    assert trees.speculate("a", [1, 2], 2) == DraftTree()
    trees.free("a")  # idempotent
    trees.append("a", 0, [9])  # a fresh tree, nothing left of the old one
    assert trees.tree("a").num_tokens() == 1 and trees.tree("a").count([1]) == 0
    trees.remove_sequence("b", 0)
    assert trees.tree("b").num_nodes() == 1


# -- memory, cost and input checks ------------------------------------------------------


def test_node_count_is_bounded_and_shared() -> None:
    rng = random.Random(0)
    depth = 16
    tree = GroupSuffixTree(depth)
    seqs = [[rng.randrange(50) for _ in range(2000)] for _ in range(3)]
    for key, s in enumerate(seqs):
        tree.add_sequence(key, s)
    bound = 1 + sum(min(depth, len(s) - i) for s in seqs for i in range(len(s)))
    assert tree.num_nodes() <= bound
    assert tree.memory_bytes() < 64 * tree.num_nodes()  # 12 B per node plus edge lists
    # Identical siblings share every node: only counts grow.
    shared = GroupSuffixTree(depth)
    for key in range(8):
        shared.add_sequence(key, seqs[0])
    one = GroupSuffixTree(depth)
    one.add_sequence(0, seqs[0])
    assert shared.num_nodes() == one.num_nodes()
    assert shared.count(seqs[0][:5]) == 8 * one.count(seqs[0][:5])


def test_appending_one_token_does_not_rebuild() -> None:
    tree = GroupSuffixTree(64)
    rng = random.Random(1)
    tokens = [rng.randrange(1000) for _ in range(40_000)]
    t0 = time.perf_counter()
    for t in tokens:
        tree.extend(0, [t])
    elapsed = time.perf_counter() - t0
    assert tree.sequence_length(0) == len(tokens)
    # O(max_depth) per token: ~2.5M trie steps.  A rebuild per token would be ~1e11.
    assert elapsed < 5.0, elapsed


def test_bad_input_raises_clear_errors() -> None:
    with pytest.raises(ValueError, match="max_depth"):
        GroupSuffixTree(1)
    with pytest.raises(ValueError, match="max_depth"):
        GroupSuffixTrees(max_depth=0)
    tree = GroupSuffixTree(8)
    with pytest.raises(ValueError, match="token ids"):
        tree.extend(0, [1, -2])
    assert 0 not in tree  # rejected before anything was stored
    tree.add_sequence(1, [1])
    with pytest.raises(KeyError):
        tree.add_sequence(1, [2])
    with pytest.raises(KeyError):
        tree.remove_sequence(99)
    with pytest.raises(TypeError):
        tree.extend(0, [2**40])


# -- weighted sequences -----------------------------------------------------------------


@st.composite
def weighted_groups(draw: st.DrawFn) -> tuple[int, int, dict[int, list[int]], dict[int, int]]:
    """``groups()`` with a weight per sequence."""
    max_depth, vocab, seqs = draw(groups())
    return max_depth, vocab, seqs, {key: draw(st.integers(1, 5)) for key in seqs}


def build_weighted(
    cls: type, max_depth: int, seqs: dict[int, list[int]], weights: dict[int, int]
) -> GroupSuffixTree | RefGroupSuffixTree:
    tree = cls(max_depth)
    for key, s in seqs.items():
        tree.add_sequence(key, s, weights[key])
    return tree


@SETTINGS
@given(st.data())
def test_weighted_tree_matches_reference_and_copies(data: st.DataObject) -> None:
    max_depth, vocab, seqs, weights = data.draw(weighted_groups())
    tree = build_weighted(GroupSuffixTree, max_depth, seqs, weights)
    ref = build_weighted(RefGroupSuffixTree, max_depth, seqs, weights)
    assert tree.dump() == ref.dump()
    assert tree.count([]) == ref.count([]) == sum(len(s) * weights[k] for k, s in seqs.items())
    assert tree.num_tokens() == sum(len(s) for s in seqs.values())
    assert all(tree.sequence_weight(k) == w for k, w in weights.items())
    # A sequence of weight k counts exactly as k copies of it would.
    copies = GroupSuffixTree(max_depth)
    next_key = 100
    for key, s in seqs.items():
        for _ in range(weights[key]):
            copies.add_sequence(next_key, s)
            next_key += 1
    assert tree.dump() == copies.dump()
    for _ in range(3):
        ctx = data.draw(contexts(vocab, seqs))
        args = data.draw(spec_args)
        got = tree.speculate(ctx, *args)
        assert got == ref.speculate(ctx, *args) == copies.speculate(ctx, *args)
        key = data.draw(st.sampled_from(list(seqs)))
        assert tree.speculate_sequence(key, *args) == ref.speculate_sequence(key, *args)


@SETTINGS
@given(st.data())
def test_weighted_extend_and_remove(data: st.DataObject) -> None:
    max_depth, vocab, seqs, weights = data.draw(weighted_groups())
    # Extending keeps the weight the sequence was added with.
    inc = GroupSuffixTree(max_depth)
    for key, s in seqs.items():
        half = len(s) // 2
        inc.add_sequence(key, s[:half], weights[key])
        inc.extend(key, s[half:])
    assert inc.dump() == build_weighted(GroupSuffixTree, max_depth, seqs, weights).dump()
    gone = data.draw(st.sampled_from(list(seqs)))
    inc.remove_sequence(gone)
    kept = {k: s for k, s in seqs.items() if k != gone}
    assert inc.dump() == build_weighted(GroupSuffixTree, max_depth, kept, weights).dump()
    assert inc.count([]) == sum(len(s) * weights[k] for k, s in kept.items())


def test_a_light_sequence_yields_to_a_heavy_one() -> None:
    tree = GroupSuffixTree(8)
    tree.add_sequence(0, [1, 2, 3], 4)  # a live sibling
    tree.add_sequence(1, [1, 2, 5], 1)  # three earlier responses, each a quarter as heavy
    tree.add_sequence(2, [1, 2, 5], 1)
    tree.add_sequence(3, [1, 2, 5], 1)
    assert tree.speculate([1, 2], 2, True, 0.0) == ([3, 5], [-1, -1], [4 / 7, 3 / 7], 2)
    alone = GroupSuffixTree(8)
    alone.add_sequence(1, [1, 2, 5], 1)
    assert alone.speculate([1, 2], 1, False, 0.0) == ([5], [-1], [1.0], 2)  # history drafts alone


def test_bad_weights_raise_clear_errors() -> None:
    tree = GroupSuffixTree(8)
    for bad in (0, -1, (1 << 16) + 1):
        with pytest.raises(ValueError, match="weight"):
            tree.add_sequence(0, [1, 2], bad)
    assert 0 not in tree
    tree.add_sequence(0, [1] * 1000, 1 << 16)
    with pytest.raises(ValueError, match="overflow"):
        tree.add_sequence(1, [1] * 40_000, 1 << 16)
    assert 1 not in tree and tree.num_tokens() == 1000  # rejected before anything was stored
    with pytest.raises(KeyError):
        tree.sequence_weight(5)
