"""The paper's cluster setups, with instance profiles derived on paper from model size
and H800-class hardware.

How a profile is derived (``h800_profile``), per instance of ``g`` GPUs:

- ``a`` (fixed seconds per step) = the weight bytes one GPU reads per step over its
  HBM bandwidth (a decode batch of dozens touches every expert of an MoE, so all of
  them) + a per-step overhead (kernel launches, sampling, the collective latency of
  TP all-reduces or EP all-to-alls across the layers).
- ``b`` (seconds per scheduled token) = 2 x active parameters FLOPs over the
  instance's peak at a model FLOPs utilisation ``mfu``, + the EP all-to-all bytes a
  token sends (MoE across nodes) over the instance's network bandwidth.
- ``c`` (seconds per KV token read) = KV bytes per token over the HBM bandwidth that
  serves it: sharded by heads under TP (all GPUs read in parallel), replicated under
  MLA with TP (every GPU reads the whole latent), one GPU per request under DP
  attention (all GPUs in parallel, with a 1.5x imbalance allowance).
- KV capacity = g x 80 GB x 0.6 - weights - 4 GB per GPU of activations, over the KV
  bytes per token (per replica under MLA + TP). 0.6 is the ``gpu_memory_utilization``
  RL frameworks give a rollout engine that shares its GPUs with the trainer (veRL's
  examples use 0.5-0.7): the KV cache, not compute, is what runs out.
- KV pool (Mooncake over RDMA) = 25 GB/s per GPU into the instance.

Workloads: Table 3's mean generation length under each max length, with the Qwen3
trace's length structure, except the spread of the groups' mean lengths on Qwen2-VL-72B
(``across_sigma`` 1.6 instead of the trace's 0.44). It is the one setup whose veRL baseline
the paper describes (13,686 preemptions per iteration, instances finishing across 70% of
it); with the trace's spread the modeled baseline preempts 34,339 times and its instances
finish within 27%, while 1.6 gives 12,391 and 67%
(``benchmarks/results/simulator/calibration/``).

H800: 80 GB HBM3 at 3.35 TB/s, 989 TFLOPS dense BF16 (1,979 FP8), 400 Gb/s RDMA per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from seer_engine.rollout.context_manager import DEFAULT_STARVATION_S
from seer_engine.sim.profile import InstanceProfile, StepTimeModel
from seer_engine.workloads.synthetic import FIT

HBM_BYTES = 80e9
HBM_BYTES_PER_S = 3.35e12
BF16_FLOPS = 989e12
FP8_FLOPS = 1979e12
NET_BYTES_PER_S = 40e9  # effective RDMA per GPU (400 Gb/s links)
POOL_BYTES_PER_S = 25e9  # effective KV-pool pull per GPU
MEMORY_UTILIZATION = 0.6


@dataclass(frozen=True)
class Setup:
    name: str
    gpus: int
    instances: int
    prompts: int  # groups per iteration
    samples: int  # responses per prompt
    max_tokens: int
    profile: InstanceProfile
    mean_tokens: int | None = None  # Table 3's mean generation length: the synthetic workload's mean
    chunk_tokens: int = 8192  # the paper's chunk
    prompt_len: int = 1024  # synthetic prompts (tokens): the median
    prompt_len_sigma: float = 0.33  # sd of log prompt length (the Qwen3 trace's)
    prompt_len_corr: float = 0.5  # its correlation with the group's log mean length (the trace's)
    across_sigma: float = FIT["across_sigma"]  # sd of the groups' log mean lengths (the trace's)
    starvation_s: float = DEFAULT_STARVATION_S  # the Context Manager's guard, as the engine's
    notes: str = ""


def h800_profile(
    name: str,
    *,
    gpus: int,
    total_params: float,
    active_params: float,
    bytes_per_param: float,
    kv_bytes_per_token: int,
    attention: str,  # "tp" (heads sharded) | "mla-tp" (latent replicated) | "dp" (one GPU per request)
    overhead_s: float,
    mfu: float,
    a2a_bytes_per_token: float = 0.0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 16384,
) -> InstanceProfile:
    weights = total_params * bytes_per_param
    a = weights / gpus / HBM_BYTES_PER_S + overhead_s
    peak = FP8_FLOPS if bytes_per_param == 1 else BF16_FLOPS
    b = 2 * active_params / (gpus * peak * mfu) + a2a_bytes_per_token / (gpus * NET_BYTES_PER_S)
    if attention == "tp":
        c, replicas = kv_bytes_per_token / (gpus * HBM_BYTES_PER_S), 1
    elif attention == "mla-tp":
        c, replicas = kv_bytes_per_token / HBM_BYTES_PER_S, gpus
    elif attention == "dp":
        c, replicas = 1.5 * kv_bytes_per_token / (gpus * HBM_BYTES_PER_S), 1
    else:
        raise ValueError(f"unknown attention layout {attention!r}")
    free = gpus * HBM_BYTES * MEMORY_UTILIZATION - weights - gpus * 4e9
    capacity = int(free / (kv_bytes_per_token * replicas))
    derivation = (
        f"H800 x{gpus}, {total_params / 1e9:.0f}B params ({active_params / 1e9:.0f}B active) at "
        f"{bytes_per_param:g} B/param, KV {kv_bytes_per_token} B/token ({attention}); "
        f"a = {weights / gpus / 1e9:.1f} GB weights per GPU / 3.35 TB/s + {overhead_s * 1e3:.1f} ms "
        "overhead; "
        f"b = 2 x {active_params / 1e9:.0f}B FLOPs / ({gpus} x {peak / 1e12:.0f} TFLOPS x {mfu:g} MFU)"
        + (
            f" + {a2a_bytes_per_token / 1e6:.1f} MB all-to-all per token / ({gpus} x 40 GB/s)"
            if a2a_bytes_per_token
            else ""
        )
        + f"; c = KV bytes / HBM bandwidth ({attention}); KV capacity = {gpus} x 48 GB - weights - "
        f"{gpus} x 4 GB activations = {capacity / 1e6:.2f}M tokens"
    )
    return InstanceProfile(
        name=name,
        step=StepTimeModel(a, b, c),
        kv_capacity_tokens=capacity,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=16,
        kv_bytes_per_token=kv_bytes_per_token,
        pool_bytes_per_s=gpus * POOL_BYTES_PER_S,
        derivation=derivation,
    )


# Moonlight-16B-A3B: DeepSeek-V3 layout, 27 layers, MLA latent 512 + rope 64 in BF16.
MOONLIGHT = Setup(
    "moonlight", gpus=32, instances=32, prompts=400, samples=8, max_tokens=65536, mean_tokens=22386,
    profile=h800_profile(
        "moonlight-h800-tp1", gpus=1, total_params=16e9, active_params=3e9, bytes_per_param=2,
        kv_bytes_per_token=27 * 576 * 2, attention="mla-tp", overhead_s=5e-3, mfu=0.4, max_num_seqs=256,
    ),
    notes="one instance per GPU (the 16B MoE fits one H800)",
)  # fmt: skip

# Qwen2-VL-72B: 80 layers, GQA 8 KV heads x 128 in BF16, TP8.
QWEN2VL_72B = Setup(
    "qwen2vl-72b", gpus=128, instances=16, prompts=600, samples=16, max_tokens=40960, mean_tokens=7615,
    prompt_len=2048, across_sigma=1.6,
    profile=h800_profile(
        "qwen2vl-72b-h800-tp8", gpus=8, total_params=72e9, active_params=72e9, bytes_per_param=2,
        kv_bytes_per_token=2 * 80 * 8 * 128 * 2, attention="tp", overhead_s=8e-3, mfu=0.4, max_num_seqs=256,
    ),
    notes="16 TP8 instances, as in the paper; prompts carry image tokens (2,048); group mean lengths "
    "spread so the baseline preempts and finishes as the paper's veRL baseline does",
)  # fmt: skip

# Kimi-K2: 1.04T params (32B active) in FP8, 61 layers, MLA latent 576 in BF16; DP attention
# + EP over 32 GPUs; a token's all-to-all = 7168 hidden x 3 B (FP8 dispatch, BF16 combine)
# x 8 experts x 61 layers.
KIMI_K2 = Setup(
    "kimi-k2", gpus=256, instances=8, prompts=800, samples=8, max_tokens=98304, mean_tokens=38959,
    profile=h800_profile(
        "kimi-k2-h800-ep32", gpus=32, total_params=1.04e12, active_params=32e9, bytes_per_param=1,
        kv_bytes_per_token=61 * 576 * 2, attention="dp", overhead_s=12e-3, mfu=0.3,
        a2a_bytes_per_token=7168 * 3 * 8 * 61, max_num_seqs=2048, max_num_batched_tokens=65536,
    ),
    notes="8 instances of 32 GPUs (DP attention + EP32: the 1 TB of FP8 weights needs >= 16 H800s)",
)  # fmt: skip

SETUPS: dict[str, Setup] = {s.name: s for s in (MOONLIGHT, QWEN2VL_72B, KIMI_K2)}

# The paper's ablation (Table 4, its 5th iteration): + divided rollout, + context-aware
# scheduling, throughput x veRL.
PAPER_ABLATION: dict[str, tuple[float, float]] = {
    "moonlight": (1.41, 1.47), "qwen2vl-72b": (1.42, 1.56), "kimi-k2": (1.16, 1.27),
}  # fmt: skip


def get_setup(name: str) -> Setup:
    if name not in SETUPS:
        raise ValueError(f"unknown setup {name!r}; choose from {sorted(SETUPS)} (or pass --profile)")
    return SETUPS[name]
