"""Whether a rollout chunk fits an instance: the Request Buffer's admission rules.

A divided chunk has a known worst case: its response's context grows by at most the
chunk's tokens, then the chunk ends and gives its KV back (to the prefix cache and
the pool). A rule admits a chunk only where its worst case fits, so the engines
never preempt:

- ``reserve``: every chunk in flight holds its end-of-chunk footprint (prompt +
  output so far + the chunk) from dispatch to its end; a group's prompt blocks are
  held once per instance (siblings share them in the prefix cache).
  ``reserve-per-response`` holds the prompt once per response.
- ``peak``: what chunks really hold over time. Decoding rows of an instance gain the
  same tokens per step, so chunks in flight grow in step and free their KV when they
  end: the instance's future use is ``sum(now_i + t)`` over the chunks still running
  at ``t``, peaking just before one ends. A chunk is admitted where that peak, with
  it, fits. Chunks dispatched at different times end at different times, so the peak
  is well below the sum of the end footprints. It reads each chunk's progress from
  the instance's replies (``StepReply.progress``); a stale progress only makes it
  more careful. Rows that advance unevenly (speculative decoding on a real engine)
  can exceed the estimate; the engine then preempts as it would anyway.
- ``peak:N``: the peak over the next N tokens of growth only. Chunks may then
  outgrow the instance, which ends one of them early (a chunk cut: finish reason
  "length", its KV kept in the prefix cache and the pool, the response back in the
  buffer) instead of preempting it: ``core/scheduler.py`` for a chunk that has new
  tokens (one still in its prefill is preempted), ``sim/instance.py`` when modeled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from seer_engine.rollout.books import InstanceBooks
from seer_engine.rollout.types import RolloutSample

ADMISSION_RULES = ("reserve", "reserve-per-response", "peak", "peak:TOKENS")


class Admission:
    """A rule that admits a chunk ``start -> end`` (output tokens) onto an instance."""

    name = "abstract"
    may_overflow = False  # chunks may outgrow the instance, which then cuts them
    share_prompts = True

    def prompt_blocks(self, books: InstanceBooks, sample: RolloutSample) -> int:
        """Full blocks of the sample's prompt, held once per group and instance."""
        return len(sample.group.prompt_token_ids) // books.info.block_size if self.share_prompts else 0

    def footprint(self, books: InstanceBooks, sample: RolloutSample, end: int) -> int:
        """Blocks the chunk adds to the instance's end-of-chunk footprints."""
        whole = books.info.blocks_needed(len(sample.group.prompt_token_ids) + end)
        return whole - (
            self.prompt_blocks(books, sample) if sample.group.group_id in books.group_chunks else 0
        )

    def fits(self, books: InstanceBooks, sample: RolloutSample, start: int, end: int) -> bool:
        raise NotImplementedError


class ReserveAdmission(Admission):
    """Each chunk holds its end-of-chunk footprint until it ends."""

    def __init__(self, share_prompts: bool = True) -> None:
        self.share_prompts = share_prompts
        self.name = "reserve" if share_prompts else "reserve-per-response"

    def fits(self, books: InstanceBooks, sample: RolloutSample, start: int, end: int) -> bool:
        return self.footprint(books, sample, end) <= books.free_blocks


@dataclass
class _Outlook:
    held: float  # prompts (once per group) and a partial block per group
    rem: np.ndarray  # tokens each chunk still grows, ascending
    use: np.ndarray  # the instance's KV just before chunk j ends
    before: np.ndarray  # running max of use + rem over chunks ending first (the peak with a new chunk after)
    after: np.ndarray  # running max of use over chunks ending last


