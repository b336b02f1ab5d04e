"""Shared references for tests: transformers' greedy decoding, a chi-square test and a Hopper
compile check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = str(Path(__file__).resolve().parents[1])


def transformers_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Plain argmax decoding with transformers' KV cache (no logits processors, no EOS stop)."""
    out: list[int] = []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        while True:
            out.append(int(res.logits[0, -1].argmax()))
            if len(out) == n:
                return out
            res = model(torch.tensor([[out[-1]]]), past_key_values=res.past_key_values, use_cache=True)


def compile_for_hopper(script: str, cache_dir: Path) -> None:
    """Run ``script`` (which compiles Triton kernels for sm_90) in a fresh interpreter with
    the interpreter mode off; skip where no ptxas can assemble them."""
    nvidia = pytest.importorskip("triton.backends.nvidia")
    bundled = os.path.join(os.path.dirname(nvidia.__file__), "bin", "ptxas")
    if not os.path.exists(bundled) and shutil.which("ptxas") is None:
        pytest.skip("no ptxas to assemble the kernels with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """P(chi2 >= statistic) with cells of expected count < 5 merged."""
    cells, acc_o, acc_e = [], 0, 0.0
    for o, e in sorted(zip(observed, expected), key=lambda x: x[1]):
        acc_o, acc_e = acc_o + o, acc_e + e
        if acc_e >= 5:
            cells.append((acc_o, acc_e))
            acc_o, acc_e = 0, 0.0
    if acc_e:
        o, e = cells.pop() if cells else (0, 0.0)
        cells.append((o + acc_o, e + acc_e))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
