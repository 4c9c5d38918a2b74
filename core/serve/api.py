"""An OpenAI-compatible API over the stores under one folder (FastAPI; run it with uvicorn).

    GET  /health                   {"status": "ok", "models": [the models loaded]}
    GET  /v1/models                the stores, as models
    GET  /v1/models/NAME           one store, as a model
    POST /v1/chat/completions      a request's messages continue its store's stream, on a copy:
                                   the store is unchanged unless the request sets "remember": true
                                   (then its last exchange is appended and committed; one writer
                                   per store, a second gets 409); "reread": true answers as
                                   `emllm ask` does by default (the stream's spans it read again: the
                                   response's "emllm": {"reread": {"passages"}}, when not streamed;
                                   unset: the server's default, `emllm serve --reread`, else false).
                                   "stream": true sends server-sent
                                   events. Sampling: temperature, top_p, seed, stop, max_tokens,
                                   presence_penalty, frequency_penalty, logit_bias, and (as llama.cpp's
                                   server) top_k, repetition_penalty. logprobs and top_logprobs
                                   (the model's own log probabilities). Refused (400), not
                                   ignored: tools, a response_format other than text,
                                   messages of other roles or with parts other than text.
    POST /v1/completions           the (legacy) completions: the prompt, text or token ids,
                                   continues the store's stream as it is, with no question's
                                   framing, and the model continues it (emllm's own reading; a
                                   base model's form). The same sampling, stop, stream and
                                   "remember" (the prompt and the completion appended); logprobs N
                                   (0-20) in that API's form, echo (with logprobs: the prompt's
                                   tokens scored, max_tokens 0 allowed). One prompt and one choice
                                   a request; suffix refused.

Each store is answered by the model it was written with: a loaded one of the same weights and
dtype, else its own, loaded then (`emllm.ModelPool`: at most `max_models` stay loaded, the least
recently used unloaded first, and a few stores stay open). Requests are answered one at a time (the engine is
single-threaded); concurrent ones wait their turn, and an answer whose client leaves stops at its
next token, or while its prompt is read, at the prompt's next chunk.
Errors are OpenAI-style JSON bodies ({"error": {"message", "type", "code"}}) with a 4xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import threading
import time
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable, Iterator, TypeVar

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, StrictInt, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.types import Message as AsgiMessage  # (Message: a chat message, below)

import emllm
from emllm import SEED_LIMIT, EmllmError, Memory, ModelPool, StoreLockedError, TooManyOpenFiles, logprob_texts

_END = object()  # a streamed answer's producer has finished
_GONE = object()  # a request's client left before its answer's next item
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a store's name: never a path


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param


class Message(BaseModel):
    role: str
    content: str | list[dict] | None = None


class StreamOptions(BaseModel):
    include_usage: bool | None = None  # a last chunk with the request's usage (its choices empty)


class ChatRequest(BaseModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    # (null where OpenAI's API takes it for "unset": some clients send every field)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    logprobs: bool | None = None  # each answer token's log probability under the model
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # and this many alternatives (with logprobs)
    n: int | None = Field(default=None, ge=1)  # choices: one (more are refused, not dropped)
    top_k: int | None = Field(default=None, ge=0)  # beyond OpenAI's fields, as llama.cpp's server takes them
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as text) to a bias in [-100, 100]
    # What emllm does not do, refused rather than ignored (an answer without them would pass for one with them)
    tools: list | None = None
    functions: list | None = None
    response_format: dict | None = None
    remember: bool | None = None  # emllm's own: append this exchange to the store
    reread: bool | None = None  # emllm's own: answer by re-reading the passages the memory chose (`ask --reread`); unset: the server's default


class CompletionRequest(BaseModel):
    """OpenAI's (legacy) completions, as llama.cpp's and vLLM's servers take them."""
    model: str
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # text or token ids (JSON integers); one prompt a request
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # (0, with echo and logprobs: the prompt scored alone)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)  # each token's log probability and this many alternatives
    echo: bool | None = None  # the prompt given back before the completion (with logprobs: scored)
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None  # (insertion: refused)
    top_k: int | None = Field(default=None, ge=0)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as text) to a bias in [-100, 100]
    remember: bool | None = None  # emllm's own: append the prompt and the completion to the store
    reread: bool | None = None  # (a completion is emllm's own reading: true is refused)


