"""The OpenAI-compatible HTTP API of `kivi serve` (FastAPI); docs/serve.md describes it."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from dataclasses import dataclass
from typing import Annotated, Callable, Literal, Optional, Union

import uvicorn
from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServeConfig
from .engine import Engine, log
from .request import Failure, Request, RequestError


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate (not a Unicode character) at index {e.start}") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]


def _only(*allowed, why: str):
    """Accepted only at its default(s), else refused: never silently ignored."""
    def check(value):
        if value not in allowed:
            raise ValueError(f"only {' or '.join(map(json.dumps, allowed))} is supported ({why}), got {json.dumps(value)}")
        return value
    return AfterValidator(check)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    include_usage: bool = False


class _Body(BaseModel):
    # Strict types (no "5" -> 5); OpenAI fields not listed (user, ...) change nothing and are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Optional[Union[Text, list[Text]]] = None
    seed: Optional[int] = Field(None, ge=-(2**63), lt=2**64)  # what torch.Generator.manual_seed takes
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: Annotated[Optional[int], _only(None, 1, why="one choice per request")] = None
    presence_penalty: Annotated[Optional[float], _only(None, 0, why="no penalties")] = None
    frequency_penalty: Annotated[Optional[float], _only(None, 0, why="no penalties")] = None
    logit_bias: Annotated[Optional[dict], _only(None, {}, why="no logit bias")] = None


class CompletionBody(_Body):
    prompt: Union[Text, list[Text]]
    best_of: Annotated[Optional[int], _only(None, 1, why="one choice per request")] = None
    logprobs: Annotated[Optional[int], _only(None, why="no log-probabilities")] = None
    echo: Annotated[bool, _only(False, why="the prompt is not echoed")] = False
    suffix: Annotated[Optional[Text], _only(None, "", why="no insertion")] = None


# A role outside the templates' would go in verbatim ("user<|im_end|>..." writes a system turn).
CHAT_ROLES = ("system", "user", "assistant")


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal[CHAT_ROLES]
    content: Text


class ChatBody(_Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Annotated[Optional[bool], _only(None, False, why="no log-probabilities")] = None
    top_logprobs: Annotated[Optional[int], _only(None, 0, why="no log-probabilities")] = None
    tools: Annotated[Optional[list], _only(None, [], why="no tool calls")] = None
    tool_choice: Annotated[Optional[Union[str, dict]], _only(None, "none", why="no tool calls")] = None
    response_format: Annotated[Optional[dict], _only(None, {"type": "text"}, why="plain text only")] = None

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class ErrorResponse(JSONResponse):
    """Every non-ASCII character escaped: an error may quote input that is not valid UTF-8."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error(status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
          headers: Optional[dict] = None) -> JSONResponse:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return ErrorResponse(status_code=status, headers=headers,
                         content={"error": {"message": message, "type": kind, "param": param, "code": code}})


def refusal(e: RequestError, chat: bool) -> JSONResponse:
    param = "messages" if chat and e.param == "prompt" else e.param
    return error(e.status, str(e), param=param, code=e.code, headers=e.headers)


def _field_or_index(part) -> bool:
    """A pydantic location part naming a field or an index, not a union branch."""
    return isinstance(part, int) or (part.isidentifier() and part not in ("str", "int", "float", "bool", "list"))


def failed(failure: Failure, request_id: str) -> JSONResponse:
    return error(failure.status, failure.message, code=failure.code, headers={"x-request-id": request_id})


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# An oversize body is read and dropped up to this before its 413: urllib would otherwise get a reset.
DISCARD_BYTES = 64 << 20


