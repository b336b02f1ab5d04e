"""Rollout-mode options shared by ``seer_engine serve`` and ``seer_engine rollout``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from seer_engine.core.policies import ROLLOUT_POLICIES

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

    def __post_init__(self) -> None:
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

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RolloutConfig:
        return cls(
            rollout_mode=args.rollout_mode,
            policy=args.rollout_policy,
            instances=args.instances,
            chunk_tokens=args.chunk_tokens,
            starvation_s=args.starvation_s,
        )
