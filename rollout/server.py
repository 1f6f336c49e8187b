"""The rollout service over HTTP (`talaria-rollout`), and its client.

    POST /v1/generate        {"prompts": [[ids]], "n": 4, "sampling": {"max_tokens": 64, "temperature": 1.0},
                              "trajectory_ids": [...], "turns": [...], "request_ids": [...], "cache_salt": "..."}
                             -> {"outputs": [[{"request_id", "token_ids", "logprobs", "finish_reason",
                                               "cached_tokens", "replica", "weight_versions"}, ...n], ...]}
    POST /v1/generate_until  {"prompts", "n", "sampling", "target": 8, "resume": [partial, ...]}
                             -> {"finished": [completion, ...], "unfinished": [partial, ...]}
    POST /v1/abort           {"request_id": "..."} -> {"output": {...} | null}   (the partial tokens)
    POST /v1/abort_group     {"group": "..."} -> {"outputs": [...]}
    POST /v1/pause           {"mode": "abort" | "finish" | "keep"} (returns once no replica holds a request)
    POST /v1/resume
    POST /v1/update_weights  {"checkpoint": "/path/to/orbax"} (a `weights.checkpoint.save` folder)
    GET  /v1/stats           the service's counters and each replica's engine stats
    GET  /health

A multi-turn client sends each turn's context with the trajectory's id and turn number, so cache-
aware placement keeps it where its earlier turns' KV is. Bad input is a 400 naming the field;
with `api_keys` every route but /health wants `Authorization: Bearer KEY`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import secrets
from collections.abc import Sequence

from talaria_jax.engine.errors import RequestError
from talaria_jax.engine.sampling import SamplingParams
from talaria_jax.rollout.replica import Completion, Partial

__all__ = ["RolloutClient", "make_app", "partial_from_json", "sampling_params"]

_SAMPLING = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_params(body: dict | None) -> SamplingParams:
    """SamplingParams from a JSON object; RequestError naming an unknown field."""
    body = body or {}
    if not isinstance(body, dict):
        raise RequestError(f"sampling must be an object, got {type(body).__name__}")
    unknown = sorted(body.keys() - _SAMPLING)
    if unknown:
        raise RequestError(f"sampling: unknown fields {unknown}; known: {sorted(_SAMPLING)}")
    if isinstance(body.get("stop_token_ids"), list):
        body = dict(body, stop_token_ids=tuple(body["stop_token_ids"]))
    return SamplingParams(**body)


def sampling_json(params: SamplingParams) -> dict:
    """The fields of `params` that differ from the defaults (what `sampling_params` reads back)."""
    return {k: v for k, v in dataclasses.asdict(params).items() if v != getattr(SamplingParams(), k)}


def partial_to_json(p: Partial) -> dict:
    return dict(dataclasses.asdict(p), params=sampling_json(p.params))


def partial_from_json(body) -> Partial:
    """A Partial from its JSON object (as /v1/generate_until returns it); RequestError naming a bad field."""
    fields = {f.name for f in dataclasses.fields(Partial)}
    if not isinstance(body, dict) or body.keys() - fields or {"request_id", "prompt", "params"} - body.keys():
        raise RequestError(f"resume: each entry must be an object with the fields {sorted(fields)} "
                           f"(as generate_until returned it)")
    return Partial(**dict(body, params=sampling_params(body["params"])))


def make_app(service, api_keys: Sequence[str] = ()):
    """A FastAPI app over `service` (a RolloutService). Handlers are sync: each generate call waits in
    its own worker thread while the service's replica threads do the work."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    api = FastAPI(title="talaria-rollout")
    keys = list(api_keys)

    def error(status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status_code=status)

    @api.middleware("http")
    async def auth(request: Request, call_next):
        if keys and request.url.path != "/health":
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not any(secrets.compare_digest(given, k) for k in keys):
                return error(401, "missing or wrong API key (Authorization: Bearer KEY)")
        return await call_next(request)

    @api.exception_handler(RequestError)
    async def bad_request(request, e: RequestError):
        return error(400, str(e))

    @api.exception_handler(TypeError)  # SamplingParams(**body) with a wrong argument
    async def bad_type(request, e: TypeError):
        return error(400, str(e))

    @api.get("/health")
    def health():
        return {"status": "ok"}

    @api.post("/v1/generate")
    async def generate(body: dict):  # awaits its futures: no thread held while the replicas work
        unknown = sorted(body.keys() - {"prompts", "n", "sampling", "trajectory_ids", "turns", "request_ids",
                                        "cache_salt"})
        if unknown:
            raise RequestError(f"unknown fields {unknown}")
        if "prompts" not in body:
            raise RequestError("prompts is required (a list of token-id lists)")
        futures = service.submit(body["prompts"], sampling_params(body.get("sampling")), body.get("n", 1),
                                 trajectory_ids=body.get("trajectory_ids"), turns=body.get("turns"),
                                 request_ids=body.get("request_ids"), cache_salt=body.get("cache_salt"))
        out = [[await asyncio.wrap_future(f) for f in group] for group in futures]
        return {"outputs": [[dataclasses.asdict(c) for c in group] for group in out]}

    @api.post("/v1/generate_until")
    async def generate_until(body: dict):
        unknown = sorted(body.keys() - {"prompts", "n", "sampling", "target", "resume", "request_ids", "cache_salt"})
        if unknown:
            raise RequestError(f"unknown fields {unknown}")
        resume = body.get("resume") or []
        if not isinstance(resume, list):
            raise RequestError("resume must be a list of partials")
        call = functools.partial(service.generate_until, body.get("prompts", []), sampling_params(body.get("sampling")),
                                 body.get("n", 1), target=body.get("target"),
                                 resume=[partial_from_json(p) for p in resume],
                                 request_ids=body.get("request_ids"), cache_salt=body.get("cache_salt"))
        finished, unfinished = await asyncio.to_thread(call)
        return {"finished": [dataclasses.asdict(c) for c in finished],
                "unfinished": [partial_to_json(p) for p in unfinished]}

    @api.post("/v1/abort_group")
    def abort_group(body: dict):
        group = body.get("group")
        if not isinstance(group, str):
            raise RequestError("group (a str) is required")
        return {"outputs": [dataclasses.asdict(c) for c in service.abort_group(group)]}

    @api.post("/v1/pause")
    def pause(body: dict | None = None):
        mode = (body or {}).get("mode", "keep")
        service.pause(mode)
        return {"status": "ok", "paused": mode}

    @api.post("/v1/resume")
    def resume():
        service.resume()
        return {"status": "ok"}

    @api.post("/v1/abort")
    def abort(body: dict):
        rid = body.get("request_id")
        if not isinstance(rid, str):
            raise RequestError("request_id (a str) is required")
        c = service.abort(rid)
        return {"output": dataclasses.asdict(c) if c is not None else None}

    @api.post("/v1/update_weights")
    def update_weights(body: dict):
        path = body.get("checkpoint")
        if not isinstance(path, str):
            raise RequestError("checkpoint (an Orbax checkpoint folder) is required")
        from talaria_jax.weights import checkpoint

        import jax

        from talaria_jax.sharding import make_mesh

        try:  # into host memory (the CPU device), whatever the replicas' devices
            model = checkpoint.restore(path, make_mesh(jax.devices("cpu")[:1]))
        except (OSError, ValueError) as e:
            raise RequestError(f"checkpoint {path!r}: {e}") from None
        try:
            service.update_weights(model.state)
        except ValueError as e:  # with_params names a missing or misshapen parameter
            raise RequestError(str(e)) from None
        return {"status": "ok"}

    @api.get("/v1/stats")
    def stats():
        return service.stats()

    return api


