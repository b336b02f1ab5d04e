"""The one seed rule: how every sampled token's randomness is derived.

A request's tokens depend only on its seed and each token's position (the sampler's
exponential race draws its noise from ``position_seed``), so batching, prefill spans,
preemption, migration between instances and speculation never change them. Seeds of
the samples of one request (``child_seed``), of the responses of an offline
rollout (``sample_seed``) and of the groups a command seeds from one ``--seed``
(``group_seed``) are derived here too, so every path that makes a request agrees on
them.
"""

from __future__ import annotations

SEED_MASK = (1 << 63) - 1  # torch.Generator takes a non-negative int64
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive indices apart
_GROUP_SALT = 0xD1B54A32D192ED03  # keeps group seeds apart from the position seeds of (seed, index)


def _signed(value: int) -> int:
    """The signed int64 with the bits of the unsigned 64-bit ``value``."""
    return value - (1 << 64) if value >> 63 else value


def _splitmix64(z: int) -> int:
    """splitmix64's finalizer: nearby inputs give unrelated 64-bit outputs."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def child_seed(base_seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request seeded with ``base_seed``: a signed
    int64, as a request's seed is. Sample 0 takes the request's own seed, so no two
    request seeds give sample 0 the same tokens."""
    return _signed((base_seed + index * _GOLDEN) & _MASK64)


def group_seed(seed: int, index: int) -> int:
    """The seed of group ``index`` (or iteration) of a run seeded with ``seed``: mixed,
    not ``child_seed``. A group's samples step from its seed by ``child_seed``'s constant,
    so groups seeded ``child_seed(seed, k)`` would share seeds: sample i of group k
    would draw sample i-1 of group k+1's (the same tokens for the same prompt)."""
    return _signed(_splitmix64((seed * _GOLDEN + index + 1) ^ _GROUP_SALT))


def sample_seed(group_seed: int | None, group_order: int, index: int) -> int:
    """Per-response seed of an offline rollout: the server's rule (``child_seed``) on the
    group's own seed, so a seeded group samples what the same request sent to the server
    does; a group without one takes its submission order, which keeps it the same
    whatever policy, chunking or instance runs it."""
    return child_seed(group_seed if group_seed is not None else group_order, index)


def position_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): independent streams per request and position."""
    return _splitmix64(seed * _GOLDEN + position + 1) & SEED_MASK
