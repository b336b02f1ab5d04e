"""A modeled engine instance: continuous batching on a step-time model, no forward passes.

It speaks the dispatcher's instance interface (``InstanceHandle``), so the simulator
runs the engine's own dispatcher, policies, Context Manager and placement over it. The
engine below that line is modeled after the real scheduler: each step runs the decode
rows, then prefill spans within ``max_num_batched_tokens``, then admits waiting chunks in
the scheduling policy's order while sequences and KV allow. When KV runs out the
policy's victim is preempted and recomputed later (a ``cuttable`` chunk with new tokens
is cut instead); a step that preempted admits nobody new. A returning chunk finds what
is left of its context in the prefix cache (freed blocks go least recently freed
first) or pulls it from the KV pool, paying the transfer.

Between two events (a chunk ends or arrives, KV runs out, the rows' drafting changes)
every decoding row of a band (``DecodeBand``: rows whose drafts weigh alike in the draft
budget, normal or high priority) gains the same tokens per step, so a run of decode
steps has a closed form: each band's ``progress`` grows by its rows' gain per step.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, replace

from seer_engine.core.policies import SchedulingPolicy
from seer_engine.core.scheduler import SchedulerStats
from seer_engine.engine.stats import EngineStats
from seer_engine.kv_connector.base import ConnectorStats, LoadResult
from seer_engine.outputs import RequestOutput
from seer_engine.rollout.books import InstanceBooks
from seer_engine.rollout.instances.base import InstanceHandle
from seer_engine.rollout.types import ChunkRequest, InstanceInfo, StepReply
from seer_engine.sim.decode_band import EPS, DecodeBand
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.requests import Segment, SimRequest, prefill_spans
from seer_engine.sim.running_groups import RunningGroups
from seer_engine.sim.speculation import BandShape, SimSpeculation
from seer_engine.sim.world import SimWorld
from seer_engine.spec_decode.budget import StepCostModel

BANDS = 2  # decoding rows of normal and of high draft priority


class SimInstance(InstanceHandle):
    backend = "sim"

    def __init__(
        self,
        index: int,
        profile: InstanceProfile,
        world: SimWorld,
        scheduling: SchedulingPolicy,
        speculation: SimSpeculation | None = None,
        max_model_len: int = 1 << 30,
    ) -> None:
        super().__init__(index)
        self.info = InstanceInfo(profile.num_blocks, profile.block_size, profile.max_num_seqs, max_model_len)
        self.books = InstanceBooks(self.info)
        self.profile = profile
        self.world = world
        self.scheduling = scheduling
        self.speculation = speculation
        self.capacity = profile.num_blocks * profile.block_size
        self.bands = tuple(DecodeBand() for _ in range(BANDS))
        self.decoding: dict[str, SimRequest] = {}  # the rows of every band
        self.prefilling: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.cache: OrderedDict[str, int] = OrderedDict()  # response key -> context tokens, LRU first
        self.cached_tokens, self._arrivals = 0, 0
        self.prompt_groups: set[str] = set()  # groups whose prompt is in the prefix cache
        self.groups = RunningGroups(BANDS)
        self._stats = SchedulerStats()
        self._connector = ConnectorStats()
        self._loads: list[tuple[str, int, LoadResult]] = []
        self._carried_s = 0.0  # pool transfer time charged to the next step
        self._segment: Segment | None = None
        self._undelivered: list[RequestOutput] = []  # chunks that ended while catching up to an arrival
        self._elapsed = 0.0  # step time since the last reply
        self.peak_kv_tokens = 0.0  # the most KV its running rows ever held (tests check the capacity)
        self.started_at: dict[str, float] = {}  # response key -> when a step first admitted it
        self.resumed_at: dict[str, float] = {}  # response key -> when a step last admitted it

    @property
    def clock(self) -> float:
        """The time its modeled work has reached (kept in the dispatcher's books)."""
        return self.books.clock

    @clock.setter
    def clock(self, t: float) -> None:
        self.books.clock = t

    # -- the instance interface ------------------------------------------------------

    def submit(self, chunk: ChunkRequest) -> None:
        self._segment = None
        generated = len(chunk.prior_output_token_ids)
        context = len(chunk.prompt_token_ids) + generated
        true_len = self.world.lengths[chunk.sequence_id]
        end = min(chunk.params.max_tokens, true_len)
        reason = "stop" if end == true_len and true_len < self.world.max_tokens else "length"
        if chunk.load_kv:
            hit = context
            seconds = self.profile.pool_load_s(context)
            self._carried_s += seconds
            self._connector.load_s += seconds
            self._connector.loaded_blocks += -(-context // self.profile.block_size)
            self._loads.append((chunk.request_id, context, LoadResult(context, context)))
        elif chunk.sequence_id in self.cache:
            hit = self._uncache(chunk.sequence_id)
        else:
            hit = len(chunk.prompt_token_ids) if chunk.group_id in self.prompt_groups else 0
        self._arrivals += 1
        self.waiting.append(
            SimRequest(chunk.request_id, chunk.sequence_id, chunk.group_id, len(chunk.prompt_token_ids),
                       generated, end, reason, self._arrivals, hit=min(hit, context - 1),
                       cuttable=chunk.cuttable,
                       band=self.speculation.band(chunk.high_priority) if self.speculation else 0)
        )  # fmt: skip

    def abort(self, request_ids: list[str]) -> list[RequestOutput]:
        self._segment = None
        wanted = set(request_ids)
        outputs = []
        for req in [r for r in self.waiting if r.request_id in wanted]:
            self.waiting.remove(req)
            outputs.append(req.output("abort"))
        for req in [r for r in self.prefilling if r.request_id in wanted]:
            self.prefilling.remove(req)
            self.groups.leave(req)
            outputs.append(req.output("abort"))
        for rid in wanted & set(self.decoding):
            req = self._stop_decoding(rid)
            self.groups.leave(req)
            outputs.append(req.output("abort"))
        return outputs

    def call(self, method: str, *args):
        raise ValueError(f"a simulated instance has no {method!r}")

    def wait_until(self, t: float) -> None:
        """A chunk arrives at ``t``: run the work that ends by then (it joins the next step)."""
        while True:
            seg = self._plan()
            if seg is None:
                self.clock = max(self.clock, t)
                return
            if seg.end > t:
                if not seg.mixed and seg.steps > 1:
                    self._run_decode(seg, self._steps_within(seg, t - self.clock))
                return
            self._undelivered += self._commit(seg)

    def next_event_at(self) -> float:
        seg = self._plan()
        if self._undelivered:  # planning cut chunks: they end now
            return self.clock
        return seg.end if seg is not None else math.inf

    def step(self, horizon: float = math.inf) -> StepReply:
        """Run segments until a chunk ends (or the next one would pass ``horizon``, when
        another instance has an event first)."""
        outputs, self._undelivered = self._undelivered, []
        while not outputs:
            seg = self._plan()
            outputs, self._undelivered = self._undelivered, []
            if seg is None or outputs:
                break
            outputs += self._commit(seg)
            nxt = self._plan()
            if outputs or nxt is None or nxt.end > horizon:
                break
        loads, self._loads, elapsed, self._elapsed = self._loads, [], self._elapsed, 0.0
        # Rows still prefilling are where they were dispatched (the admission rule's default).
        done = {rid: int(self.bands[r.band].written(r)) for rid, r in self.decoding.items()}
        return StepReply(outputs, elapsed, self._engine_stats(), None, self._connector, loads,
                         progress=done)  # fmt: skip

    def _engine_stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.decoding) + len(self.prefilling),
            waiting=len(self.waiting),
            kv_used_blocks=min(self._running_kv(), self.capacity) / self.profile.block_size,
            kv_total_blocks=self.profile.num_blocks,
            **asdict(self._stats),
        )

    # -- planning ------------------------------------------------------------------------

    def _plan(self) -> Segment | None:
        if self._segment is None:
            self._segment = self._next_segment()
        return self._segment

    def _next_segment(self) -> Segment | None:
        stopped = self._preempt_until_growth_fits()
        decode, steady_tokens, prefill = self._next_step()
        prefilled = sum(n for _, n in prefill)
        budget = self.profile.max_num_batched_tokens - decode.decode_tokens - prefilled
        # As the engine's scheduler: a step that preempted or cut admits nobody new.
        admit = [] if stopped else self._admissible(budget, decode.growth + prefilled)
        if not prefill and not admit:
            if not decode.decoding_rows:
                return None
            return self._decode_segment(decode, steady_tokens)
        tokens = decode.decode_tokens + prefilled
        m = self.profile.step
        kv_read = self._decode_kv(decode.drafted) + sum(m.kv_read(r.computed, n) for r, n in prefill)
        for req in admit:
            n = min(req.context - req.hit, max(budget, 0))
            prefill.append((req, n))
            tokens += n
            kv_read += m.kv_read(req.hit, n)
            budget -= n
        ending = sum(r.computed + n >= r.context - EPS for r, n in prefill if r not in admit)
        ending += sum(r.hit + n >= r.context - EPS for r, n in prefill if r in admit)
        seconds = m.step_s(tokens, kv_read, decode.decode_tokens + ending) + self._carried_s
        return replace(
            decode, steps=1, seconds=seconds, end=self.clock + seconds, prefill=prefill, admit=admit
        )

    def _next_step(self) -> tuple[Segment, float, list[tuple[SimRequest, float]]]:
        """The next step's decoding rows at their rates (and for how many of their chunks'
        tokens those hold), and the spans of rows already prefilling: both take KV."""
        rows = tuple(len(band) for band in self.bands)
        gain, drafted, steady_tokens = self._rates(rows)
        decode = Segment(0, 0.0, 0.0, rows, gain, drafted)
        budget = self.profile.max_num_batched_tokens - decode.decode_tokens
        return decode, steady_tokens, prefill_spans(self.prefilling, budget)

    def _decode_segment(self, seg: Segment, steady_tokens: float) -> Segment:
        """Steps until a row ends, the KV fills or the rows' drafting changes (``seg``: the
        rows and their rates)."""
        steps = math.inf
        for band, gain in zip(self.bands, seg.gain):
            if len(band):
                steps = min(steps, math.ceil((band.first_end() - band.progress) / gain - EPS))
        if steady_tokens < math.inf:  # the rows' mean chunk tokens grow by growth / rows a step
            steps = min(steps, math.ceil(steady_tokens * seg.decoding_rows / seg.growth - EPS))
        room = self.capacity - self._running_kv()
        seg.steps = max(1, min(max(1, steps), int(room // seg.growth)))
        seg.seconds = self._decode_seconds(seg, seg.steps) + self._carried_s
        seg.end = self.clock + seg.seconds
        return seg

    def _decode_seconds(self, seg: Segment, steps: int) -> float:
        m = self.profile.step
        # KV read by the decoding rows: linear in their total context, which grows by
        # rows * gain per step in each band; per query token it is read (1 + drafted) times.
        kv_growth = sum(
            (1 + d if m.kv_per_query else 1.0) * n * g for n, g, d in zip(seg.rows, seg.gain, seg.drafted)
        )
        first = m.step_s(seg.decode_tokens, self._decode_kv(seg.drafted), seg.decode_tokens)
        return steps * first + m.c_s_per_kv_token * kv_growth * steps * (steps - 1) / 2

    def _decode_kv(self, drafted: tuple[float, ...]) -> float:
        """KV tokens the decoding rows read in one step (each of band b schedules
        1 + drafted[b] tokens)."""
        m = self.profile.step
        total = 0.0
        for band, d in zip(self.bands, drafted):
            rows, new = len(band), 1 + d
            if m.kv_per_query:
                total += new * band.context() + rows * new * (new + 1) / 2
            else:
                total += band.context() + rows * new
        return total

    def _steps_within(self, seg: Segment, seconds: float) -> int:
        """Whole steps of a decode segment that end within ``seconds``."""
        lo, hi = 0, seg.steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._decode_seconds(seg, mid) + self._carried_s <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _rates(self, rows: tuple[int, ...]) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        """Per band, (tokens gained, draft nodes) per decoding row and step, and for how
        many tokens of the rows' mean chunk they hold."""
        total = sum(rows)
        if self.speculation is None or not total:
            return (1.0,) * BANDS, (0.0,) * BANDS, math.inf
        stages = self.groups.mean_stages(self.world)
        coverage = ((1.0,),) * BANDS
        if self.speculation.uses_coverage:
            coverage = self.groups.coverage_shares(self.world, self.speculation)
        m = self.profile.step
        # The budget's line: what one more scheduled token costs (on a CPU it also
        # attends its row's context), on top of the step without drafts.
        per_token = m.b_s_per_token + (
            m.c_s_per_kv_token * self._decoding_context() / total if m.kv_per_query else 0
        )
        kv = self._decode_kv((0.0,) * BANDS)
        cost = StepCostModel(m.step_s(total, kv, total) - m.b_s_per_token * total, per_token)
        chunk_tokens = sum(band.chunk_tokens() for band in self.bands) / total  # the rows' mean, here
        shapes = tuple(BandShape(*shape) for shape in zip(rows, stages, coverage))
        rates = self.speculation.band_rates(shapes, cost, chunk_tokens)
        steady = min(r.steady_tokens for r, n in zip(rates, rows) if n)
        return tuple(1.0 + r.accepted for r in rates), tuple(r.drafted for r in rates), steady

    def _admissible(self, budget: float, growth: float) -> list[SimRequest]:
        """Waiting chunks the engine would admit this step, in its policy's order, while
        each one's KV fits (its last block part-filled, as ``_running_kv`` counts a row)."""
        if not self.waiting or budget <= 0:
            return []
        self.waiting.sort(key=self.scheduling.sort_key)
        free = self.capacity - self._running_kv() - growth
        seats = self.profile.max_num_seqs - len(self.decoding) - len(self.prefilling)
        admit = []
        for req in self.waiting:
            if budget <= 0 or seats <= 0:
                break
            req.hit = self._hit(req)
            n = min(req.context - req.hit, budget)
            shared = req.prompt_len if req.group_id in self.groups and req.hit >= req.prompt_len else 0
            need = req.hit + n - shared + self.profile.partial_block_tokens
            if need > free:
                break
            admit.append(req)
            free -= need
            budget -= n
            seats -= 1
        return admit

    def _hit(self, req: SimRequest) -> int:
        """Context tokens a waiting chunk finds in place: what it arrived with, what the prefix
        cache kept of it since it was preempted, or its group's prompt while the group's rows
        here hold it."""
        prompt = req.prompt_len if req.group_id in self.groups else 0
        return max(req.hit, min(max(self.cache.get(req.key, 0), prompt), int(req.context) - 1))

    def _preempt_until_growth_fits(self) -> bool:
        """The engine preempts its policy's victim when the next step's tokens (decoded or
        prefilled) have no KV (True if it stopped a row: preempted or cut)."""
        stopped = False
        while self.decoding or self.prefilling:
            decode, _, prefill = self._next_step()
            growth = sum(band.growth(gain) for band, gain in zip(self.bands, decode.gain))
            if self._running_kv() + growth + sum(n for _, n in prefill) <= self.capacity:
                return stopped
            stopped = True
            running = list(self.decoding.values()) + self.prefilling
            victim = self.scheduling.select_victim(running)
            if victim.cuttable and victim.request_id in self.decoding:  # it has new tokens: cut it
                self._undelivered.append(self._cut(victim))
                continue
            if victim.request_id in self.decoding:
                self._stop_decoding(victim.request_id)
                victim.lost = victim.context
            else:
                self.prefilling.remove(victim)
                victim.lost = victim.computed
            self.groups.leave(victim)
            self._cache(victim.key, int(victim.lost))  # its blocks stay in the prefix cache
            victim.hit = 0
            victim.computed = 0.0
            self.waiting.append(victim)
            self._stats.preemptions += 1
        return stopped

    # -- committing ------------------------------------------------------------------------

    def _commit(self, seg: Segment) -> list[RequestOutput]:
        outputs = self._commit_segment(seg)
        self._evict()
        return outputs

    def _commit_segment(self, seg: Segment) -> list[RequestOutput]:
        self._segment = None
        if not seg.mixed:
            return self._run_decode(seg, seg.steps)
        self._carried_s = 0.0
        self.clock = seg.end
        self._elapsed += seg.seconds
        outputs = self._advance_decoding(seg, 1)
        st = self._stats
        st.steps += 1
        st.scheduled_tokens += seg.decode_tokens + sum(n for _, n in seg.prefill)
        for req in seg.admit:
            self.started_at.setdefault(req.key, seg.end - seg.seconds)
            self.resumed_at[req.key] = seg.end - seg.seconds
            self.waiting.remove(req)
            if req.key in self.cache:  # a preempted row finds what was not evicted
                self._uncache(req.key)
            self._stats.recomputed_tokens += max(0, int(req.lost - req.hit))
            req.computed = req.hit
            self.prefilling.append(req)
            self.groups.join(req)
            self.prompt_groups.add(req.group_id)
        for req, n in seg.prefill:
            req.computed += n
        self._note_kv()
        for req, _ in seg.prefill:
            if req.computed >= req.context - EPS:  # the prompt is in: the row samples a token
                self.prefilling.remove(req)
                req.generated += 1
                st.sampled_rows += 1
                st.generated_tokens += 1
                if req.generated >= req.end - EPS:
                    outputs.append(self._end_chunk(req))
                else:
                    self._start_decoding(req)
        return outputs

    def _run_decode(self, seg: Segment, steps: int) -> list[RequestOutput]:
        """``steps`` decode steps of ``seg`` (all of it, or the part before an arrival)."""
        self._segment = None
        seconds = self._decode_seconds(seg, steps) + self._carried_s
        self._carried_s = 0.0
        self.clock += seconds
        self._elapsed += seconds
        return self._advance_decoding(seg, steps)

    def _advance_decoding(self, seg: Segment, steps: int) -> list[RequestOutput]:
        if not steps or not seg.decoding_rows:
            return []
        st = self._stats
        if not seg.mixed:
            st.steps += steps
            st.scheduled_tokens += steps * seg.decode_tokens
        written = sum(band.growth(steps * g) for band, g in zip(self.bands, seg.gain))  # none past an end
        st.sampled_rows += steps * seg.decoding_rows
        st.generated_tokens += written
        st.draft_tokens_verified += steps * sum(n * d for n, d in zip(seg.rows, seg.drafted))
        st.draft_tokens_accepted += sum(band.accepted(steps, g) for band, g in zip(self.bands, seg.gain))
        for band, gain in zip(self.bands, seg.gain):
            band.advance(steps * gain)
        self._evict()  # the rows grew into cached blocks before any of them ended
        ended = [req for band in self.bands for req in band.take_ended()]
        self._note_kv(sum(req.context for req in ended))  # at their chunks' ends, not past them
        outputs = []
        for req in ended:
            del self.decoding[req.request_id]
            outputs.append(self._end_chunk(req))
        return outputs

    def _end_chunk(self, req: SimRequest) -> RequestOutput:
        self.groups.leave(req)
        req.generated = req.end
        self.world.on_chunk_end(req.group_id, req.key, req.end)
        if req.finish_reason == "length" and req.end < self.world.lengths[req.key]:
            self._cache(req.key, int(req.context))  # the next chunk may resume here
        else:
            self.world.on_response_end(req.group_id)
        return req.output(req.finish_reason)

    def _cut(self, req: SimRequest) -> RequestOutput:
        """End a decoding chunk where it is because KV ran out: its context stays in the
        prefix cache (the pool has it too), its response goes back to the Request Buffer."""
        self._stop_decoding(req.request_id)
        self.groups.leave(req)
        self.world.on_chunk_end(req.group_id, req.key, int(req.generated))
        self._cache(req.key, int(req.context))
        self._stats.chunk_cuts += 1
        return req.output("length")

    def _note_kv(self, ended: float = 0.0) -> None:
        self.peak_kv_tokens = max(self.peak_kv_tokens, self._running_kv() + ended)

    # -- decoding rows and KV ------------------------------------------------------------

    def _start_decoding(self, req: SimRequest) -> None:
        self.decoding[req.request_id] = req
        self.bands[req.band].start(req)

    def _stop_decoding(self, rid: str) -> SimRequest:
        req = self.decoding.pop(rid)
        return self.bands[req.band].stop(rid)

    def _decoding_context(self) -> float:
        return sum(band.context() for band in self.bands)

    def _running_kv(self) -> float:
        rows = len(self.decoding) + len(self.prefilling)
        held = self._decoding_context() + sum(r.computed for r in self.prefilling)
        return held + rows * self.profile.partial_block_tokens - self.groups.shared_prompt

    def _cache(self, key: str, tokens: int) -> None:
        self.cache[key] = tokens
        self.cached_tokens += tokens

    def _evict(self) -> None:
        """Take the room running rows need from cached contexts as the engine's free list
        hands out blocks: the least recently freed first, each from its end."""
        excess = math.ceil(self.cached_tokens + self._running_kv() - self.capacity - EPS)
        while self.cache and excess > 0:
            key, tokens = next(iter(self.cache.items()))
            taken = min(tokens, excess)
            self.cache[key] = tokens - taken  # in place: its LRU rank stays
            if taken == tokens:
                self.cache.popitem(last=False)
            self.cached_tokens -= taken
            excess -= taken

    def _uncache(self, key: str) -> int:
        tokens = self.cache.pop(key)
        self.cached_tokens -= tokens
        return tokens
