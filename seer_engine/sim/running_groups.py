"""The groups a modeled instance runs rows of: whose prompt KV its rows share, and what
the acceptance model reads of them (the group's stage, how far siblings wrote ahead)."""

from __future__ import annotations

from seer_engine.sim.requests import SimRequest
from seer_engine.sim.speculation import SimSpeculation
from seer_engine.sim.world import SimWorld


class RunningGroups:
    """Rows running on one instance, by group. Siblings running together hold their
    prompt's KV blocks once (prefix caching), so ``shared_prompt`` counts the prompt
    tokens the per-row sums count too often. What the acceptance model reads is kept per
    band of rows (``SimRequest.band``: their drafts weigh alike)."""

    def __init__(self, bands: int = 1) -> None:
        self.bands = bands
        self.rows: dict[str, list[tuple[str, int]]] = {}  # group -> (response, band) of its rows here
        self._band_rows: dict[str, list[int]] = {}  # group -> its rows here per band
        self.shared_prompt = 0
        # group -> (world version, rows, rows per band and coverage bin): recomputed only
        # when the group's chunks or this instance's rows of it change
        self._coverage: dict[str, tuple[int, tuple[tuple[str, int], ...], list[list[int]]]] = {}

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.rows

    def join(self, req: SimRequest) -> None:
        rows = self.rows.setdefault(req.group_id, [])
        self.shared_prompt += req.prompt_len if rows else 0
        rows.append((req.key, req.band))
        self._band_rows.setdefault(req.group_id, [0] * self.bands)[req.band] += 1

    def leave(self, req: SimRequest) -> None:
        rows = self.rows[req.group_id]
        rows.remove((req.key, req.band))
        self._band_rows[req.group_id][req.band] -= 1
        if rows:
            self.shared_prompt -= req.prompt_len
        else:
            del self.rows[req.group_id]
            del self._band_rows[req.group_id]
            self._coverage.pop(req.group_id, None)

    def mean_stages(self, world: SimWorld) -> tuple[float, ...]:
        """Each band's running rows' mean share of their group finished (0 for a band
        with no rows)."""
        total, rows = [0.0] * self.bands, [0] * self.bands
        for g, per_band in self._band_rows.items():
            stage = world.stage(g)
            for band, n in enumerate(per_band):
                total[band] += n * stage
                rows[band] += n
        return tuple(t / n if n else 0.0 for t, n in zip(total, rows))

    def coverage_shares(self, world: SimWorld, speculation: SimSpeculation) -> tuple[tuple[float, ...], ...]:
        """Each band's share of running rows in each coverage bin of the acceptance model
        (how far their siblings have written past them); all zero for a band with no rows."""
        bins = speculation.coverage_bins
        counts = [[0] * bins for _ in range(self.bands)]
        for g, members in self.rows.items():
            version, key = world.versions.get(g, 0), tuple(members)
            cached = self._coverage.get(g)
            if cached is None or cached[0] != version or cached[1] != key:
                mine = [[0] * bins for _ in range(self.bands)]
                for k, band in members:
                    mine[band][speculation.lead_bin(world.lead_share(g, k, speculation.coverage_window))] += 1
                cached = (version, key, mine)
                self._coverage[g] = cached
            for band in range(self.bands):
                for b, n in enumerate(cached[2][band]):
                    counts[band][b] += n
        return tuple(tuple(n / max(sum(c), 1) for n in c) for c in counts)
