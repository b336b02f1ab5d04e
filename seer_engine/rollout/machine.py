"""What a report records about the machine it ran on, in one shape for every report.

Timings mean little without the machine and its load (the development machine is a
shared 2-core CPU), so ``bench rollout``, ``seer_engine profile`` and the scripts in
``benchmarks/`` all record this same dict.
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Any


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _accelerator(torch: Any) -> str:
    """The CUDA devices (name of the first, and how many), or "none"."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return "none"


def machine_info(**extra: Any) -> dict[str, Any]:
    """CPU model, core count, platform, Python, the 1-minute load now, plus ``extra``.

    When the process has imported torch, also its version and accelerator; torch is not
    imported here, so a client-only benchmark does not pay for it.
    """
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "loadavg_1m_at_start": os.getloadavg()[0],
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["accelerator"] = _accelerator(torch)
    return {**info, **extra}


def describe_machine(info: dict[str, Any]) -> str:
    """One line for a Markdown report, from a :func:`machine_info` dict."""
    parts = [f"{info['cpu']}, {info['cpu_count']} CPUs", info["platform"], f"Python {info['python']}"]
    if "torch" in info:
        parts.append(f"torch {info['torch']}")
    if info.get("accelerator", "none") != "none":
        parts.append(info["accelerator"])
    return ", ".join(parts)
