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


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too). A URL, a port out of range or a non-string is a
    usage error, said as such: a probe of it would read as "no master answers"."""
    if not isinstance(address, str):
        raise ValueError(f"a Mooncake master address is a 'host:port' string, got {address!r}")
    host, sep, port = address.rpartition(":")
    valid = (
        sep
        and host
        and "/" not in host
        and not any(c.isspace() for c in address)
        and port.isascii()
        and port.isdigit()
        and 0 < int(port) < 65536
    )
    if not valid:
        raise ValueError(f"a Mooncake master address looks like 'host:port' (port 1-65535), got {address!r}")
    return host.strip("[]"), int(port)
