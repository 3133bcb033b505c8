"""`edgemoe serve`: an OpenAI-compatible HTTP API over the continuous-batching Engine (engine.py).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the
tokenizer's chat template); `"stream": true` answers as server-sent events ending in `data: [DONE]`.
The HTTP stack is the standard library's ThreadingHTTPServer (one thread per connection; the choice
and its measurement are in docs/serving.md). Handler threads parse, tokenize and wait on their
request's events; only the engine thread touches the model.

Errors are JSON bodies in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx
status for bad requests; a handler never lets an exception take the server down.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .engine import Engine, Event, Request
from .errors import ContextLengthError
from .errors import EdgeMoEError, TextError
from .generate import GenerationOptions, defaults_from
from .model import MoEModel
from .tokenizer import valid_text

log = logging.getLogger("edgemoe.server")

MAX_BODY_BYTES = 1 << 20          # a request body larger than this is refused with 413
DRAIN_LIMIT_BYTES = 64 << 20      # read (and drop) an oversize body up to this, so the client sees the 413
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat runs to the context
POLL_SECONDS = 0.05               # how often a waiting handler checks that its client is still there


class APIError(Exception):
    """A request the server refuses: becomes {"error": {...}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_field(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _text(value: str, param: str) -> str:
    """A request's text field, refused (400) if it is not valid UTF-8 (a JSON string may hold a lone
    surrogate, "\\ud800", which no tokenizer can take)."""
    try:
        return valid_text(value, param)
    except TextError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None


# ---- request fields -------------------------------------------------------------------------------------
def _number(body: dict, name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad_field(name, f"expected a number in [{low}, {high}], got {value!r}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise bad_field(name, f"expected {expected}, got {value!r}")
    return value


def _boolean(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_field(name, f"expected true or false, got {value!r}")
    return value


def _stop_strings(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_field("stop", f"expected a string or a list of strings, got {stop!r}")
    return tuple(_text(s, "stop") for s in stops if s)


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_field("stream_options", f"expected an object, got {options!r}")
    return _boolean(options, "include_usage")


@dataclass
class Job:
    """A parsed request: what to generate and how to answer."""

    kind: str                     # "text_completion" | "chat.completion"
    prompt_ids: list[int]
    opts: GenerationOptions
    stream: bool
    include_usage: bool


class OpenAIServer(ThreadingHTTPServer):
    """The HTTP server: holds the engine and the served model's name. serve_forever() / shutdown()."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, model: MoEModel, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 max_batch: int = 16, max_body_bytes: int = MAX_BODY_BYTES):
        if model.tokenizer is None:
            raise EdgeMoEError(f"{model.name}: no tokenizer.json, so the model cannot serve text")
        self.model = model
        self.model_name = model_name or model.name or "edgemoe"
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self.engine = Engine(model, max_batch=max_batch).start()
        try:
            super().__init__((host, port), Handler)
        except BaseException:
            self.engine.close()
            raise

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def server_close(self) -> None:
        super().server_close()
        self.engine.close()

    # ---- parsing (handler threads) --------------------------------------------------------------------
    def parse(self, kind: str, body: Any) -> Job:
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model: {model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if _integer(body, "n", 1) not in (None, 1):
            raise bad_field("n", f"only n=1 is supported, got {body['n']}")
        if kind == "chat.completion":
            prompt_ids = self._chat_prompt(body)
            max_tokens = _integer(body, "max_completion_tokens", 0)
            max_tokens = _integer(body, "max_tokens", 0) if max_tokens is None else max_tokens
        else:
            prompt_ids = self._completion_prompt(body)
            max_tokens = _integer(body, "max_tokens", 0)
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        options = {"temperature": _number(body, "temperature", 0.0, 2.0),
                   "top_p": _number(body, "top_p", 0.0, 1.0), "top_k": _integer(body, "top_k", 0),
                   "seed": _integer(body, "seed", -2**63, 2**64 - 1)}   # what torch's generator takes
        if options["top_p"] == 0.0:
            raise bad_field("top_p", "expected a number in (0, 1], got 0")
        options = {**defaults_from(self.model.generation_config),
                   **{k: v for k, v in options.items() if v is not None}}
        opts = GenerationOptions(max_new_tokens=self.model.context_length if max_tokens is None else max_tokens,
                                 stop_strings=_stop_strings(body), **options)
        return Job(kind, prompt_ids, opts, _boolean(body, "stream"), _include_usage(body))

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.model.tokenizer.encode(_text(prompt, "prompt"))
        vocab = self.model.spec.vocab_size
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)):
            return prompt
        raise bad_field("prompt", f"expected a string, a list of one string or a list of token ids in "
                        f"[0, {vocab}) (one prompt per request)")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_field("messages", "expected a non-empty list of {role, content} objects")
        plain = [self._message(i, m) for i, m in enumerate(messages)]
        try:
            return self.model.tokenizer.encode_chat(plain)
        except EdgeMoEError as e:   # no chat template, or the template refused the messages
            raise bad_field("messages", str(e)) from None

    @staticmethod
    def _message(index: int, message: Any) -> dict:
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_field(where, "expected an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):   # content parts: only text ones can be served
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_field(f"{where}.content", "only text parts ({type: text, text}) are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad_field(f"{where}.content", f"expected a string or a list of text parts, got {content!r}")
        return {"role": _text(message["role"], f"{where}.role"), "content": _text(content, f"{where}.content")}

    def submit(self, job: Job) -> Request:
        param = "messages" if job.kind == "chat.completion" else "prompt"
        try:
            return self.engine.submit(job.prompt_ids, job.opts)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except ValueError as e:   # an empty prompt
            raise APIError(400, str(e), param=param, code="invalid_value") from None


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"     # keep-alive for plain responses; streams close the connection
    server: OpenAIServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: with Nagle's algorithm the body would wait for
        # the client's delayed ACK of the headers (~40 ms per keep-alive request on Linux).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def do_GET(self) -> None:
        self._answer(self._get)

    def do_POST(self) -> None:
        self._answer(self._post)

    def _answer(self, route) -> None:
        try:
            route()
        except APIError as e:
            self._json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:   # a bug must cost one request, not the server
            log.exception("request failed")
            self._json(500, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body())

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                         "created": self.server.created, "owned_by": "edgemoe"}]})
        elif path in ("/v1/completions", "/v1/chat/completions"):
            raise APIError(405, f"{path}: use POST", code="method_not_allowed")
        else:
            raise APIError(404, f"{path}: no such endpoint", code="not_found")

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        kinds = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat.completion"}
        if path not in kinds:
            if path in ("/health", "/v1/models"):
                raise APIError(405, f"{path}: use GET", code="method_not_allowed")
            raise APIError(404, f"{path}: no such endpoint", code="not_found")
        job = self.server.parse(kinds[path], self._read_json())
        request = self.server.submit(job)
        try:
            if job.stream:
                self._stream(job, request)
            else:
                self._complete(job, request)
        finally:
            request.cancel()     # a no-op once finished; drops the sequence if this handler leaves early

    # ---- body -----------------------------------------------------------------------------------------------
    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise APIError(411, "a Content-Length header is required", code="length_required")
        length = int(length)
        if length > self.server.max_body_bytes:
            self._drop_body(length)
            raise APIError(413, f"request body of {length} bytes is larger than the limit of "
                           f"{self.server.max_body_bytes} bytes", code="request_too_large")
        try:
            return json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None

    def _drop_body(self, length: int) -> None:
        """Read an oversize body away (up to a bound) so that the client, still sending, gets the 413."""
        self.close_connection = True
        left = min(length, DRAIN_LIMIT_BYTES)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)

    # ---- answers --------------------------------------------------------------------------------------------
    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _events(self, request: Request):
        """The request's events as they come; stops (and cancels it) if the client goes away."""
        while True:
            event = request.next_event(timeout=POLL_SECONDS)
            if self._client_gone():
                request.cancel()
                self.close_connection = True
                return
            if event is None:
                continue
            yield event
            if event.finish_reason is not None:
                return

    def _client_gone(self) -> bool:
        """True once the client has closed its end: the socket reads as end-of-file."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _complete(self, job: Job, request: Request) -> None:
        text, last = "", None
        for event in self._events(request):
            text, last = text + event.text, event
        if last is None or last.finish_reason is None:
            return                     # the client left
        _raise_if_failed(last)
        choice = {"index": 0, "logprobs": None, "finish_reason": last.finish_reason}
        if job.kind == "chat.completion":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self._json(200, {**_envelope(job.kind, request, self.server.model_name), "choices": [choice],
                         "usage": _usage(request)})

    def _stream(self, job: Job, request: Request) -> None:
        self.close_connection = True   # the stream's end is the connection's end (no length, no chunking)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        chat = job.kind == "chat.completion"
        envelope = _envelope(job.kind + ".chunk" if chat else job.kind, request, self.server.model_name)
        if chat:
            self._send_event({**envelope, "choices": [_chunk_choice(chat, "", None, role=True)]})
        for event in self._events(request):
            if event.error is not None:
                self._send_event(APIError(500, event.error, type="server_error").body())
                return
            if event.finish_reason == "cancelled":
                return
            if event.text or event.finish_reason is not None:
                self._send_event({**envelope, "choices": [_chunk_choice(chat, event.text, event.finish_reason)]})
            if event.finish_reason is not None and job.include_usage:
                self._send_event({**envelope, "choices": [], "usage": _usage(request)})
        if request.finish_reason in ("stop", "length"):
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

    def _send_event(self, data: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()


def _raise_if_failed(event: Event) -> None:
    if event.error is not None:
        raise APIError(500, event.error, type="server_error")
    if event.finish_reason == "cancelled":
        raise APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


def _envelope(obj: str, request: Request, model_name: str) -> dict:
    prefix = "chatcmpl" if obj.startswith("chat") else "cmpl"
    return {"id": f"{prefix}-{request.id}-{uuid.uuid4().hex[:12]}", "object": obj, "created": int(time.time()),
            "model": model_name}


def _chunk_choice(chat: bool, text: str, finish_reason: str | None, role: bool = False) -> dict:
    choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
    else:
        choice["text"] = text
    return choice


def _usage(request: Request) -> dict:
    usage = request.usage
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens}


def serve(model: MoEModel, host: str, port: int, model_name: str | None = None, max_batch: int = 16) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = OpenAIServer(model, host, port, model_name=model_name, max_batch=max_batch)
    log.info("serving %s at %s (POST /v1/completions, /v1/chat/completions)", server.model_name, server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
