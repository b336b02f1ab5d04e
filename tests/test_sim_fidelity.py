"""Fidelity at small scale: the simulator reproduces the real engine's rollout
(2 instances, trace replay, every policy) within 15% in makespan and throughput,
with a step-time model fitted on this machine (see ``seer_engine.sim.fidelity``).

The real engines run for real; their clocks are the fitted model's cost of each step
they took, so a shared machine's timing noise (one slow run moves a wall-clock
makespan by 10-40% here) cannot fail the test, while any difference between how the
simulator and the engine schedule, batch, preempt, prefill and draft still does.
The wall-clock comparison is ``benchmarks/sim_fidelity.py``'s.
"""

from __future__ import annotations

import pytest

from seer_engine.model_executor.tiny_model import make_tiny_model
from seer_engine.sim.fidelity import Workload, compare
from seer_engine.workloads.paths import traces_dir

TRACE = traces_dir() / "qwen3-8b-mcq-cot.jsonl.gz"
TOLERANCE = 0.15


def test_simulated_makespan_and_throughput_within_15_percent_of_the_real_engine(tmp_path):
    if not TRACE.is_file():
        pytest.skip(f"{TRACE} not found")
    model = make_tiny_model(tmp_path, tokenizer=TRACE.parent / "bpe32k-tokenizer.json")
    comparisons, profile = compare(Workload(str(TRACE)), model)
    report = "\n".join(c.line() for c in comparisons)
    print(report)
    assert profile.step.d_s_per_logit > 0, "decode tokens pay the LM head; prompt tokens do not"
    for c in comparisons:
        assert c.sim.output_tokens == c.real.output_tokens, "the same responses, to the token"
        assert abs(c.makespan_ratio - 1) <= TOLERANCE, report
        assert abs(c.throughput_ratio - 1) <= TOLERANCE, report
