"""What the Mooncake master and its store clients share: TCP probes and Mooncake's limits."""

from __future__ import annotations

import socket

MIN_SEGMENT_BYTES = 16 << 20  # Mooncake's allocator refuses (and mooncake_client aborts on) less
CONNECT_TIMEOUT_S = 2.0


def answers(host: str, port: int, timeout: float = CONNECT_TIMEOUT_S) -> bool:
    """Whether something accepts TCP connections at host:port (a refused port fails at once)."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
