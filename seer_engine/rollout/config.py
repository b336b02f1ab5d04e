"""Rollout-mode options shared by ``seer_engine serve`` and ``seer_engine rollout``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from seer_engine.core.numbers import is_real
from seer_engine.engine.config import EngineConfig
from seer_engine.engine.input_processor import InputProcessor
from seer_engine.engine.llm_engine import TokenSource
from seer_engine.kv_connector.factory import DEFAULT_LOCAL_POOL_GIB, KV_CONNECTORS, kv_pool_for
from seer_engine.kv_connector.mooncake.common import split_address
from seer_engine.rollout.context_manager import DEFAULT_STARVATION_S, ORDERS, add_context_order_arg
from seer_engine.rollout.history import HistoryStore, vocab_fingerprint
from seer_engine.rollout.placement import SEER_PULL_THRESHOLD_TOKENS, SEER_SPREAD_THRESHOLD, SeerPlacement
from seer_engine.rollout.policies import (
    HISTORY_POLICIES,
    HISTORY_SUFFIX,
    ROLLOUT_POLICIES,
    RolloutPolicy,
    make_rollout_policy,
)
from seer_engine.rollout.pool import BACKENDS, ClockProfile, EnginePool
from seer_engine.rollout.report import writable_dir

# An instance process or actor that answers no step in this long is taken as hung
# (stopped, deadlocked): killed, its responses finish elsewhere. A step is a forward
# pass plus its KV pool loads and saves: seconds at most on a healthy instance.
DEFAULT_INSTANCE_TIMEOUT_S = 300.0
# A weight update or wake-up loads a checkpoint, which for a large model from a slow
# disk takes minutes: it has a limit of its own.
DEFAULT_INSTANCE_LOAD_TIMEOUT_S = 1800.0

# oracle needs a trace
SERVABLE_POLICIES = tuple(name for name in ROLLOUT_POLICIES if name != "oracle") + HISTORY_POLICIES
HISTORY_FILE = "history.json"  # the store's file in a --history directory


# RolloutConfig fields that only the rollout backend reads, and their flags.
_BACKEND_FLAGS = {
    "chunk_tokens": "--chunk-tokens", "starvation_s": "--starvation-s", "context_order": "--context-order",
    "distributed_backend": "--distributed-backend", "kv_connector": "--kv-connector",
    "mooncake_master": "--mooncake-master", "kv_pool_gib": "--kv-pool-gib",
    "migration_spread": "--migration-spread", "pool_pull_tokens": "--pool-pull-tokens",
    "instance_timeout_s": "--instance-timeout", "instance_load_timeout_s": "--instance-load-timeout",
}  # fmt: skip


def history_help(default: str) -> str:
    return (
        "the cross-iteration history store (per prompt: earlier responses' lengths and capped "
        "token sequences), shared by every instance: grouped drafts are seeded from it, +history "
        "policies rank by it. off, memory, or a directory it is loaded from and saved to "
        f"({HISTORY_FILE}); {default}"
    )


def open_history(spec: str, half_life: float | None = None) -> HistoryStore | None:
    """``off``: None; ``memory``: a fresh store; else a directory: the store saved there
    (``HISTORY_FILE``), or a fresh one if there is none yet. ``half_life`` is this run's
    (None: no decay), whatever the run that saved the store had."""
    if spec == "off":
        return None
    if spec != "memory":
        path = writable_dir(spec, "--history") / HISTORY_FILE  # before any instance loads
        if path.is_file():
            store = HistoryStore.load(path)
            store.half_life = half_life
            return store
    return HistoryStore(half_life_iterations=half_life)


def save_history(store: HistoryStore | None, spec: str) -> Path | None:
    """Write the store into its ``--history`` directory (nothing for off / memory)."""
    if store is None or spec in ("off", "memory"):
        return None
    directory = Path(spec).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise ValueError(f"cannot save the history store in --history {spec!r}: {e}") from None
    store.save(directory / HISTORY_FILE)
    return directory / HISTORY_FILE


def bind_history(store: HistoryStore | None, spec: str, processor: InputProcessor) -> None:
    """Tie the store to the model's tokenizer (one kept under another tokenizer, or holding
    ids beyond the model's vocabulary, is refused: its drafts would be other tokens) and
    save it once, so a ``--history`` directory that cannot be written fails at startup."""
    if store is None:
        return
    try:
        store.bind_tokenizer(vocab_fingerprint(processor.tokenizer.vocab()), processor.vocab_size)
    except ValueError as e:
        raise ValueError(f"--history {spec}: {e}") from None
    save_history(store, spec)


@dataclass
class RolloutConfig:
    """``rollout_mode`` picks Seer (``seer``: divided rollout, context-aware order and
    adaptive grouped speculative decoding); without it a rollout runs veRL-style
    (``baseline``: whole groups, FCFS)."""

    rollout_mode: bool = False
    policy: str | None = None  # None: "seer" in rollout mode, else "baseline"
    instances: int = 1
    chunk_tokens: int = 8192
    starvation_s: float = DEFAULT_STARVATION_S
    context_order: str = "auto"  # the Context Manager's (context_manager.ORDERS)
    # None: an instance per process for --instances N > 1, in this process for one.
    distributed_backend: str | None = None
    # None: "local" (shared memory on this host) when instances > 1, else "none".
    kv_connector: str | None = None
    mooncake_master: str | None = None  # HOST:PORT; None starts a master on 127.0.0.1
    kv_pool_gib: float = DEFAULT_LOCAL_POOL_GIB
    migration_spread: int = SEER_SPREAD_THRESHOLD
    pool_pull_tokens: int = SEER_PULL_THRESHOLD_TOKENS
    # "off", "memory" or a directory; None: off, unless the policy ranks by history
    # (then under the server's data dir, or in memory).
    history: str | None = None
    history_half_life: float | None = None  # iterations (weight updates) that halve a length's say
    instance_timeout_s: float = DEFAULT_INSTANCE_TIMEOUT_S
    instance_load_timeout_s: float = DEFAULT_INSTANCE_LOAD_TIMEOUT_S

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
            try:
                split_address(self.mooncake_master)
            except ValueError as e:
                raise ValueError(f"--mooncake-master: {e}") from None
        if not (is_real(self.kv_pool_gib) and self.kv_pool_gib > 0):
            raise ValueError(f"--kv-pool-gib must be a finite number > 0, got {self.kv_pool_gib}")
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
        for flag, value in (
            ("--instance-timeout", self.instance_timeout_s),
            ("--instance-load-timeout", self.instance_load_timeout_s),
        ):
            if not (is_real(value) and value > 0):  # NaN would never time out
                raise ValueError(f"{flag} must be a finite number > 0, got {value}")
        if not (is_real(self.starvation_s) and self.starvation_s > 0):
            raise ValueError(f"--starvation-s must be a finite number > 0, got {self.starvation_s}")
        if self.context_order not in ORDERS:
            raise ValueError(f"--context-order must be one of {list(ORDERS)}, got {self.context_order!r}")
        if self.history == "":
            raise ValueError("--history must be off, memory or a directory, got ''")
        if self.history_half_life is not None and not self.history_half_life > 0:
            raise ValueError(f"--history-half-life must be > 0, got {self.history_half_life}")
        if self.history == "off" and self.policy.endswith(HISTORY_SUFFIX):
            raise ValueError(f"policy {self.policy!r} ranks by the history store: it needs --history on")
        if self.history_half_life is not None and self.history_spec() == "off":
            raise ValueError(
                "--history-half-life decays the history store's lengths: it needs --history memory or DIR "
                "(or a +history policy)"
            )

    def history_spec(self, data_dir: Path | None = None) -> str:
        """What ``--history`` resolves to: off, memory or a directory (the default for a
        +history policy: ``data_dir/history`` in server mode, else memory)."""
        if self.history is not None:
            return self.history
        if not self.policy.endswith(HISTORY_SUFFIX):
            return "off"
        return str(Path(data_dir).expanduser() / "history") if data_dir is not None else "memory"

    def open_history(self, data_dir: Path | None = None) -> HistoryStore | None:
        return open_history(self.history_spec(data_dir), self.history_half_life)

    @property
    def needs_pool(self) -> bool:
        """Whether serving needs the rollout backend rather than one plain engine."""
        history = self.history not in (None, "off")
        return self.rollout_mode or self.instances > 1 or self.policy != "baseline" or history

    def unused_flags(self) -> list[str]:
        """The rollout backend's flags set away from their defaults where serving runs one
        plain engine (``needs_pool`` false), which reads none of them."""
        if self.needs_pool:
            return []
        default = RolloutConfig()
        return [
            flag for field, flag in _BACKEND_FLAGS.items() if getattr(self, field) != getattr(default, field)
        ]

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
            help="override the policy (default: seer with --rollout-mode, else baseline; +history: "
            "ranked with the history store's lengths as each group's prior)",
        )
        parser.add_argument(
            "--history",
            default=None,
            metavar="off|memory|DIR",
            help=history_help("default: off, or for a +history policy DATA_DIR/history when serving, "
                              "else memory"),
        )  # fmt: skip
        parser.add_argument(
            "--history-half-life",
            type=float,
            default=None,
            help="a length in the history store says half as much after this many weight updates "
            "(default: no decay)",
        )
        parser.add_argument("--instances", type=int, default=1, help="engine instances behind one scheduler")
        parser.add_argument(
            "--chunk-tokens", type=int, default=8192, help="divided rollout: most tokens per dispatch"
        )
        parser.add_argument(
            "--starvation-s",
            type=float,
            default=DEFAULT_STARVATION_S,
            help="a response waiting this long goes first",
        )
        add_context_order_arg(parser)
        parser.add_argument(
            "--instance-timeout",
            type=float,
            default=DEFAULT_INSTANCE_TIMEOUT_S,
            help="seconds an instance process or actor may take to answer a step, an abort or a "
            "serving call (sleep, cache reset) before it is taken as hung: killed, its responses "
            "finish on the other instances",
        )
        parser.add_argument(
            "--instance-load-timeout",
            type=float,
            default=DEFAULT_INSTANCE_LOAD_TIMEOUT_S,
            help="as --instance-timeout, for the calls that load weights (a weight update, a wake-up)",
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
            context_order=args.context_order,
            distributed_backend=args.distributed_backend,
            kv_connector=args.kv_connector,
            mooncake_master=args.mooncake_master,
            kv_pool_gib=args.kv_pool_gib,
            migration_spread=args.migration_spread,
            pool_pull_tokens=args.pool_pull_tokens,
            history=args.history,
            history_half_life=args.history_half_life,
            instance_timeout_s=args.instance_timeout,
            instance_load_timeout_s=args.instance_load_timeout,
        )

    def make_policy(self, history: HistoryStore | None = None) -> RolloutPolicy:
        """The rollout policy this configuration names; ``history``: the store a
        ``+history`` policy ranks by (``open_history``)."""
        return make_rollout_policy(
            self.policy, starvation_s=self.starvation_s, history=history, order=self.context_order
        )

    def placement(self) -> SeerPlacement:
        return SeerPlacement(self.migration_spread, self.pool_pull_tokens)

    def make_pool(
        self,
        config: EngineConfig,
        policy: RolloutPolicy,
        token_source: TokenSource | None = None,
        clock: ClockProfile | None = None,
        history: HistoryStore | None = None,
        timeline_points: int | None = None,
    ) -> EnginePool:
        """The engine pool (with its KV pool) this configuration describes; ``clock``: a
        profile whose step times and pool transfers run it on a modeled clock;
        ``history``: the store it fills and seeds drafts from."""
        kv_pool = kv_pool_for(
            self.kv_connector, config, mooncake_master=self.mooncake_master, capacity_gib=self.kv_pool_gib
        )
        return EnginePool.start(
            config, self.instances, token_source, self.distributed_backend, kv_pool, policy, timeline_points,
            clock.step if clock else None, history, reply_timeout_s=self.instance_timeout_s,
            load_timeout_s=self.instance_load_timeout_s, pool_load_s=clock.pool_load_s if clock else None,
        )  # fmt: skip