_Request = TypeVar("_Request", ChatRequest, CompletionRequest)


class Server:
    """The stores under `root` and the models that answer them (`pool`)."""

    def __init__(self, root: Path, pool: ModelPool, max_tokens: int = 2048, api_key: str | None = None,
                 reread: bool | None = None) -> None:
        self.root, self.pool = Path(root), pool
        self.max_tokens, self.api_key = max_tokens, api_key
        self.reread = reread  # for requests that do not say (`emllm serve --reread`; None: the library's default)
        self.lock = threading.Lock()  # one generation at a time: the models and their attention are shared

    def store_path(self, name: str) -> Path:
        if not NAME.fullmatch(name):
            raise ApiError(400, f"model {name[:80]!r} is not a store name (letters, digits, . _ -; no paths)",
                           param="model", code="invalid_model")
        path = self.root / name
        if path.is_symlink() or not emllm.is_store(path):
            raise ApiError(404, f"no store {name!r}: GET /v1/models lists them", param="model", code="model_not_found")
        return path

    def limit(self, given: int | None, default: int) -> int:
        """A request's max_tokens, within this server's."""
        if given is not None and given > self.max_tokens:
            raise ApiError(400, f"max_tokens {given} is more than this server allows ({self.max_tokens})", param="max_tokens")
        return min(default, self.max_tokens) if given is None else given

    def memory(self, name: str) -> Memory:
        """The store `name` with its model (loaded if it is not), held between requests: each
        keeps its stream's tail read. Called under the lock."""
        return self.pool.memory(self.store_path(name))

    def loaded(self) -> list[str]:
        """The models loaded, the most recently used last."""
        return [m.given or m.name for m in self.pool.models]

    def models(self) -> list[dict]:
        out = []
        if self.root.is_dir():
            for p in sorted(self.root.iterdir()):
                if NAME.fullmatch(p.name) and not p.is_symlink() and emllm.is_store(p):
                    out.append({"id": p.name, "object": "model", "created": int((p / "manifest.json").stat().st_mtime),
                                "owned_by": "emllm"})
        return out


