"""Trainer-facing control of the engine (SGLang-style RL endpoints), health and metrics.

An RL trainer drives the server between rollouts: pause or abort generation,
load new weights from disk, release memory while it trains (sleep / wake_up),
and read how the engine is doing from /metrics.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from seer_engine.engine.client import EngineClient, EngineDeadError, ServerStats
from seer_engine.entrypoints.openai.errors import APIError, error_response
from seer_engine.entrypoints.openai.json_body import JSONRoute
from seer_engine.entrypoints.openai.protocol import (
    ERROR_RESPONSES,
    AbortRequest,
    PauseRequest,
    SGLangAbortRequest,
    UpdateWeightsRequest,
)


def package_version() -> str:
    """seer_engine's installed version (the source tree's when it is not installed)."""
    try:
        return importlib.metadata.version("seer_engine")
    except importlib.metadata.PackageNotFoundError:
        return "0.1.0+source"


# (name, type, help, value) for every exported figure
_METRICS: list[tuple[str, str, str, Callable[[ServerStats], float]]] = [
    ("num_requests_running", "gauge", "Samples running in the engine.", lambda s: s.engine.running),
    ("num_requests_waiting", "gauge", "Samples waiting for admission.", lambda s: s.engine.waiting),
    ("num_requests_held", "gauge", "Samples held while paused or asleep.", lambda s: s.num_requests_held),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1).", lambda s: s.engine.kv_usage),
    (
        "kv_cache_free_blocks",
        "gauge",
        "Free KV blocks.",
        lambda s: s.engine.kv_total_blocks - s.engine.kv_used_blocks,
    ),
    ("kv_cache_total_blocks", "gauge", "KV blocks in the pool.", lambda s: s.engine.kv_total_blocks),
    ("num_preemptions_total", "counter", "Preemptions since start.", lambda s: s.engine.preemptions),
    (
        "generation_tokens_total",
        "counter",
        "Generated tokens since start.",
        lambda s: s.engine.generated_tokens,
    ),
    ("engine_steps_total", "counter", "Engine steps since start.", lambda s: s.engine.steps),
    ("generation_tokens_per_second", "gauge", "Recent generation throughput.", lambda s: s.tokens_per_second),
    (
        "accepted_tokens_per_step",
        "gauge",
        "Draft tokens accepted per request per step (0 without speculative decoding).",
        lambda s: s.engine.accepted_tokens_per_step,
    ),
    (
        "spec_decode_draft_tokens_total",
        "counter",
        "Draft tokens verified since start.",
        lambda s: s.engine.draft_tokens_verified,
    ),
    (
        "spec_decode_accepted_tokens_total",
        "counter",
        "Draft tokens accepted since start.",
        lambda s: s.engine.draft_tokens_accepted,
    ),
    (
        "instance_failures_total",
        "counter",
        "Engine instances lost; their responses finished on the others.",
        lambda s: s.health.instance_failures,
    ),
    (
        "instances_alive",
        "gauge",
        "Engine instances serving (rollout mode; otherwise 1, 0 once the engine stopped).",
        lambda s: sum(i["alive"] for i in s.health.instances) if s.health.instances else 1 - s.engine_stopped,
    ),
    (
        "kv_pool_failures_total",
        "counter",
        "KV pool calls that failed; those responses recomputed.",
        lambda s: s.health.kv_pool_failures,
    ),
    ("paused", "gauge", "1 while generation is paused.", lambda s: float(s.paused is not None)),
    ("sleeping", "gauge", "1 while the engine sleeps.", lambda s: float(s.sleeping)),
]


def render_metrics(stats: ServerStats, model_name: str, prefix: str = "seer_engine") -> str:
    """Prometheus text exposition format (version 0.0.4)."""
    escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    label = '{model_name="' + escaped + '"}'
    lines = []
    for name, kind, help_text, value in _METRICS:
        full = f"{prefix}_{name}"
        lines += [
            f"# HELP {full} {help_text}",
            f"# TYPE {full} {kind}",
            f"{full}{label} {float(value(stats))}",
        ]
    return "\n".join(lines) + "\n"


def admin_router(engine: EngineClient, expand_ids: Callable[[Sequence[str]], list[str]]) -> APIRouter:
    router = APIRouter(tags=["rl"], responses=ERROR_RESPONSES, route_class=JSONRoute)

    @router.get("/health")
    async def health() -> JSONResponse:
        """200 while the server serves: "ok", or "degraded" with the reason (an instance
        lost, the KV pool failing); 503 once it cannot serve at all."""
        try:
            state = engine.check_health()
        except EngineDeadError as e:
            return error_response(503, str(e), code="engine_dead")
        body: dict = {"status": "degraded" if state.degraded else "ok"}
        if state.degraded:
            body["reason"] = state.degraded
        if state.instances:
            body["instances"] = state.instances
        return JSONResponse(body)

    @router.get("/version")
    async def version() -> dict:
        """The package version, as vLLM's /version reports its own."""
        return {"version": package_version()}

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        text = render_metrics(await engine.stats(), engine.model_name)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(req: UpdateWeightsRequest) -> dict:
        try:  # its own version: another update may have run by the time it is read
            version = await engine.update_weights_from_disk(req.model_path, req.weight_version)
        except ValueError as e:  # a checkpoint refused (not found, damaged, another model)
            raise APIError(400, str(e), param="model_path") from None
        return {"success": True, "message": "weights updated", "weight_version": version}

    @router.get("/get_weight_version")
    async def get_weight_version() -> dict:
        return {"weight_version": engine.weight_version}

    @router.post("/pause_generation")
    async def pause_generation(req: PauseRequest | None = None) -> dict:
        req = req or PauseRequest()
        await engine.pause(req.engine_mode())
        return {"success": True, "mode": req.mode}

    @router.post("/resume_generation")
    @router.post("/continue_generation")  # SGLang's name
    async def resume_generation() -> dict:
        await engine.resume()
        return {"success": True}

    @router.post("/abort_requests")
    async def abort_requests(req: AbortRequest) -> dict:
        if req.all == (req.request_ids is not None):
            raise APIError(400, "give either request_ids or all: true", param="request_ids")
        ids = None if req.all else expand_ids(req.request_ids or [])
        count = await engine.abort(ids)
        return {"success": True, "num_aborted": count}

    @router.post("/abort_request")
    async def abort_request(req: SGLangAbortRequest) -> dict:
        """SGLang's form of /abort_requests."""
        if not req.abort_all and not req.rid:
            return {"success": True, "num_aborted": 0}
        count = await engine.abort(None if req.abort_all else expand_ids([req.rid]))
        return {"success": True, "num_aborted": count}

    @router.post("/sleep")
    @router.post("/release_memory_occupation")  # SGLang's name
    async def sleep() -> dict:
        await engine.sleep()
        return {"success": True}

    @router.post("/wake_up")
    @router.post("/resume_memory_occupation")  # SGLang's name
    async def wake_up() -> dict:
        await engine.wake_up()
        return {"success": True}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict:
        """vLLM's name for the question."""
        return {"is_sleeping": (await engine.stats()).sleeping}

    @router.api_route("/flush_cache", methods=["GET", "POST"])  # SGLang's clients GET it too
    @router.post("/reset_prefix_cache")  # vLLM's name for SGLang's flush_cache
    async def flush_cache() -> dict:
        await engine.flush_cache()
        return {"success": True}

    return router
