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
aware placement keeps it where its earlier turns' KV is. Bad input is a 400 with OpenAI's error
body, naming the field; with `api_keys` every route but /health wants `Authorization: Bearer KEY`.
The routes are module-level and read the app's state, as the instance server's are.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from talaria_jax import web
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
    try:
        return SamplingParams(**body)
    except TypeError as e:  # a field of the wrong type
        raise RequestError(f"sampling: {e}") from None


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


def make_app(service, api_keys: Sequence[str] = (), *, max_body_bytes: int = 256 << 20):
    """A FastAPI app over `service` (a RolloutService); `app.state.rollout` is what the routes read.
    With `api_keys`, every route but /health wants one of them (``web.key_checker``); errors are
    OpenAI's error body (``web.json_errors``): a bad request is a 400 naming the field. A body is
    read up to `max_body_bytes` (a batch of long prompts is large)."""
    app = FastAPI(title="talaria-rollout")
    app.state.rollout = _Rollout(service, web.key_checker(api_keys) if api_keys else None, max_body_bytes)
    web.json_errors(app)
    app.include_router(routes)
    return app


@dataclasses.dataclass(frozen=True)
class _Rollout:
    """What the rollout server's routes read (`app.state.rollout`)."""
    service: Any  # a RolloutService
    caller: Callable | None  # the request's API key, or ApiError 401; None: no keys asked
    max_body_bytes: int


def _service(request: Request) -> Any:
    """The service, once the caller is checked."""
    r: _Rollout = request.app.state.rollout
    if r.caller is not None:
        r.caller(request)
    return r.service


async def _checked(request: Request, fields: set[str]) -> tuple[Any, dict]:
    """The service, and the request's body (a JSON object of `fields` at most; none is {}), once the
    caller is checked."""
    service = _service(request)
    body = await web.read_json(request, request.app.state.rollout.max_body_bytes, empty={})
    if not isinstance(body, dict):
        raise web.ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(body.keys() - fields)
    if unknown:
        raise web.ApiError(400, f"unknown fields {unknown}; known: {sorted(fields)}", unknown[0], "unknown_field")
    return service, body


def _string(body: dict, field: str, what: str) -> str:
    """body[field], or a 400 naming it unless it is a str."""
    value = body.get(field)
    if not isinstance(value, str):
        raise web.ApiError(400, f"{field} ({what}) is required", field)
    return value


def _invalid(e: Exception) -> web.ApiError:
    """A RequestError (or a TypeError: a field of the wrong type) as a 400."""
    return web.ApiError(400, str(e), code="invalid_request")


routes = APIRouter()


@routes.get("/health")
async def health():
    return {"status": "ok"}


@routes.post("/v1/generate")
async def generate(request: Request):  # awaits its futures: no thread held while the replicas work
    service, body = await _checked(request, {"prompts", "n", "sampling", "trajectory_ids", "turns", "request_ids",
                                             "cache_salt"})
    try:
        if "prompts" not in body:
            raise RequestError("prompts is required (a list of token-id lists)")
        futures = service.submit(body["prompts"], sampling_params(body.get("sampling")), body.get("n", 1),
                                 trajectory_ids=body.get("trajectory_ids"), turns=body.get("turns"),
                                 request_ids=body.get("request_ids"), cache_salt=body.get("cache_salt"))
    except (RequestError, TypeError) as e:
        raise _invalid(e) from None
    out = [[await asyncio.wrap_future(f) for f in group] for group in futures]
    return {"outputs": [[dataclasses.asdict(c) for c in group] for group in out]}


@routes.post("/v1/generate_until")
async def generate_until(request: Request):
    service, body = await _checked(request, {"prompts", "n", "sampling", "target", "resume", "request_ids",
                                             "cache_salt"})
    try:
        resume = body.get("resume") or []
        if not isinstance(resume, list):
            raise RequestError("resume must be a list of partials")
        call = functools.partial(service.generate_until, body.get("prompts", []), sampling_params(body.get("sampling")),
                                 body.get("n", 1), target=body.get("target"),
                                 resume=[partial_from_json(p) for p in resume],
                                 request_ids=body.get("request_ids"), cache_salt=body.get("cache_salt"))
        finished, unfinished = await asyncio.to_thread(call)
    except (RequestError, TypeError) as e:
        raise _invalid(e) from None
    return {"finished": [dataclasses.asdict(c) for c in finished],
            "unfinished": [partial_to_json(p) for p in unfinished]}


@routes.post("/v1/abort_group")
async def abort_group(request: Request):
    service, body = await _checked(request, {"group"})
    group = _string(body, "group", "a str")
    return {"outputs": [dataclasses.asdict(c) for c in await asyncio.to_thread(service.abort_group, group)]}


@routes.post("/v1/pause")
async def pause(request: Request):
    service, body = await _checked(request, {"mode"})
    mode = body.get("mode", "keep")
    try:
        await asyncio.to_thread(service.pause, mode)  # returns once no replica holds a request
    except RequestError as e:
        raise web.ApiError(400, str(e), "mode") from None
    return {"status": "ok", "paused": mode}


@routes.post("/v1/resume")
async def resume(request: Request):
    service, _ = await _checked(request, set())
    service.resume()
    return {"status": "ok"}


@routes.post("/v1/abort")
async def abort(request: Request):
    service, body = await _checked(request, {"request_id"})
    rid = _string(body, "request_id", "a str")
    c = await asyncio.to_thread(service.abort, rid)
    return {"output": dataclasses.asdict(c) if c is not None else None}


@routes.post("/v1/update_weights")
async def update_weights(request: Request):
    service, body = await _checked(request, {"checkpoint"})
    path = _string(body, "checkpoint", "an Orbax checkpoint folder")
    await asyncio.to_thread(_update_weights, service, path)
    return {"status": "ok"}


def _update_weights(service, path: str) -> None:
    import jax

    from talaria_jax.sharding import make_mesh
    from talaria_jax.weights import checkpoint

    try:  # into host memory (the CPU device), whatever the replicas' devices
        model = checkpoint.restore(path, make_mesh(jax.devices("cpu")[:1]))
    except (OSError, ValueError) as e:
        raise web.ApiError(400, f"checkpoint {path!r}: {e}", "checkpoint") from None
    try:
        service.update_weights(model.state)
    except ValueError as e:  # with_params names a missing or misshapen parameter
        raise web.ApiError(400, str(e), "checkpoint") from None


@routes.get("/v1/stats")
async def stats(request: Request):
    return await asyncio.to_thread(_service(request).stats)


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