class Guard:
    """Host, API key and announced body size, checked before FastAPI reads anything (docs/serve.md, Operations)."""

    def __init__(self, app: FastAPI, *, max_request_bytes: int, api_key: Optional[str] = None,
                 allowed_hosts: Optional[tuple[str, ...]] = None):
        self.app, self.max_request_bytes = app, max_request_bytes
        self.api_key, self.allowed_hosts = api_key, allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (refused := self.refusal(scope)) is not None:
            waits = "100-continue" in Headers(scope=scope).get("expect", "").lower()  # it sends nothing yet
            if refused.status_code == 413 and (waits or not await discard_body(receive, DISCARD_BYTES)):
                refused.headers["connection"] = "close"  # the rest of the body is never read
            return await refused(scope, receive, send)
        await self.app(scope, receive, send)

    def refusal(self, scope) -> Optional[JSONResponse]:
        headers = Headers(scope=scope)
        host = headers.get("host")
        if self.allowed_hosts is not None and host is not None and _hostname(host) not in self.allowed_hosts:
            return error(400, f"the Host header {host!r} is not allowed: this server answers only "
                              f"{', '.join(self.allowed_hosts)}", code="invalid_host")
        path = scope["path"]
        if self.api_key is not None and path != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
                return error(401, "a valid API key is required: send 'Authorization: Bearer <key>' (--api-key)",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return too_large(self.max_request_bytes)
        return None


async def discard_body(receive, limit: int) -> bool:
    read = 0
    while read <= limit:
        message = await receive()
        read += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return True
    return False


def _hostname(host: str) -> Optional[str]:
    """"127.0.0.1:8000" -> "127.0.0.1", "[::1]:8000" -> "::1"; None if not `name[:port]`."""
    host = host.strip().lower()
    if host.startswith("["):
        name, closed, port = host[1:].partition("]")
        port = port.removeprefix(":") if closed and port.startswith(":") else port
    else:
        name, _, port = host.partition(":")
    return name if name and (not port or port.isdigit()) and "@" not in name and "/" not in name else None


def shortened(text: str, keep: int = 64) -> str:
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


def too_large(limit: int) -> JSONResponse:
    return error(413, f"the request body exceeds {limit} bytes (--max-request-bytes)", code="request_too_large")


def longest_token_bytes(tokenizer) -> int:
    """No token spells more bytes than the longest entry: a bound on tokens before tokenizing."""
    return max(len(token.encode("utf-8", "replace")) for token in tokenizer.get_vocab())


def build_app(engine: Engine, config: Optional[ServeConfig] = None) -> Guard:
    config = engine.config if config is None else config
    app = FastAPI(title="kivi serve", max_body_size=config.max_request_bytes,
                  docs_url="/docs" if config.docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if config.docs else None)
    app.state.engine, app.state.config, app.state.tokenizer = engine, config, engine.tokenizer
    app.state.longest_token = longest_token_bytes(engine.tokenizer)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, crashed)
    app.include_router(router)
    return Guard(app, max_request_bytes=config.max_request_bytes, api_key=config.api_key,
                 allowed_hosts=config.allowed_hosts)


async def invalid(request: HTTPRequest, exc: RequestValidationError):
    first = max(exc.errors(), key=lambda e: len(e.get("loc", ())), default={})
    if first.get("type") == "json_invalid":
        return error(400, "the request body is not valid JSON", code="invalid_json")
    where = ".".join(str(p) for p in first.get("loc", ())[1:] if _field_or_index(p)) or None
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return error(400, f"{where}: {message}" if where else message, param=where, code="invalid_value")


async def http_error(request: HTTPRequest, exc: StarletteHTTPException):
    if exc.status_code == 413:
        return too_large(request.app.state.config.max_request_bytes)
    if exc.status_code == 400:
        return error(400, "the request body is not valid JSON (UTF-8 text, not nested too deeply)",
                     code="invalid_json")
    return error(exc.status_code, str(exc.detail), headers=exc.headers,
                 code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code))


async def crashed(request: HTTPRequest, exc: Exception):
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error(500, f"internal error: {type(exc).__name__}", code="internal_error")


router = APIRouter()


@router.get("/health")
async def health(http: HTTPRequest):
    if (unhealthy := http.app.state.engine.health_error()) is not None:
        return error(unhealthy.status, str(unhealthy), code=unhealthy.code)
    return {"status": "ok"}


def model_card(config: ServeConfig) -> dict:
    return {"id": config.served_model_name, "object": "model", "created": 0, "owned_by": "kivi"}


@router.get("/v1/models")
async def models(http: HTTPRequest):
    return {"object": "list", "data": [model_card(http.app.state.config)]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, http: HTTPRequest):
    config = http.app.state.config
    return check_model(model_id, config) or model_card(config)


