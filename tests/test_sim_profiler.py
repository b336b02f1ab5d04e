"""The profiler: a non-negative relative-error fit, and a real (quick) profile of a tiny model."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest
import torch

from seer_engine.engine.config import EngineConfig
from seer_engine.sim.profile import InstanceProfile
from seer_engine.sim.profiler import StepPoint, add_cli, fit_step_time, profile_engine

A, B, C = 1e-3, 2e-5, 1e-7  # seconds, per token, per KV token
KV_BLOCKS = 1024


def synthetic(noise: float = 0.03, seed: int = 0) -> list[StepPoint]:
    """Decode and prefill steps of a known model, with multiplicative noise."""
    rng = random.Random(seed)
    shapes = [(r, r * ctx, "decode") for r in (1, 2, 4, 8, 16, 32) for ctx in (32, 128, 512, 1024)]
    shapes += [(p, p, "prefill") for p in (64, 256, 1024, 2048)]
    return [
        StepPoint(t, kv, (A + B * t + C * kv) * (1 + rng.gauss(0, noise)), kind) for t, kv, kind in shapes
    ]


def close(got: float, want: float, rel: float) -> bool:
    return abs(got - want) <= rel * want


def test_fit_recovers_known_coefficients():
    exact = fit_step_time(synthetic(noise=0.0))
    assert close(exact.a_s, A, 1e-6) and close(exact.b_s_per_token, B, 1e-6)
    assert close(exact.c_s_per_kv_token, C, 1e-6)
    noisy = fit_step_time(synthetic(noise=0.03))
    assert close(noisy.a_s, A, 0.1) and close(noisy.b_s_per_token, B, 0.1)
    assert close(noisy.c_s_per_kv_token, C, 0.1)


@pytest.mark.parametrize("index", [0, 23, 27])  # the shortest decode, the longest decode, a long prefill
def test_fit_shrugs_off_one_slowed_step(index):
    points = synthetic()
    slow = points[index]
    points[index] = StepPoint(slow.scheduled_tokens, slow.kv_tokens_read, slow.seconds * 3, slow.kind)
    model = fit_step_time(points)
    assert close(model.a_s, A, 0.2) and close(model.b_s_per_token, B, 0.2)
    assert close(model.c_s_per_kv_token, C, 0.25)


def test_fit_keeps_coefficients_non_negative():
    # Time that falls with the KV read: a plain least-squares fit gives c < 0.
    points = [StepPoint(t, kv, 1e-3 + 1e-5 * t - 2e-8 * kv, "decode") for t in (1, 8, 32) for kv in (0, 4096)]
    model = fit_step_time(points)
    assert model.c_s_per_kv_token == 0.0
    assert model.a_s > 0 and model.b_s_per_token > 0
    # Without c the best line in tokens alone: the same as fitting only the kv=0 and kv=4096 mix.
    errors = [abs(model.step_s(p.scheduled_tokens, p.kv_tokens_read) / p.seconds - 1) for p in points]
    assert max(errors) < 0.1
    # And when only a constant fits, b and c both stay at zero.
    flat = [StepPoint(t, t * 10, 2e-3 - 1e-6 * t, "decode") for t in (1, 10, 100)]
    model = fit_step_time(flat)
    assert model.b_s_per_token == 0.0 and model.c_s_per_kv_token == 0.0 and model.a_s > 0


def test_fit_rejects_bad_points():
    with pytest.raises(ValueError, match="at least one"):
        fit_step_time([])
    with pytest.raises(ValueError, match="positive"):
        fit_step_time([StepPoint(1, 1, 0.0, "decode")])


@pytest.fixture(scope="module")
def quick_profile(tiny_model):
    # One torch thread: on a shared 2-core machine, two threads stall each other for whole
    # scheduler time slices (~10 ms steps that should take 1). The engine sets the count
    # process-wide, so it is put back for the tests that follow.
    threads = torch.get_num_threads()
    config = EngineConfig(model=str(tiny_model()), num_kv_blocks=KV_BLOCKS, max_model_len=2048, num_threads=1)
    lines: list[str] = []
    yield profile_engine(config, quick=True, progress=lines.append), lines
    torch.set_num_threads(threads)


def test_quick_profile_of_a_tiny_model(quick_profile):
    profile, lines = quick_profile
    assert profile.kv_capacity_tokens == KV_BLOCKS * 16 and profile.block_size == 16
    assert profile.max_num_seqs == 256 and profile.max_num_batched_tokens == 2048
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads of 16, fp32
    assert profile.step.a_s > 0
    points = [StepPoint(**p) for p in profile.measured["points"]]
    kinds = {p.kind for p in points}
    assert {"decode", "prefill", "mixed"} <= kinds
    # The scheduler's figures: a decode step of R requests schedules R tokens and reads their contexts.
    decode = [p for p in points if p.kind == "decode"]
    assert {p.scheduled_tokens for p in decode} == {1, 4, 16}
    assert all(p.kv_tokens_read >= p.scheduled_tokens * 32 for p in decode)
    assert max(p.kv_tokens_read for p in decode) >= 16 * 512
    assert profile.measured["median_rel_error"] < 0.5
    assert profile.measured["machine"]["cpu_count"] >= 1 and profile.measured["date"]
    assert any(line.startswith("  pass 3:") for line in lines)


def test_profile_round_trips_through_json(quick_profile, tmp_path):
    profile, _ = quick_profile
    path = profile.save(tmp_path / "profiles" / "tiny.json")
    assert InstanceProfile.load(path) == profile
    assert json.loads(path.read_text())["step"]["a_s"] == profile.step.a_s


def test_profile_rejects_an_engine_nothing_fits(tiny_model):
    with pytest.raises(ValueError, match="no step shape fits"):
        profile_engine(EngineConfig(model=str(tiny_model()), num_kv_blocks=1), quick=True, progress=str)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="seer_engine")
    add_cli(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_writes_a_profile(tiny_model, tmp_path, capsys):
    out = tmp_path / "tiny.json"
    threads = torch.get_num_threads()
    # 64 KV blocks: only the small shapes fit, which keeps this second profile short.
    argv = ["profile", "--model", str(tiny_model()), "--num-kv-blocks", "64", "--num-threads", "1", "--quick"]
    args = parser().parse_args([*argv, "--output", str(out), "--name", "cpu-tiny"])
    assert args.func(args) == 0
    profile = InstanceProfile.load(out)
    torch.set_num_threads(threads)
    assert profile.name == "cpu-tiny" and profile.kv_capacity_tokens == 64 * 16
    assert profile.measured["torch_threads"] == 1
    printed = capsys.readouterr().out
    assert "us/token" in printed and f"wrote {out}" in printed
    args = parser().parse_args([*argv, "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="is a directory"):
        args.func(args)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no one may create a file")
def test_cli_refuses_an_output_it_cannot_write_before_profiling(tiny_model):
    argv = ["profile", "--model", str(tiny_model()), "--quick", "--output", "/proc/p.json"]
    args = parser().parse_args(argv)
    with pytest.raises(ValueError, match="its folder '/proc' is not a directory this run can write to"):
        args.func(args)