class RolloutClient:
    """The HTTP API as Python calls (httpx): the same `generate` as the in-process service."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def _post(self, path: str, body: dict) -> dict:
        r = self.http.post(path, json=body)
        if r.status_code == 400:
            raise RequestError(r.json()["error"]["message"])
        r.raise_for_status()
        return r.json()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), n: int = 1,
                 **kw) -> list[list[Completion]]:
        body = dict(prompts=[list(map(int, p)) for p in prompts], n=n, sampling=sampling_json(params),
                    **{k: v for k, v in kw.items() if v is not None})
        return [[Completion(**c) for c in group] for group in self._post("/v1/generate", body)["outputs"]]

    def generate_until(self, prompts: Sequence[Sequence[int]], params: SamplingParams = SamplingParams(), n: int = 1,
                       *, target: int, resume: Sequence[Partial] = (), **kw) -> tuple[list[Completion], list[Partial]]:
        body = dict(prompts=[list(map(int, p)) for p in prompts], n=n, sampling=sampling_json(params), target=target,
                    resume=[partial_to_json(p) for p in resume], **{k: v for k, v in kw.items() if v is not None})
        out = self._post("/v1/generate_until", body)
        return [Completion(**c) for c in out["finished"]], [partial_from_json(p) for p in out["unfinished"]]

    def abort(self, request_id: str) -> Completion | None:
        c = self._post("/v1/abort", {"request_id": request_id})["output"]
        return Completion(**c) if c is not None else None

    def abort_group(self, group: str) -> list[Completion]:
        return [Completion(**c) for c in self._post("/v1/abort_group", {"group": group})["outputs"]]

    def pause(self, mode: str = "keep") -> None:
        self._post("/v1/pause", {"mode": mode})

    def resume(self) -> None:
        self._post("/v1/resume", {})

    def update_weights(self, checkpoint: str) -> None:
        self._post("/v1/update_weights", {"checkpoint": str(checkpoint)})

    def stats(self) -> dict:
        r = self.http.get("/v1/stats")
        r.raise_for_status()
        return r.json()

    def close(self) -> None:
        self.http.close()