@router.get("/metrics")
async def metrics(http: HTTPRequest):
    s = http.app.state.engine.stats()
    lines = []
    for name, kind, help_text, value in (
        ("kivi_requests_running", "gauge", "requests holding a cache slot", s["running"]),
        ("kivi_requests_waiting", "gauge", "requests queued for a slot (FIFO)", s["waiting"]),
        ("kivi_cache_slots_used", "gauge", "cache rows in use", s["slots_used"]),
        ("kivi_cache_slots_free", "gauge", "cache rows free", s["slots_free"]),
        ("kivi_decode_rows", "gauge", "rows the last decode step ran over (--paged: the smallest decode bucket "
         "holding the running requests)", s["decode_rows"]),
        ("kivi_cache_bytes", "gauge", "bytes held by the cache (every rank's together)", s["cache_bytes"]),
        ("kivi_tp_size", "gauge", "tensor-parallel ranks (torchrun processes) serving the model", s["tp_size"]),
        ("kivi_engine_stalled", "gauge", "1 while the engine has completed no step for --stall-timeout seconds with "
         "requests open (/health answers 503 engine_stalled), else 0", s["stalled"]),
        ("kivi_generated_tokens_total", "counter", "tokens generated since start", s["generated_tokens"]),
        ("kivi_tokens_per_second", "gauge", "generated tokens per second since start", s["tokens_per_s"]),
        *((("kivi_cache_pages_used", "gauge", "pages of the pool held by sequences or cached prefixes (--paged)",
            s["pages_used"]),
           ("kivi_cache_pages_free", "gauge", "pages of the pool free (--paged)", s["pages_free"]),
           ("kivi_cache_pages_shared", "gauge", "pages held by more than one sequence (--paged)", s["pages_shared"]),
           ("kivi_requests_swapped", "gauge", "preempted requests waiting in host memory (--paged)", s["swapped"]),
           ("kivi_preemptions_total", "counter", "requests preempted (swapped out) since start (--paged)",
            s["preemptions"])) if "pages_used" in s else ()),
        *((("kivi_cache_pages_cached", "gauge", "pages held by cached prefixes (--prefix-caching; reclaimable "
            "unless a sequence holds them too)", s["pages_cached"]),
           ("kivi_prefixes_cached", "gauge", "cached prefixes (--prefix-caching)", s["prefixes_cached"]),
           ("kivi_prefix_cache_bytes", "gauge", "host bytes the cached prefixes' tails hold (--prefix-caching; "
            "at most --prefix-cache-gib)", s["prefix_bytes"]),
           ("kivi_prefix_hits_total", "counter", "requests that started from a cached prefix (--prefix-caching)",
            s["prefix_hits"]),
           ("kivi_prefix_hit_tokens_total", "counter", "prompt tokens taken from cached prefixes, not prefilled "
            "(--prefix-caching)", s["prefix_hit_tokens"])) if "pages_cached" in s else ()),
    ):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]
    lines += ["# HELP kivi_cache_rank_bytes bytes of the cache each rank holds (its KV heads)",
              "# TYPE kivi_cache_rank_bytes gauge",
              *(f'kivi_cache_rank_bytes{{rank="{rank}"}} {b}' for rank, b in enumerate(s["cache_bytes_by_rank"]))]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def check_model(name: str, config: ServeConfig) -> Optional[JSONResponse]:
    if name != config.served_model_name:
        return error(404, f"the model {shortened(name)} does not exist; this server serves "
                          f"{config.served_model_name!r}", param="model", code="model_not_found")
    return None


def refused_early(texts: list[str], body, http: HTTPRequest) -> Optional[JSONResponse]:
    engine = http.app.state.engine
    at_least = -(-sum(len(t.encode("utf-8")) for t in texts) // http.app.state.longest_token)
    refused = engine.admission_error() or engine.capacity_error(at_least, body.max_tokens, at_least=True)
    return refused and refusal(refused, chat=isinstance(body, ChatBody))


@router.post("/v1/completions")
async def completions(body: CompletionBody, http: HTTPRequest):
    if (bad := check_model(body.model, http.app.state.config)) is not None:
        return bad
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) != 1:
        return error(400, "prompt: give one prompt per request", param="prompt", code="invalid_value")
    if (bad := refused_early(prompts, body, http)) is not None:
        return bad
    tokenizer = http.app.state.tokenizer
    ids = await run_in_threadpool(lambda: tokenizer(prompts[0])["input_ids"])  # off the event loop
    return await respond(body, ids, http, chat=False)