def create_app(server: Server, max_body: int = 1 << 20) -> FastAPI:
    app = FastAPI(title="emllm", docs_url=None, redoc_url=None, openapi_url=None)

    class Limits:
        """The key and the body's size, checked before a request reaches its endpoint. Plain ASGI
        (not BaseHTTPMiddleware): the endpoint keeps the server's own `receive`, through which it
        sees its client leave (`Request.is_disconnected`)."""

        def __init__(self, app: ASGIApp) -> None:
            self.app = app

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                headers = Headers(scope=scope)
                size = headers.get("content-length")
                refused = None
                given = headers.get("authorization", "").encode("latin-1")  # (the bytes sent: Starlette decodes latin-1)
                if (server.api_key is not None and scope["path"] != "/health"  # (compared in constant time)
                        and not hmac.compare_digest(given, f"Bearer {server.api_key}".encode("utf-8", "surrogateescape"))):
                    refused = ApiError(401, "a valid API key is needed (Authorization: Bearer ...)",
                                       kind="authentication_error", code="invalid_api_key")
                elif size is not None and (not size.isdigit() or int(size) > max_body):
                    refused = ApiError(413, f"the request body is larger than {max_body} bytes")
                if refused is not None:
                    await _error(refused)(scope, receive, send)
                    return
                receive = _bounded(receive, max_body)  # (a body sent in chunks has no length to check first)
            await self.app(scope, receive, send)

    app.add_middleware(Limits)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        if first.get("type") == "json_invalid":  # (its place is a character offset, not a field)
            why = (first.get("ctx") or {}).get("error")
            return _error(ApiError(400, "the request body is not valid JSON" + (f": {why}" if why else "")))
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return _error(ApiError(400, f"{where or 'the request body'}: {first.get('msg', 'invalid request')}",
                               param=where or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # an unknown path or method: OpenAI's error body too, not Starlette's {"detail": ...}
        what = {404: f"no such endpoint: {request.method} {request.url.path}",
                405: f"{request.url.path} does not take {request.method}"}.get(e.status_code, str(e.detail))
        if e.status_code in (404, 405):
            what += (" (emllm serves GET /v1/models, GET /v1/models/NAME, POST /v1/chat/completions, "
                     "POST /v1/completions, GET /health)")
        return _error(ApiError(e.status_code, what, code="not_found" if e.status_code == 404 else None))

    @app.exception_handler(EmllmError)
    async def user_error(_request: Request, e: EmllmError) -> JSONResponse:
        status = 409 if isinstance(e, StoreLockedError) else 503 if isinstance(e, TooManyOpenFiles) else 400
        return _error(ApiError(status, str(e), kind="server_error" if status == 503 else "invalid_request_error"))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "models": server.loaded()}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": server.models()}

    @app.get("/v1/models/{name}")
    def model(name: str) -> dict:  # (the OpenAI client's models.retrieve)
        for m in server.models():
            if m["id"] == name:
                return m
        raise ApiError(404, f"no store {name!r}: GET /v1/models lists them", param="model", code="model_not_found")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):  # type: ignore[no-untyped-def]
        req = _request(ChatRequest, await request.body())
        limit = server.limit(req.max_completion_tokens or req.max_tokens, 256)
        _one_choice(req.n)
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        top = (req.top_logprobs or 0) if req.logprobs else None
        for field, given in (("tools", req.tools), ("functions", req.functions),
                             ("response_format", (req.response_format or {}).get("type", "text") != "text")):
            if given:
                raise ApiError(400, f"{field}: emllm does not support it (it answers with text only)", param=field,
                               code="unsupported_parameter")
        stop = _stops(req.stop)
        rid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        messages = [m.model_dump() for m in req.messages]

        answering = _Answering(rid)

        def run() -> Iterator[str | dict]:
            with server.lock:
                mem = server.memory(req.model)
                answer = answering.answer = mem.reply(messages, limit, stop, sampling=_sampling(mem, req), top_logprobs=top,
                                                      reread=server.reread if req.reread is None else req.reread)
                seen = 0  # log probabilities sent (with a piece of text, those of the tokens chosen since the last)
                for piece in answer:
                    lp = answer.logprobs
                    yield piece, None if lp is None else _logprobs(mem.tokenizer, lp, seen)
                    seen = len(lp or ())
                if req.remember:
                    mem.remember(answer)
                lp = answer.logprobs
                yield {"finish_reason": answer.finish_reason, "completion_tokens": answer.tokens,
                       "logprobs": None if lp is None else _logprobs(mem.tokenizer, lp, seen),
                       "prompt_tokens": answer.prompt_tokens,
                       "passages": [list(p) for p in answer.passages] if answer.reread else None}

        first = await answering.start(run, request)  # errors (no store, another model) before the 200 of a stream
        if first is _GONE:
            return Response(status_code=499)  # (nobody reads it)

        if not req.stream:
            parts, logprobs, x = [], [], first
            try:
                while not isinstance(x, dict):
                    if x is _GONE:
                        return Response(status_code=499)  # (nobody reads it)
                    parts.append(x[0])
                    logprobs += x[1] or []
                    x = await answering.take(request)
            finally:
                answering.stop()
            logprobs += x.get("logprobs") or []
            return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts).strip()},
                                 "logprobs": {"content": logprobs, "refusal": None} if top is not None else None,
                                 "finish_reason": x.get("finish_reason", "stop")}],
                    "usage": _usage(x),
                    **({"emllm": {"reread": {"passages": x["passages"]}}} if x.get("passages") is not None else {})}

        usage = req.stream_options is not None and bool(req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            # (with include_usage, OpenAI's chunks say "usage": null until the last, which has no choices)
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                    **({"usage": None} if usage else {})}
            try:
                yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
                x = first
                while not isinstance(x, dict):
                    yield _sse({**base, "choices": [{"index": 0, "delta": {"content": x[0]}, **_chunk_logprobs(x[1]),
                                                     "finish_reason": None}]})
                    x = await answering.take()
                yield _sse({**base, "choices": [{"index": 0, "delta": {}, **_chunk_logprobs(x.get("logprobs") or None),
                                                 "finish_reason": x.get("finish_reason", "stop")}]})
                if usage:
                    yield _sse({**base, "choices": [], "usage": _usage(x)})
                yield "data: [DONE]\n\n"
            finally:  # (a client gone: the response's task is cancelled here, and the answer stops)
                answering.stop()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):  # type: ignore[no-untyped-def]
        req = _request(CompletionRequest, await request.body())
        prompt = _prompt(req.prompt)
        limit = server.limit(req.max_tokens, 16)  # (OpenAI's default for completions)
        _one_choice(req.n)
        for field, refused, why in (("best_of", (req.best_of or 1) != 1, "emllm completes with one choice a request"),
                                    ("suffix", bool(req.suffix), "emllm does not insert text (it continues the prompt)"),
                                    ("reread", bool(req.reread), "a completion is emllm's own reading of its memory")):
            if refused:
                raise ApiError(400, f"{field}: {why}", param=field, code="unsupported_parameter")
        stop = _stops(req.stop)
        top, echo = req.logprobs, bool(req.echo)
        rid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        answering = _Answering(rid)

        def run() -> Iterator[tuple | dict]:
            with server.lock:
                mem = server.memory(req.model)
                answer = answering.answer = mem.complete(prompt, limit, stop, sampling=_sampling(mem, req),
                                                         top_logprobs=top, echo=echo and top is not None)
                legacy = _LegacyLogprobs(mem.tokenizer, answer.prompt_ids[-1])
                pieces = iter(answer)
                piece = next(pieces, None)  # (the prompt is read by then: its log probabilities are known)
                if echo:
                    text = prompt if isinstance(prompt, str) else mem.tokenizer.decode(prompt)
                    yield text, None if top is None else legacy.prompt(answer.prompt_logprobs, text)
                seen = 0
                while piece is not None:
                    lp = answer.logprobs
                    yield piece, None if lp is None else legacy.tokens(lp[seen:])
                    seen = len(lp or ())
                    piece = next(pieces, None)
                if req.remember:
                    mem.remember(answer)
                lp = answer.logprobs
                yield {"finish_reason": answer.finish_reason, "completion_tokens": answer.tokens,
                       "prompt_tokens": answer.prompt_tokens, "logprobs": None if lp is None else legacy.tokens(lp[seen:])}

        first = await answering.start(run, request)
        if first is _GONE:
            return Response(status_code=499)
        base = {"id": rid, "object": "text_completion", "created": created, "model": req.model}

        if not req.stream:
            parts, logprobs, x = [], _LegacyLogprobs.empty(), first
            try:
                while not isinstance(x, dict):
                    if x is _GONE:
                        return Response(status_code=499)  # (nobody reads it)
                    parts.append(x[0])
                    _LegacyLogprobs.extend(logprobs, x[1])
                    x = await answering.take(request)
            finally:
                answering.stop()
            _LegacyLogprobs.extend(logprobs, x.get("logprobs"))
            return {**base, "choices": [{"index": 0, "text": "".join(parts), "logprobs": logprobs if top is not None else None,
                                         "finish_reason": x.get("finish_reason", "stop")}], "usage": _usage(x)}

        usage = req.stream_options is not None and bool(req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            chunk = {**base, **({"usage": None} if usage else {})}
            try:
                x = first
                while not isinstance(x, dict):
                    yield _sse({**chunk, "choices": [{"index": 0, "text": x[0], "logprobs": x[1], "finish_reason": None}]})
                    x = await answering.take()
                yield _sse({**chunk, "choices": [{"index": 0, "text": "", "logprobs": x.get("logprobs"),
                                                  "finish_reason": x.get("finish_reason", "stop")}]})
                if usage:
                    yield _sse({**chunk, "choices": [], "usage": _usage(x)})
                yield "data: [DONE]\n\n"
            finally:
                answering.stop()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class _Answering:
    """A request's answer made by a thread of its own, which holds the store's turn (the server's
    lock) and stops once the response ends for any reason, a client gone included (while its
    prompt is read: at the next chunk; while it is generated: at the next token): an answer left
    running, or suspended under the lock when its client went, kept every later request waiting.
    Its items reach the response through the event loop's queue: a request waiting its turn
    holds no worker thread (/health and /v1/models stay answered however many wait). `run`
    yields the answer's items, a dict last (its end), and sets `answer` once it has one."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.items: asyncio.Queue = asyncio.Queue()
        self.done = threading.Event()  # set: the response has ended, the answer stops
        self.answer: emllm.Answer | None = None

    def stop(self) -> None:
        self.done.set()
        if self.answer is not None:
            self.answer.cancel()

    async def start(self, run: Callable[[], Iterator], request: Request) -> object:
        """Starts the thread; returns the first item (raising the answer's error, if it fails
        before; `_GONE` if the client leaves first)."""
        loop = asyncio.get_running_loop()

        def put(x: object) -> None:
            try:
                loop.call_soon_threadsafe(self.items.put_nowait, x)
            except RuntimeError:  # (the loop is closed: the server is stopping)
                self.done.set()

        def produce() -> None:
            gen = run()
            try:
                for x in gen:
                    if self.done.is_set():
                        break  # (not remembered: the client did not take the answer)
                    put(x)
            except BaseException as e:  # noqa: BLE001 - handed to the response, raised there
                put(e)
            finally:
                gen.close()
                put(_END)

        threading.Thread(target=produce, name=f"emllm-{self.rid}", daemon=True).start()
        try:
            return await self.take(request)
        except BaseException:
            self.stop()
            raise

    async def take(self, request: Request | None = None) -> object:
        """The next item; with `request`, `_GONE` (the answer stopped) if its client leaves first."""
        get = asyncio.ensure_future(self.items.get())
        try:
            while True:  # (with a request: its client looked at each item and each quarter of a second)
                ready = (await asyncio.wait({get}, timeout=None if request is None else 0.25))[0]
                if request is not None and await request.is_disconnected():
                    self.stop()
                    return _GONE
                if ready:
                    break
            x = get.result()
        finally:
            get.cancel()
        if isinstance(x, BaseException):
            raise x
        return {"finish_reason": "stop"} if x is _END else x


def _request(kind: type[_Request], body: bytes) -> _Request:
    """A request's body read as JSON whatever its Content-Type says: `curl -d` sends JSON as a
    form, and llama.cpp's and ollama's servers take it so."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as e:  # (placed under "body", as FastAPI places the errors of a body it reads)
        if kind is CompletionRequest and e.errors()[0].get("loc", ())[:1] == ("prompt",):  # (not the union's first member's)
            raise ApiError(400, "prompt: text, or token ids (a list of integers); one prompt a request",
                           param="prompt") from None
        raise RequestValidationError([{**x, "loc": ("body", *x.get("loc", ()))} for x in e.errors()]) from None


def _prompt(given: str | list) -> str | list[int]:
    """A completion request's one prompt: text or token ids."""
    if isinstance(given, list) and given and isinstance(given[0], (str, list)):
        if len(given) != 1:
            raise ApiError(400, f"{len(given)} prompts: emllm completes one prompt a request", param="prompt")
        given = given[0]
    if not given:
        raise ApiError(400, "the prompt is empty", param="prompt")
    return given


class _LegacyLogprobs:
    """The completions API's logprobs: parallel lists of the tokens' text (each as it reads after
    the token before it: they join to the choice's text), their log probabilities, their likeliest
    alternatives (text to log probability, the chosen token's among them, as vLLM gives them) and
    where each token's text starts in the choice's text."""

    def __init__(self, tok, before: int | None) -> None:
        self.tok, self.offset, self.prev = tok, 0, before

    @staticmethod
    def empty() -> dict:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    @staticmethod
    def extend(into: dict, more: dict | None) -> None:
        for k, v in (more or {}).items():
            into[k] += v

    def tokens(self, entries: list) -> dict:  # (entries: emllm.engine.sampling.TokenLogprob)
        out = self.empty()
        for e, (text, alts) in zip(entries, logprob_texts(self.tok, entries, self.prev)):
            out["tokens"].append(text)
            out["text_offset"].append(self.offset)
            out["token_logprobs"].append(e.logprob)
            top = {alt: lp for alt, (_, lp) in zip(alts, e.top)}
            out["top_logprobs"].append(None if e.logprob is None else {**top, text: e.logprob})
            self.offset += len(text)
            self.prev = e.token
        return out

    def prompt(self, entries: list, text: str) -> dict:
        """An echoed prompt's (its first token's log probability None where nothing predicts it);
        the completion's offsets start after the prompt's text."""
        self.prev = None  # (the prompt's text as given: its first token read on its own)
        out = self.tokens(entries)
        self.offset = len(text)
        return out


def _one_choice(n: int | None) -> None:
    if (n or 1) != 1:
        raise ApiError(400, f"n {n}: emllm answers with one choice a request", param="n")


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > 4:
        raise ApiError(400, "at most 4 stop sequences", param="stop")
    return stops


def _sampling(mem: Memory, req: "ChatRequest | CompletionRequest") -> emllm.Sampling:
    """A request's sampling (bounds checked; unset values from the generation config of the store's model)."""
    bias = None
    if req.logit_bias:
        bad = [k for k in req.logit_bias if not (k.isascii() and k.isdigit() and len(k) <= 12)]
        if bad:
            raise ApiError(400, f"logit_bias: {bad[0][:40]!r} is not a token id", param="logit_bias")
        bias = {int(k): v for k, v in req.logit_bias.items()}
    return emllm.sampling(mem.loaded, temperature=req.temperature, top_p=req.top_p, seed=req.seed, top_k=req.top_k,
                          repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                          frequency_penalty=req.frequency_penalty, logit_bias=bias)


def _logprobs(tok, entries: list, start: int = 0) -> list[dict]:  # (entries: emllm.engine.sampling.TokenLogprob)
    """OpenAI's `logprobs.content` items of `entries[start:]`: each token's text (read after the
    token before it, so that a SentencePiece word keeps its space), log probability, UTF-8 bytes
    and its likeliest alternatives."""
    def one(logprob: float, text: str) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    before = entries[start - 1].token if start else None
    return [{**one(e.logprob, text), "top_logprobs": [one(lp, alt) for (_, lp), alt in zip(e.top, alts)]}
            for e, (text, alts) in zip(entries[start:], logprob_texts(tok, entries[start:], before))]


def _chunk_logprobs(entries: list | None) -> dict:
    """A streamed chunk's logprobs: those of the tokens chosen since the last chunk, where asked."""
    return {} if entries is None else {"logprobs": {"content": entries, "refusal": None}}


def _usage(end: dict) -> dict:
    """OpenAI's usage of a request from its answer's end."""
    p, c = end.get("prompt_tokens", 0), end.get("completion_tokens", 0)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _bounded(receive: Receive, limit: int) -> Receive:
    """`receive`, refusing (413) a body that grows past `limit` bytes as it is read."""
    seen = 0

    async def bounded() -> AsgiMessage:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:  # (FastAPI's body reading passes an HTTPException on as it is)
                raise HTTPException(413, f"the request body is larger than {limit} bytes")
        return message

    return bounded


def _sse(doc: dict) -> str:
    return f"data: {json.dumps(doc)}\n\n"


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(status_code=e.status, content={"error": {"message": e.message, "type": e.kind,
                                                                 "param": e.param, "code": e.code}})


__all__ = ["Server", "create_app", "ApiError"]
