"""Rollout-mode options shared by ``seer_engine serve`` and ``seer_engine rollout``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from seer_engine.engine.config import EngineConfig
from seer_engine.engine.llm_engine import TokenSource
from seer_engine.kv_connector.factory import DEFAULT_LOCAL_POOL_GIB, KV_CONNECTORS, kv_pool_for
from seer_engine.rollout.placement import SEER_PULL_THRESHOLD_TOKENS, SEER_SPREAD_THRESHOLD, SeerPlacement
from seer_engine.rollout.policies import ROLLOUT_POLICIES, RolloutPolicy
from seer_engine.rollout.pool import BACKENDS, EnginePool, StepTimer

SERVABLE_POLICIES = tuple(name for name in ROLLOUT_POLICIES if name != "oracle")  # oracle needs a trace


@dataclass
class RolloutConfig:
    """``rollout_mode`` picks Seer (``seer``: divided rollout, context-aware order and
    adaptive grouped speculative decoding); without it a rollout runs veRL-style
    (``baseline``: whole groups, FCFS)."""

    rollout_mode: bool = False
    policy: str | None = None  # None: "seer" in rollout mode, else "baseline"
    instances: int = 1
    chunk_tokens: int = 8192
    starvation_s: float = 120.0
    # None: an instance per process for --instances N > 1, in this process for one.
    distributed_backend: str | None = None
    # None: "local" (shared memory on this host) when instances > 1, else "none".
    kv_connector: str | None = None
    mooncake_master: str | None = None  # HOST:PORT; None starts a master on 127.0.0.1
    kv_pool_gib: float = DEFAULT_LOCAL_POOL_GIB
    migration_spread: int = SEER_SPREAD_THRESHOLD
    pool_pull_tokens: int = SEER_PULL_THRESHOLD_TOKENS

    def __post_init__(self) -> None:
        if self.distributed_backend is None:
            self.distributed_backend = "mp" if self.instances > 1 else "inproc"
        if self.distributed_backend not in BACKENDS:
            raise ValueError(
                f"--distributed-backend must be one of {list(BACKENDS)}, got {self.distributed_backend!r}"
            )
        if self.kv_connector is None:
            self.kv_connector = "local" if self.instances > 1 else "none"
        if self.kv_connector not in KV_CONNECTORS:
            raise ValueError(
                f"--kv-connector must be one of {list(KV_CONNECTORS)}, got {self.kv_connector!r}"
            )
        if self.mooncake_master is not None and self.kv_connector != "mooncake":
            raise ValueError("--mooncake-master needs --kv-connector mooncake")
        if self.mooncake_master is not None:
            host, _, port = self.mooncake_master.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--mooncake-master must be HOST:PORT, got {self.mooncake_master!r}")
        if self.kv_pool_gib <= 0:
            raise ValueError(f"--kv-pool-gib must be > 0, got {self.kv_pool_gib}")
        if self.migration_spread < 0 or self.pool_pull_tokens < 0:
            raise ValueError("--migration-spread and --pool-pull-tokens must be >= 0")
        if self.policy is None:
            self.policy = "seer" if self.rollout_mode else "baseline"
        if self.policy not in SERVABLE_POLICIES:
            raise ValueError(f"unknown rollout policy {self.policy!r}; choose from {list(SERVABLE_POLICIES)}")
        if self.instances < 1:
            raise ValueError(f"--instances must be >= 1, got {self.instances}")
        if self.chunk_tokens < 1:
            raise ValueError(f"--chunk-tokens must be >= 1, got {self.chunk_tokens}")
        if self.starvation_s <= 0:
            raise ValueError(f"--starvation-s must be > 0, got {self.starvation_s}")

    @property
    def needs_pool(self) -> bool:
        """Whether serving needs the rollout backend rather than one plain engine."""
        return self.rollout_mode or self.instances > 1 or self.policy != "baseline"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--rollout-mode",
            action="store_true",
            help="Seer scheduling (divided rollout, context-aware order)",
        )
        parser.add_argument(
            "--rollout-policy",
            default=None,
            choices=SERVABLE_POLICIES,
            help="override the policy (default: seer with --rollout-mode, else baseline)",
        )
        parser.add_argument("--instances", type=int, default=1, help="engine instances behind one scheduler")
        parser.add_argument(
            "--chunk-tokens", type=int, default=8192, help="divided rollout: most tokens per dispatch"
        )
        parser.add_argument(
            "--starvation-s", type=float, default=120.0, help="a response waiting this long goes first"
        )
        RolloutConfig.add_cluster_args(parser)

    @staticmethod
    def add_cluster_args(parser: argparse.ArgumentParser) -> None:
        """Where instances run, the KV pool they share and Seer's placement thresholds
        (also on ``bench rollout``)."""
        parser.add_argument(
            "--distributed-backend",
            default=None,
            choices=("inproc", "mp", "ray"),
            help="where instances run: a process each (mp, the default for --instances N > 1), "
            "Ray actors (ray), or in turn in this process on simulated clocks (inproc)",
        )
        parser.add_argument(
            "--kv-connector",
            default=None,
            choices=KV_CONNECTORS,
            help="global KV pool that migrated responses load from instead of recomputing "
            "(default: local shared memory with --instances N > 1; none: recompute)",
        )
        parser.add_argument(
            "--mooncake-master",
            default=None,
            metavar="HOST:PORT",
            help="Mooncake master of --kv-connector mooncake (default: start one on 127.0.0.1)",
        )
        parser.add_argument(
            "--kv-pool-gib", type=float, default=DEFAULT_LOCAL_POOL_GIB, help="size of the KV pool"
        )
        parser.add_argument(
            "--migration-spread",
            type=int,
            default=SEER_SPREAD_THRESHOLD,
            help="place on the least-loaded instance once chunks in flight differ by more than this",
        )
        parser.add_argument(
            "--pool-pull-tokens",
            type=int,
            default=SEER_PULL_THRESHOLD_TOKENS,
            help="a moved response loads its KV from the pool when it lacks more tokens than this",
        )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RolloutConfig:
        return cls(
            rollout_mode=args.rollout_mode,
            policy=args.rollout_policy,
            instances=args.instances,
            chunk_tokens=args.chunk_tokens,
            starvation_s=args.starvation_s,
            distributed_backend=args.distributed_backend,
            kv_connector=args.kv_connector,
            mooncake_master=args.mooncake_master,
            kv_pool_gib=args.kv_pool_gib,
            migration_spread=args.migration_spread,
            pool_pull_tokens=args.pool_pull_tokens,
        )

    def placement(self) -> SeerPlacement:
        return SeerPlacement(self.migration_spread, self.pool_pull_tokens)

    def make_pool(
        self,
        config: EngineConfig,
        policy: RolloutPolicy,
        token_source: TokenSource | None = None,
        timeline_points: int | None = None,
        step_timer: StepTimer | None = None,
    ) -> EnginePool:
        """The engine pool (with its KV pool) this configuration describes; ``step_timer``
        runs it on a modeled clock."""
        kv_pool = kv_pool_for(
            self.kv_connector, config, mooncake_master=self.mooncake_master, capacity_gib=self.kv_pool_gib
        )
        return EnginePool.start(
            config, self.instances, token_source, self.distributed_backend, kv_pool, policy, timeline_points,
            step_timer,
        )  # fmt: skip