@router.post("/v1/chat/completions")
async def chat(body: ChatBody, http: HTTPRequest):
    if (bad := check_model(body.model, http.app.state.config)) is not None:
        return bad
    messages = [m.model_dump() for m in body.messages]
    if (bad := refused_early([m["content"] for m in messages], body, http)) is not None:
        return bad
    tokenizer = http.app.state.tokenizer
    ids = await run_in_threadpool(lambda: tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return await respond(body, ids, http, chat=True)


async def respond(body, ids: list[int], http: HTTPRequest, *, chat: bool):
    if body.stream_options is not None and not body.stream:
        return error(400, "stream_options: only allowed when stream is true", param="stream_options",
                     code="invalid_value")
    engine, model_name = http.app.state.engine, http.app.state.config.served_model_name
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    def emit(kind, payload):  # called from the engine thread
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (shutdown): no one listens
            pass

    request = Request(prompt_ids=ids, max_tokens=body.max_tokens, temperature=body.temperature,
                      top_p=body.top_p, seed=body.seed, stop=[s for s in stop if s], emit=emit)
    try:
        engine.submit(request)
    except RequestError as e:
        return refusal(e, chat)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.id}"
    created = int(time.time())
    usage = lambda: {"prompt_tokens": len(ids), "completion_tokens": len(request.tokens),  # noqa: E731
                     "total_tokens": len(ids) + len(request.tokens)}
    headers = {"x-request-id": request.id}
    if body.stream:
        with_usage = body.stream_options is not None and body.stream_options.include_usage
        chunks = stream(engine, request, events, Chunks(rid, created, model_name, chat, usage if with_usage else None))
        return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
    # Starlette does not watch the connection while a handler runs: await the answer and the disconnect together.
    answer = asyncio.ensure_future(collect(events))
    gone = asyncio.ensure_future(disconnected(http))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        abandoned = not answer.done()
        if abandoned:
            answer.cancel()
            engine.cancel(request)
    if abandoned:
        return Response(status_code=499)
    text, reason = answer.result()
    if isinstance(reason, Failure):
        return failed(reason, request.id)
    content = "".join(text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": reason}
              if chat else {"index": 0, "text": content, "finish_reason": reason, "logprobs": None})
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": model_name, "choices": [choice], "usage": usage()},
                        headers=headers)


async def collect(events: asyncio.Queue) -> tuple[list[str], Union[str, Failure]]:
    text = []
    while True:
        kind, payload = await events.get()
        if kind == "text":
            text.append(payload)
        else:
            return text, payload


async def disconnected(http: HTTPRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


@dataclass(frozen=True)
class Chunks:

    rid: str
    created: int
    model_name: str
    chat: bool
    usage: Optional[Callable[[], dict]]

    def chunk(self, text: Optional[str], reason: Optional[str], first: bool = False, totals: bool = False) -> str:
        if totals:
            choices = []
        elif self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text is not None else {})
            choices = [{"index": 0, "delta": delta, "finish_reason": reason}]
        else:
            choices = [{"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}]
        data = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices}
        if self.usage is not None:
            data["usage"] = self.usage() if totals else None
        return f"data: {json.dumps(data)}\n\n"


async def stream(engine: Engine, request: Request, events: asyncio.Queue, chunks: Chunks):
    try:
        if chunks.chat:
            yield chunks.chunk(None, None, first=True)
        while True:
            kind, payload = await events.get()
            if kind == "text":
                yield chunks.chunk(payload, None)
            elif kind == "done":
                yield chunks.chunk(None if chunks.chat else "", payload)
                if chunks.usage is not None:
                    yield chunks.chunk(None, None, totals=True)
                break
            else:
                yield f"data: {failed(payload, request.id).body.decode()}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:  # finished, or the client went away mid-stream: free the slot either way
        engine.cancel(request)


class Server(uvicorn.Server):
    """uvicorn's server with a bounded drain; exits 0 (uvicorn re-raises the signal) and heeds a second one."""

    def __init__(self, config: uvicorn.Config, engine: Engine, shutdown_timeout: float):
        config.timeout_graceful_shutdown = shutdown_timeout + 5  # the backstop: a client that stops reading its stream
        super().__init__(config)
        self.engine, self.shutdown_timeout, self.signals = engine, shutdown_timeout, 0

    def handle_exit(self, sig, frame) -> None:
        self.signals += 1
        if self.signals == 1:
            log.warning("shutting down: running requests have %g s to finish (--shutdown-timeout)",
                        self.shutdown_timeout)
            self.should_exit = True
            self.engine.drain(self.shutdown_timeout)
        else:
            log.warning("stopping now: ending every running request")
            self.engine.abort("the server is stopping now")
