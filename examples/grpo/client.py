"""The HTTP calls the loop makes to a ``seer_engine serve --rollout-mode`` server."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from grpo.config import GRPOError, Sample

BATCH_TERMINAL = ("completed", "failed", "cancelled", "expired")


class ServerClient:
    """The HTTP calls the loop makes; every failure becomes a GRPOError that says what happened."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/").removesuffix("/v1")  # the root: an OpenAI base URL names its /v1
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, what: str, text: bool = False, **kwargs: Any) -> Any:
        """The JSON answer (``text``: the body as text) of one call."""
        try:
            resp = self.http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise GRPOError(
                f"{what}: the server at {self.url} did not answer within {self.timeout_s:.0f}s"
            ) from None
        except httpx.TransportError as e:
            raise GRPOError(
                f"{what}: cannot reach the seer_engine server at {self.url} ({e}); start one with "
                "`seer_engine serve --rollout-mode --model MODEL` (or `make run`) or pass --server"
            ) from None
        if resp.status_code >= 400:
            raise GRPOError(f"{what}: HTTP {resp.status_code} from {method} {path}: {_error_message(resp)}")
        if text:
            return resp.text
        try:
            return resp.json()
        except ValueError:
            raise GRPOError(f"{what}: {method} {path} answered with no JSON: {resp.text[:200]!r}") from None

    def served_model(self, name: str | None = None) -> str:
        """``name`` when the server serves it (else the first model it serves): a wrong
        --served-model-name is refused before a batch is built, not in every request."""
        ids = [m["id"] for m in self.request("GET", "/v1/models", "listing the served models")["data"]]
        if not ids:
            raise GRPOError("the server serves no model")
        if name is not None and name not in ids:
            raise GRPOError(f"--served-model-name {name!r} is not served here; the server serves {ids}")
        return name or ids[0]

    def weight_version(self, **kwargs: Any) -> str:
        answer = self.request("GET", "/get_weight_version", "reading the weight version", **kwargs)
        return str(answer["weight_version"])

    def took_since(self, version: str) -> bool:
        """Whether the server says it loaded weights after ``version`` (False if it cannot say)."""
        try:
            return self.weight_version(timeout=10) != version
        except (GRPOError, KeyError):
            return False

    def update_weights(self, path: Path) -> str:
        """Load ``path`` on the server; the new version (refusals raise)."""
        body = {"model_path": str(path.resolve())}
        try:
            out = self.request("POST", "/update_weights_from_disk", "weight update", json=body)
        except GRPOError as e:
            raise GRPOError(f"weight update refused: {e}") from None
        if not out.get("success"):
            raise GRPOError(f"weight update refused: {out}")
        return str(out["weight_version"])

    def completions(self, bodies: list[dict]) -> list[dict]:
        """All requests at once (one thread each), so the server schedules them together."""
        with ThreadPoolExecutor(max(1, min(len(bodies), 64))) as pool:
            futures = [
                pool.submit(self.request, "POST", "/v1/completions", f"completion request {k}", json=b)
                for k, b in enumerate(bodies)
            ]
            return [f.result() for f in futures]

    def batch(self, bodies: list[dict], poll_s: float = 0.2) -> list[dict]:
        """One Batch API batch of the requests; every line must come back answered."""
        lines = [{"custom_id": f"req-{k}", "method": "POST", "url": "/v1/completions", "body": b}
                 for k, b in enumerate(bodies)]  # fmt: skip
        content = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = self.request(
            "POST", "/v1/files", "uploading the batch input",
            files={"file": ("grpo.jsonl", content, "application/jsonl")}, data={"purpose": "batch"},
        )  # fmt: skip
        batch = self.request("POST", "/v1/batches", "creating the batch", json={
            "input_file_id": upload["id"], "endpoint": "/v1/completions", "completion_window": "24h",
        })  # fmt: skip
        deadline = time.monotonic() + self.timeout_s
        try:
            while batch["status"] not in BATCH_TERMINAL:
                if time.monotonic() > deadline:
                    waited = f"{self.timeout_s:.0f}s"
                    raise GRPOError(f"batch {batch['id']} still {batch['status']} after {waited}")
                time.sleep(poll_s)
                batch = self.request("GET", f"/v1/batches/{batch['id']}", "polling the batch")
            if batch["status"] != "completed":
                raise GRPOError(f"batch {batch['id']} {batch['status']}: {json.dumps(batch.get('errors'))}")
            outputs = self._records(batch.get("output_file_id"))
            errors = self._records(batch.get("error_file_id"))
            if errors:
                cid, record = next(iter(errors.items()))
                raise GRPOError(f"{len(errors)} of {len(lines)} batch requests failed, e.g. {cid}: "
                                f"{_record_message(record)}")  # fmt: skip
            missing = [line["custom_id"] for line in lines if line["custom_id"] not in outputs]
            if missing:
                raise GRPOError(
                    f"batch {batch['id']} returned no answer for {len(missing)} requests: {missing[:5]}"
                )
            return [outputs[line["custom_id"]]["response"]["body"] for line in lines]
        finally:
            if batch["status"] not in BATCH_TERMINAL:  # given up on (timeout, Ctrl-C): stop its work
                batch = self._cancel(batch)
            for fid in (upload["id"], batch.get("output_file_id"), batch.get("error_file_id")):
                if fid:  # best effort: keeps the server's data folder small
                    try:
                        self.http.delete(f"/v1/files/{fid}")
                    except httpx.HTTPError:
                        pass

    def _cancel(self, batch: dict, wait_s: float = 10.0) -> dict:
        """Cancel a batch and wait a little for it to end: until it has, the server refuses to
        delete its input file (409), and its error file appears only then."""
        deadline = time.monotonic() + wait_s
        try:
            self.http.post(f"/v1/batches/{batch['id']}/cancel", timeout=wait_s)
            while batch["status"] not in BATCH_TERMINAL and time.monotonic() < deadline:
                batch = self.http.get(f"/v1/batches/{batch['id']}", timeout=wait_s).json()
                if batch["status"] not in BATCH_TERMINAL:
                    time.sleep(0.1)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        return batch

    def _records(self, file_id: str | None) -> dict[str, dict]:
        if not file_id:
            return {}
        text = self.request("GET", f"/v1/files/{file_id}/content", "reading the batch results", text=True)
        return {r["custom_id"]: r for r in map(json.loads, text.splitlines()) if r}


