"""`kvchat serve`: an OpenAI-compatible HTTP server over one loaded model.

Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions and POST /v1/completions, each
streaming (server-sent events, `"stream": true`) or not. Requests go through core.live.LiveEngine:
one engine thread, continuous batching on the engines that batch, prefix reuse and the disk KV
cache. A client that disconnects (closes its stream, or drops a non-streaming request) cancels its
request.

Responses carry OpenAI's `usage` and llama-server's `timings` (core.types.Timings). Every error is
OpenAI's error object, {"error": {"message", "type", "param", "code"}}, with a 4xx status for a bad
request: bad JSON or a field of the wrong type (400), a prompt over the context (400,
context_length_exceeded), a missing or wrong API key (401), an unknown path (404), a body over
--max-body (413); 503 when --max-concurrency sequences run and the queue of waiting requests is full.
An unexpected failure is a 500 with a generic message (the traceback goes to the server's stderr).

The ASGI side only parses and validates requests, renders prompts (the engine's chat template) and
moves events between the engine thread and the event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import sys
import time
import traceback
import uuid
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from sse_starlette.sse import EventSourceResponse

from app.args import BATCH_OPTIONS, sampling_from_json
from core.batch import BatchResult
from core.constrained import schema_from_response_format
from core.live import LiveEngine, QueueFull
from core.request import check_prompt
from core.types import SamplingParams
from models.errors import BadInputError

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY = 1 << 20          # bytes


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=headers)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --- request bodies ----------------------------------------------------------------------------
# OpenAI's sampling fields that kvchat's differ from, and kvchat's own extras (top_k, min_p, ...)
# are taken under their SamplingParams names. Other fields are ignored, as OpenAI's server does
# with fields it does not use, but a known field of the wrong type is a 400.
_SAMPLING_NAMES = {f.name for f in BATCH_OPTIONS}


def _param_of(message: str, names) -> str | None:
    """Which field an error message from app.args / SamplingParams.validate speaks of."""
    words = message.replace("-", "_").split()
    return next((n for n in names if words and words[0] == n), None) or \
        next((n for n in names if n.replace("_", " ") in message.replace("-", " ")), None)


def sampling_params(body: dict, n_ctx: int) -> SamplingParams:
    """An OpenAI request's sampling fields (max_tokens or max_completion_tokens, temperature, top_p,
    stop, seed, presence_penalty, frequency_penalty, logit_bias, response_format; kvchat's top_k,
    min_p, repeat_penalty, repeat_last_n, json_schema, grammar) as SamplingParams. Without max_tokens a reply runs to the end of
    the context (or an end-of-generation token), as llama-server's does."""
    fields = {k: body[k] for k in _SAMPLING_NAMES if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        fields["max_tokens"] = body["max_completion_tokens"]
    base = SamplingParams(max_tokens=n_ctx)
    try:
        params = sampling_from_json(fields, base)
    except BadInputError as e:
        param = _param_of(str(e), list(fields))
        if param == "max_tokens" and "max_completion_tokens" in body:
            param = "max_completion_tokens"
        raise _bad(str(e), param) from None
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _bad("logit_bias must be an object of token id to bias", "logit_bias")
        pairs = []
        for k, v in bias.items():
            if not (isinstance(k, str) and k.isdigit()) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v) or abs(v) > 100:
                raise _bad("logit_bias maps token ids to numbers in [-100, 100]", "logit_bias")
            pairs.append((int(k), -math.inf if v == -100 else float(v)))
        params = dataclasses.replace(params, logit_bias=tuple(pairs))
    if body.get("response_format") is not None:
        params = _response_format(body["response_format"], params)
    return params


def _response_format(rf: Any, params: SamplingParams) -> SamplingParams:
    """OpenAI's response_format as constrained decoding (core.constrained.schema_from_response_format:
    a json_schema's schema, any object for json_object, nothing for text)."""
    try:
        schema = schema_from_response_format(rf)
        return params if schema is None else dataclasses.replace(params, json_schema=schema).validate()
    except BadInputError as e:
        raise _bad(str(e), "response_format") from None


