"""What a benchmark report records about the machine it ran on."""

from __future__ import annotations

import os
import platform
from typing import Any


def machine(**extra: Any) -> dict[str, Any]:
    """CPU model, core count, Python and platform, the load at the start, plus ``extra``."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],
        **extra,
    }