def _error_message(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]


def _record_message(record: dict) -> str:
    response = record.get("response") or {}
    body = response.get("body") or {}
    message = (body.get("error") or {}).get("message") or (record.get("error") or {}).get("message")
    return f"HTTP {response.get('status_code')}: {message}"


def parse_choices(body: dict, prompt_ids: list[int], n: int) -> list[Sample]:
    """The n samples of one completion response, checked: none lost, tokens and logprobs aligned."""
    choices = sorted(body.get("choices", []), key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(n)):
        raise GRPOError(f"expected {n} choices, got indices {[c['index'] for c in choices]}")
    samples = []
    for c in choices:
        if c.get("prompt_token_ids") != prompt_ids:
            raise GRPOError("the server's prompt_token_ids differ from the prompt sent")
        ids = c.get("token_ids")
        logprobs = (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None or len(logprobs) != len(ids):
            raise GRPOError("a choice lacks token_ids or per-token logprobs (return_token_ids, logprobs=0)")
        samples.append(Sample(prompt_ids, list(ids), c["text"], c["finish_reason"], list(logprobs)))
    return samples


def check_version(before: str, returned: str, read_back: str) -> None:
    """The update took: the server reports the version it returned, one past the last."""
    if read_back != returned:
        raise GRPOError(f"/get_weight_version says {read_back!r} but the update returned {returned!r}")
    expected = str(int(before) + 1) if before.isdigit() else "1"
    if returned != expected:
        raise GRPOError(f"weight version went from {before!r} to {returned!r}, expected {expected!r}")
