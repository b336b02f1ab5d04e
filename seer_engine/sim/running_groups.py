"""The groups a modeled instance runs rows of: whose prompt KV its rows share, and what
the acceptance model reads of them (the group's stage, how far siblings wrote ahead)."""

from __future__ import annotations

from seer_engine.sim.requests import SimRequest
from seer_engine.sim.speculation import SimSpeculation
from seer_engine.sim.world import SimWorld


class RunningGroups:
    """Rows running on one instance, by group. Siblings running together hold their
    prompt's KV blocks once (prefix caching), so ``shared_prompt`` counts the prompt
    tokens the per-row sums count too often."""

    def __init__(self) -> None:
        self.keys: dict[str, list[str]] = {}  # group -> the responses of its rows here
        self.shared_prompt = 0
        # group -> (world version, keys, rows per coverage bin): recomputed only when the
        # group's chunks or this instance's rows of it change
        self._coverage: dict[str, tuple[int, tuple[str, ...], list[int]]] = {}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.keys

    def join(self, req: SimRequest) -> None:
        keys = self.keys.setdefault(req.group_id, [])
        self.shared_prompt += req.prompt_len if keys else 0
        keys.append(req.key)

    def leave(self, req: SimRequest) -> None:
        keys = self.keys[req.group_id]
        keys.remove(req.key)
        if keys:
            self.shared_prompt -= req.prompt_len
        else:
            del self.keys[req.group_id]
            self._coverage.pop(req.group_id, None)

    def mean_stage(self, world: SimWorld) -> float:
        """The running rows' mean share of their group finished."""
        rows = sum(len(keys) for keys in self.keys.values())
        return sum(len(keys) * world.stage(g) for g, keys in self.keys.items()) / rows

    def coverage_shares(self, world: SimWorld, speculation: SimSpeculation) -> tuple[float, ...]:
        """The share of running rows in each coverage bin of the acceptance model (how far
        their siblings have written past them)."""
        counts = [0] * speculation.coverage_bins
        for g, keys in self.keys.items():
            version, members = world.versions.get(g, 0), tuple(keys)
            cached = self._coverage.get(g)
            if cached is None or cached[0] != version or cached[1] != members:
                bins = [0] * speculation.coverage_bins
                for k in keys:
                    bins[speculation.lead_bin(world.lead_share(g, k, speculation.coverage_window))] += 1
                cached = (version, members, bins)
                self._coverage[g] = cached
            for b, n in enumerate(cached[2]):
                counts[b] += n
        rows = sum(counts)
        return tuple(n / rows for n in counts)