def _check_common(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage); n other than 1 and fields of the wrong type are refused."""
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
        raise _bad("stream_options must be an object with a boolean include_usage", "stream_options")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _bad("only n = 1 is supported", "n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model must be a string", "model")
    if body.get("logprobs") not in (None, False, 0):
        raise _bad("logprobs are not supported", "logprobs")
    if body.get("echo") not in (None, False):
        raise _bad("echo is not supported", "echo")
    return bool(stream), bool((opts or {}).get("include_usage", False))


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):    # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a role", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _message_text(m.get("content"), i)})
    return out


def completion_prompt(body: dict, engine) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("the prompt is empty", "prompt")
        return engine.prompt_ids(prompt, chat=False)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        n_vocab = engine.tokenizer.n_vocab
        if not all(0 <= t < n_vocab for t in prompt):
            raise _bad(f"token ids must be in [0, {n_vocab})", "prompt")
        return list(prompt)
    raise _bad("prompt must be a string, a list of one string or a list of token ids", "prompt")


# --- the app -----------------------------------------------------------------------------------
class Server:
    def __init__(self, engine, live: LiveEngine, api_key: str | None = None, max_body: int = DEFAULT_MAX_BODY):
        self.engine, self.live = engine, live
        self.api_key = api_key.encode() if api_key else None
        self.max_body = max_body
        self.created = int(time.time())

    # -- plumbing --
    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        scheme, _, key = got.partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.api_key)):
            raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                           type="authentication_error", code="invalid_api_key")

    async def read_body(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        too_big = ApiError(413, f"the request body is over {self.max_body} bytes (--max-body)",
                           code="request_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise too_big
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > self.max_body:
                raise too_big
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the body is not valid JSON ({getattr(e, 'msg', e)})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object", code="invalid_json")
        return body

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            check_prompt(ids, self.engine.n_ctx)
        except BadInputError as e:
            raise _bad(str(e), param, "context_length_exceeded" if ids else None) from None

    def usage(self, result: BatchResult, prompt_n: int) -> dict:
        completion = result.timings.predicted_n
        return {"usage": {"prompt_tokens": prompt_n, "completion_tokens": completion,
                          "total_tokens": prompt_n + completion},
                "timings": result.timings.as_dict()}

    # -- endpoints --
    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "model": self.engine.model_name, **self.live.status()})

    async def models(self, request: Request) -> JSONResponse:
        self.check_key(request)
        return JSONResponse({"object": "list", "data": [
            {"id": self.engine.model_name, "object": "model", "created": self.created, "owned_by": "kvchat",
             "meta": {"n_ctx": self.engine.n_ctx, "backend": self.engine.backend_name}}]})

    async def chat(self, request: Request):
        self.check_key(request)
        body = await self.read_body(request)
        stream, include_usage = _check_common(body)
        messages = chat_messages(body)
        params = sampling_params(body, self.engine.n_ctx)
        try:
            ids = self.engine.prompt_ids(messages, chat=self.engine.has_chat_template)
        except Exception as e:      # the template's raise_exception (say, roles out of order)
            raise _bad(f"the model's chat template refused these messages: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
                       "messages") from None
        self.check_prompt(ids, "messages")
        return await self.respond(request, ids, params, stream, include_usage, chat=True)

    async def completions(self, request: Request):
        self.check_key(request)
        body = await self.read_body(request)
        stream, include_usage = _check_common(body)
        ids = completion_prompt(body, self.engine)
        params = sampling_params(body, self.engine.n_ctx)
        self.check_prompt(ids, "prompt")
        return await self.respond(request, ids, params, stream, include_usage, chat=False)

    # -- running a request --
    def submit(self, ids: list[int], params: SamplingParams) -> tuple[Any, asyncio.Queue]:
        """Queue the request; its text pieces and then its BatchResult arrive on the asyncio queue."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, item)
            except RuntimeError:    # the loop has closed (shutdown)
                pass
        try:
            handle = self.live.submit(ids, params, put, put)
        except QueueFull as e:
            raise ApiError(503, f"the server is busy: {e}; retry later", type="server_error",
                           code="server_busy") from None
        return handle, events

    async def respond(self, request: Request, ids: list[int], params: SamplingParams, stream: bool,
                      include_usage: bool, chat: bool):
        handle, events = self.submit(ids, params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.engine.model_name}
        if not stream:
            return await self.whole(request, handle, events, head, chat, len(ids))
        return EventSourceResponse(self.chunks(handle, events, head, chat, include_usage, len(ids)),
                                   ping=15, sep="\n")

    async def whole(self, request: Request, handle, events: asyncio.Queue, head: dict, chat: bool, prompt_n: int):
        pieces: list[str] = []
        try:
            while True:
                try:
                    item = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        handle.cancel()
                    continue
                if isinstance(item, BatchResult):
                    break
                pieces.append(item)
        finally:
            handle.cancel()     # (no-op once it has finished; ends it if this handler is cancelled)
        result = item
        if result.error is not None:
            raise ApiError(500, "the engine failed on this request", type="server_error")
        text = "".join(pieces)
        choice = {"index": 0, "finish_reason": result.finish_reason, "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        return JSONResponse(head | {"choices": [choice]} | self.usage(result, prompt_n))

    async def chunks(self, handle, events: asyncio.Queue, head: dict, chat: bool, include_usage: bool,
                     prompt_n: int) -> AsyncIterator[dict]:
        head = head | {"object": "chat.completion.chunk" if chat else "text_completion"}

        def chunk(delta: dict | None, text: str | None, finish: str | None) -> dict:
            choice = {"index": 0, "finish_reason": finish, "logprobs": None}
            choice |= {"delta": delta} if chat else {"text": text}
            return {"data": json.dumps(head | {"choices": [choice]}, ensure_ascii=False)}
        try:
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None, None)
            while True:
                item = await events.get()
                if isinstance(item, BatchResult):
                    break
                yield chunk({"content": item}, item, None)
            result = item
            if result.error is not None:
                yield {"data": json.dumps({"error": {"message": "the engine failed on this request",
                                                     "type": "server_error", "param": None, "code": None}})}
                return
            last = json.loads(chunk({}, "", result.finish_reason)["data"])
            last["timings"] = result.timings.as_dict()
            yield {"data": json.dumps(last)}
            if include_usage:
                yield {"data": json.dumps(head | {"choices": []} | self.usage(result, prompt_n))}
            yield {"data": "[DONE]"}
        finally:
            handle.cancel()     # the client went away (or the stream ended: then a no-op)

    def app(self) -> Starlette:
        def guarded(endpoint):
            async def run(request: Request):
                try:
                    return await endpoint(request)
                except ApiError as e:
                    return e.response()
                except Exception:
                    traceback.print_exc(file=sys.stderr)
                    return ApiError(500, "internal server error", type="server_error").response()
            return run

        async def http_error(request: Request, exc: HTTPException):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", type=kind).response()

        async def server_error(request: Request, exc: Exception):
            return ApiError(500, "internal server error", type="server_error").response()

        routes = [
            Route("/health", guarded(self.health), methods=["GET"]),
            Route("/v1/models", guarded(self.models), methods=["GET"]),
            Route("/v1/chat/completions", guarded(self.chat), methods=["POST"]),
            Route("/v1/completions", guarded(self.completions), methods=["POST"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})


def cmd_serve(args) -> int:
    import uvicorn
    from app.cli import load_engine
    if not 0 <= args.port <= 65535:
        raise BadInputError("--port must be between 0 and 65535")
    if args.max_concurrency < 1:
        raise BadInputError("--max-concurrency must be >= 1")
    if args.max_queue < 0:
        raise BadInputError("--max-queue must be >= 0")
    from app.args import size_arg
    max_body = size_arg(args.max_body, "--max-body")
    sock = _listen(args.host, args.port)     # a taken port is one line, before the model loads
    try:
        engine = load_engine(args)
        try:
            live = LiveEngine(engine, max_concurrency=args.max_concurrency, max_queue=args.max_queue)
            server = Server(engine, live, api_key=args.serve_api_key, max_body=max_body)
            host = f"[{args.host}]" if ":" in args.host else args.host
            port = sock.getsockname()[1]
            sys.stderr.write(f"kvchat: serving {engine.model_name} ({engine.backend_name}, {engine.n_ctx} tokens "
                             f"of context) at http://{host}:{port}/v1 (Ctrl-C stops)\n")
            sys.stderr.flush()
            config = uvicorn.Config(server.app(), log_level="warning", access_log=False, timeout_graceful_shutdown=3)

            class Uvicorn(uvicorn.Server):
                def handle_exit(self, sig, frame):   # Ctrl-C: running requests end now ("cancelled")
                    live.cancel_all()
                    super().handle_exit(sig, frame)
            try:
                Uvicorn(config).run(sockets=[sock])
            except KeyboardInterrupt:     # (uvicorn raises the signal again once it has shut down)
                pass
            finally:
                live.close()
            sys.stderr.write("kvchat: server stopped\n")
        finally:
            engine.close()
    finally:
        sock.close()
    return 0


def _listen(host: str, port: int):
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise BadInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def add_serve_parser(subparsers, add_model_args) -> None:
    from core.live import DEFAULT_MAX_CONCURRENCY, DEFAULT_MAX_QUEUE
    # (conflict_handler: the model flags may have a client's --api-key, for a remote backend; here
    # --api-key is the key this server asks of its clients)
    p = subparsers.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions)",
                              conflict_handler="resolve")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    p.add_argument("--api-key", dest="serve_api_key", default=None, metavar="KEY",
                   help="every request must then carry Authorization: Bearer KEY (/health excepted)")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"most requests generating at once, continuously batched (default: {DEFAULT_MAX_CONCURRENCY}); "
                        "the rest wait in order")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help=f"most requests waiting beyond those; more get 503 (default: {DEFAULT_MAX_QUEUE})")
    p.add_argument("--max-body", default="1M", metavar="SIZE",
                   help="largest request body, e.g. 1M or 500K; larger gets 413 (default: 1M)")