class PeakAdmission(Admission):
    """Admit a chunk where the instance's peak future KV use, with it, fits."""

    name = "peak"

    def __init__(
        self, horizon_tokens: int | None = None, slack_tokens: int = 256, headroom: float = 0.98
    ) -> None:
        """``horizon_tokens``: look only this far ahead (chunks may outgrow the instance,
        which cuts them). ``slack_tokens``: growth allowed beyond a chunk's end (a new
        chunk waits for its prefill while the others decode). ``headroom``: the share of
        the instance's KV the peak may reach."""
        if horizon_tokens is not None and horizon_tokens < 1:
            raise ValueError(f"the peak horizon must be >= 1 token, got {horizon_tokens}")
        self.horizon = horizon_tokens
        self.slack_tokens = slack_tokens
        self.headroom = headroom
        self.may_overflow = horizon_tokens is not None
        if horizon_tokens is not None:
            self.name = f"peak:{horizon_tokens}"

    def chunk_end(self, sample: RolloutSample, end: int) -> int:
        """Where the chunk is taken to end: at its limit (an online rule cannot know more)."""
        return end

    def _cap(self, remaining: float) -> float:
        return remaining if self.horizon is None else min(remaining, self.horizon)

    def _outlook(self, books: InstanceBooks) -> _Outlook:
        if isinstance(books.outlook, _Outlook):
            return books.outlook
        bs = books.info.block_size
        prompts: dict[str, int] = {}
        now, rem = [], []
        for rid, c in books.in_flight.items():
            gid = c.sample.group.group_id
            prompts[gid] = max(prompts.get(gid, 0), len(c.sample.group.prompt_token_ids))
            done = max(c.start, min(c.end, books.progress.get(rid, c.start)))
            now.append(done + bs)  # a partial block per row
            rem.append(self._cap(self.chunk_end(c.sample, c.end) - done + self.slack_tokens))
        held = float(sum(prompts.values()) + bs * len(prompts))
        order = np.argsort(np.asarray(rem, dtype=np.float64), kind="stable")
        r = np.asarray(rem, dtype=np.float64)[order]
        n = np.asarray(now, dtype=np.float64)[order]
        tail_now = np.cumsum(n[::-1])[::-1]  # now summed over the chunks that end no earlier than j
        active = np.arange(len(r), 0, -1, dtype=np.float64)
        use = held + tail_now + active * r
        before = np.maximum.accumulate(use + r) if len(r) else use
        after = np.maximum.accumulate(use[::-1])[::-1] if len(r) else use
        books.outlook = _Outlook(held, r, use, before, after)
        return books.outlook

    def peak(
        self, books: InstanceBooks, sample: RolloutSample | None = None, start: int = 0, end: int = 0
    ) -> float:
        """The instance's peak future KV use (tokens), with the chunk ``start -> end`` of
        ``sample`` added (``sample`` None: as it is)."""
        o = self._outlook(books)
        if sample is None:
            return float(max(o.held, o.use.max() if len(o.use) else o.held))
        bs = books.info.block_size
        gid = sample.group.group_id
        extra = 0 if gid in books.group_chunks else len(sample.group.prompt_token_ids) + bs
        n_now = start + bs
        n_rem = self._cap(self.chunk_end(sample, end) - start + self.slack_tokens)
        k = int(np.searchsorted(o.rem, n_rem, side="left"))  # chunks 0..k-1 end before the new one
        best = o.held + extra + n_now
        if k:
            # Just before chunk j < k ends the new chunk has grown by rem_j too.
            best = max(best, float(o.before[k - 1]) + extra + n_now)
        # Just before the new chunk ends, the chunks that end no earlier have grown by n_rem.
        growing = len(o.rem) - k
        tail_now = float(o.use[k] - o.held - growing * o.rem[k]) if growing else 0.0
        best = max(best, o.held + extra + tail_now + growing * n_rem + n_now + n_rem)
        if growing:  # later, the new chunk has ended
            best = max(best, float(o.after[k]) + extra)
        return best

    def fits(self, books: InstanceBooks, sample: RolloutSample, start: int, end: int) -> bool:
        """Where every end-of-chunk footprint fits (``reserve``), the peak does too."""
        if self.footprint(books, sample, self.chunk_end(sample, end)) <= books.free_blocks:
            return True
        capacity = books.info.num_blocks * books.info.block_size * self.headroom
        return self.peak(books, sample, start, end) <= capacity


def make_admission(name: str, also_known: Sequence[str] = ()) -> Admission:
    """``reserve``, ``reserve-per-response``, ``peak`` or ``peak:TOKENS``; ``also_known``: rules
    the caller builds itself, named among the choices when ``name`` is none of them."""
    if name == "reserve":
        return ReserveAdmission(share_prompts=True)
    if name == "reserve-per-response":
        return ReserveAdmission(share_prompts=False)
    if name == "peak":
        return PeakAdmission()
    if name.startswith("peak:"):
        horizon = name.split(":", 1)[1]
        if not horizon.isdigit() or int(horizon) < 1:
            raise ValueError(f"admission peak:TOKENS needs a positive number of tokens, got {horizon!r}")
        return PeakAdmission(horizon_tokens=int(horizon))
    raise ValueError(
        f"unknown admission rule {name!r}; choose from {', '.join((*ADMISSION_RULES, *also_known))}"
    )
