"""`edgemoe serve`: an OpenAI-compatible HTTP API over the continuous-batching Engine (engine.py).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions (the
tokenizer's chat template); `"stream": true` answers as server-sent events ending in `data: [DONE]`.
The HTTP stack is the standard library's ThreadingHTTPServer (one thread per connection; the choice
and its measurement are in docs/serving.md). Handler threads parse, tokenize and wait on their
request's events; only the engine's loop touches the model, on the thread that calls serve_forever()
(`edgemoe serve`: the main thread, which loaded the model; connections are accepted on another).

Errors are JSON bodies in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with a 4xx
status for bad requests (the standard library's own refusals included); a handler never lets an
exception take the server down. The request fields and their checks are one table, FIELDS.

Under load: the listening socket queues BACKLOG connections; at most `max_connections` are served at
once (a thread each), the others wait in that queue; requests beyond the engine's `max_batch` wait in
its queue. A connection idle for `keep_alive_timeout`, or a request whose line, headers and body take
longer than `request_timeout` from its first byte, is closed, so a stalled client frees its thread.
"""

from __future__ import annotations

import io
import json
import logging
import re
import select
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .engine import Engine, Event, Request
from .errors import ContextLengthError
from .errors import EdgeMoEError, TextError
from .generate import GenerationOptions, defaults_from
from .model import MoEModel
from .options import integer_at_least, timeout_seconds
from .tokenizer import valid_text

log = logging.getLogger("edgemoe.server")

MAX_BODY_BYTES = 1 << 20          # a request body larger than this is refused with 413
DRAIN_LIMIT_BYTES = 64 << 20      # read (and drop) an oversize body up to this, so the client sees the 413
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions; chat runs to the context
POLL_SECONDS = 0.05               # how often a waiting handler checks that its client is still there
BACKLOG = 2048                    # listen() queue (uvicorn's default; Linux caps it at net.core.somaxconn)
MAX_CONNECTIONS = 256             # connections served at once, a thread each; more wait in the backlog
REQUEST_TIMEOUT = 10.0            # seconds for a request's line, headers and body from its first byte
KEEP_ALIVE_TIMEOUT = 5.0          # seconds a connection may sit idle before (or between) requests
WORKER_WAIT_SECONDS = 0.2         # how often a full server's accept loop checks for shutdown


class APIError(Exception):
    """A request the server refuses: becomes {"error": {...}} with `status` (and `headers`, e.g. Allow)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

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


# ---- request fields: one table, FIELDS; each kind has one reader ------------------------------------------
CHAT, COMPLETION = "chat.completion", "text_completion"
CONTEXT = "context"                # a bound that is the served model's context length
ROLES = ("system", "developer", "user", "assistant")   # tools and function calls are not served


@dataclass(frozen=True)
class Field:
    """A request field: its name (dotted for a nested one), kind (a key of READERS), range and endpoints."""

    name: str
    kind: str
    low: float | None = None
    high: float | str | None = None    # a number, or CONTEXT
    low_open: bool = False             # the range excludes `low`
    required: bool = False
    endpoints: tuple[str, ...] = (CHAT, COMPLETION)


FIELDS = (
    Field("model", "string"),
    Field("prompt", "prompt", required=True, endpoints=(COMPLETION,)),
    Field("messages", "messages", required=True, endpoints=(CHAT,)),
    Field("max_tokens", "integer", 1, CONTEXT),
    Field("max_completion_tokens", "integer", 1, CONTEXT, endpoints=(CHAT,)),
    Field("temperature", "number", 0.0, 2.0),
    Field("top_p", "number", 0.0, 1.0, low_open=True),
    Field("top_k", "integer", 0),
    Field("seed", "integer", -2**63, 2**64 - 1),   # what torch's generator takes
    Field("n", "integer", 1, 1),                     # one choice per request
    Field("stop", "strings"),
    Field("stream", "boolean"),
    Field("stream_options", "object"),
    Field("stream_options.include_usage", "boolean"),
)


@dataclass(frozen=True)
class Bounds:
    """What a field's range depends on in the served model."""

    context: int
    vocab: int


def read_fields(body: Any, endpoint: str, bounds: Bounds) -> dict[str, Any]:
    """Every FIELDS entry of `endpoint` that the body sets (null counts as unset), checked; unknown fields
    are ignored. Raises APIError naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    values = {}
    for field in FIELDS:
        if endpoint not in field.endpoints:
            continue
        value = _lookup(body, field.name)
        if value is None:
            if field.required:
                raise bad_field(field.name, "required")
            continue
        values[field.name] = READERS[field.kind](field, value, bounds)
    return values


def _lookup(body: dict, name: str) -> Any:
    for part in name.split("."):
        if not isinstance(body, dict):
            return None      # the parent's own entry refuses a parent of the wrong kind
        body = body.get(part)
    return body


def _read_number(field: Field, value: Any, bounds: Bounds, integer: bool = False) -> float | int:
    high = bounds.context if field.high == CONTEXT else field.high
    kind = (int,) if integer else (int, float)
    if (isinstance(value, bool) or not isinstance(value, kind)
            or (field.low is not None and (value < field.low or (field.low_open and value == field.low)))
            or (high is not None and not value <= high) or value != value):   # NaN compares false
        span = f">= {field.low}" if high is None else f"in {'(' if field.low_open else '['}{field.low}, {high}]"
        raise bad_field(field.name, f"expected {'an integer' if integer else 'a number'} {span}, got {value!r}")
    return value if integer else float(value)


def _read_integer(field: Field, value: Any, bounds: Bounds) -> int:
    return _read_number(field, value, bounds, integer=True)


def _read_boolean(field: Field, value: Any, bounds: Bounds) -> bool:
    if not isinstance(value, bool):
        raise bad_field(field.name, f"expected true or false, got {value!r}")
    return value


def _read_string(field: Field, value: Any, bounds: Bounds) -> str:
    if not isinstance(value, str):
        raise bad_field(field.name, f"expected a string, got {value!r}")
    return _text(value, field.name)


def _read_object(field: Field, value: Any, bounds: Bounds) -> dict:
    if not isinstance(value, dict):
        raise bad_field(field.name, f"expected an object, got {value!r}")
    return value


def _read_strings(field: Field, value: Any, bounds: Bounds) -> tuple[str, ...]:
    strings = [value] if isinstance(value, str) else value
    if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
        raise bad_field(field.name, f"expected a string or a list of strings, got {value!r}")
    return tuple(_text(s, field.name) for s in strings if s)


def _read_prompt(field: Field, value: Any, bounds: Bounds) -> str | list[int]:
    """A string, a list of one string, or a list of token ids: one prompt per request."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        return _text(value, field.name)
    if (isinstance(value, list) and value
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < bounds.vocab for t in value)):
        return value
    raise bad_field(field.name, f"expected a string, a list of one string or a list of token ids in "
                    f"[0, {bounds.vocab}) (one prompt per request)")


def _read_messages(field: Field, value: Any, bounds: Bounds) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_field(field.name, "expected a non-empty list of {role, content} objects")
    return [_read_message(f"{field.name}[{i}]", m) for i, m in enumerate(value)]


def _read_message(where: str, message: Any) -> dict:
    if not isinstance(message, dict):
        raise bad_field(where, f"expected an object with a role and a content, got {message!r}")
    if message.get("role") not in ROLES:
        raise bad_field(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {message.get('role')!r}")
    content = message.get("content")
    if isinstance(content, list):   # content parts: only text ones can be served
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad_field(f"{where}.content", "only text parts ({type: text, text}) are supported")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_field(f"{where}.content", f"expected a string or a list of text parts, got {content!r}")
    return {"role": message["role"], "content": _text(content, f"{where}.content")}


READERS = {"number": _read_number, "integer": _read_integer, "boolean": _read_boolean, "string": _read_string,
           "object": _read_object, "strings": _read_strings, "prompt": _read_prompt, "messages": _read_messages}


@dataclass
class Job:
    """A parsed request: what to generate and how to answer."""

    kind: str                     # COMPLETION or CHAT
    prompt_ids: list[int]
    opts: GenerationOptions
    stream: bool
    include_usage: bool


class OpenAIServer(ThreadingHTTPServer):
    """The HTTP server: holds the engine and the served model's name. serve_forever() / shutdown().

    serve_forever() runs the engine's loop on the thread that calls it and the accept loop on a
    thread of its own: call it from the thread that loaded the model (edgemoe serve does), so that
    the kernels run on one thread only (Engine says why that is faster)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = BACKLOG      # the standard library's 5 resets connections of a burst of clients

    def __init__(self, model: MoEModel, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
                 max_batch: int = 16, max_body_bytes: int = MAX_BODY_BYTES, max_connections: int = MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT, keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT):
        if model.tokenizer is None:
            raise EdgeMoEError(f"{model.name}: no tokenizer.json, so the model cannot serve text")
        integer_at_least(max_connections, "max_connections=", 1)      # the checks of serve's options
        timeout_seconds(request_timeout, "request_timeout=")
        timeout_seconds(keep_alive_timeout, "keep_alive_timeout=")
        self.model = model
        self.model_name = model_name or model.name or "edgemoe"
        self.max_body_bytes = max_body_bytes
        self.request_timeout, self.keep_alive_timeout = request_timeout, keep_alive_timeout
        self.created = int(time.time())
        self._workers = threading.BoundedSemaphore(max_connections)
        self._stopping = threading.Event()
        self._served = threading.Event()      # set when serve_forever() has returned
        self.engine = Engine(model, max_batch=max_batch)
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:
        """Start the connection's thread once one of `max_connections` is free; until then this (accept)
        loop waits, and the connections behind it wait in the listen backlog."""
        while not self._workers.acquire(timeout=WORKER_WAIT_SECONDS):
            if self._stopping.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._workers.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._workers.release()

    def handle_error(self, request, client_address) -> None:
        """One log line for a connection the client broke; a traceback only for a bug."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.info("%s: connection ended: %s", client_address[0], error)
        else:
            log.exception("%s: connection failed", client_address[0])

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serve until shutdown() (from another thread) or an exception here (Ctrl-C): the engine's
        loop on this thread, connections accepted on another."""
        accepting = threading.Thread(target=super().serve_forever, args=(poll_interval,), name="edgemoe-accept",
                                     daemon=True)
        accepting.start()
        try:
            self.engine.run()
        finally:
            self._stopping.set()
            super().shutdown()     # the accept loop ends
            self._served.set()

    def shutdown(self) -> None:
        """Stop serve_forever() and wait until it returns; requests in flight are ended by
        server_close()."""
        self._stopping.set()
        self.engine.stop()
        self._served.wait()

    def server_close(self) -> None:
        super().server_close()
        self.engine.close()

    # ---- parsing (handler threads) --------------------------------------------------------------------
    def parse(self, kind: str, body: Any) -> Job:
        fields = read_fields(body, kind, Bounds(self.model.context_length, self.model.spec.vocab_size))
        model = fields.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model: {model!r} is not served here; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if kind == CHAT:
            prompt_ids = self._chat_prompt(fields["messages"])
            max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
        else:
            prompt = fields["prompt"]
            prompt_ids = self.model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            max_tokens = fields.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        options = {**defaults_from(self.model.generation_config),
                   **{k: fields[k] for k in ("temperature", "top_p", "top_k", "seed") if k in fields}}
        opts = GenerationOptions(max_new_tokens=self.model.context_length if max_tokens is None else max_tokens,
                                 stop_strings=fields.get("stop", ()), **options)
        return Job(kind, prompt_ids, opts, fields.get("stream", False),
                   fields.get("stream_options.include_usage", False))

    def _chat_prompt(self, messages: list[dict]) -> list[int]:
        try:
            return self.model.tokenizer.encode_chat(messages)
        except EdgeMoEError as e:   # no chat template, or the template refused the messages
            raise bad_field("messages", str(e)) from None

    def submit(self, job: Job) -> Request:
        param = "messages" if job.kind == CHAT else "prompt"
        try:
            return self.engine.submit(job.prompt_ids, job.opts)
        except ContextLengthError as e:
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except ValueError as e:   # an empty prompt
            raise APIError(400, str(e), param=param, code="invalid_value") from None


class DeadlineReader(io.RawIOBase):
    """A connection's reads, each given only the time left before `deadline` (a total: a client that
    trickles a byte at a time is cut off as surely as one that stalls). Between reads the socket keeps
    `write_timeout`, so an answer to a client that stops reading cannot block its thread for ever."""

    def __init__(self, sock: socket.socket, write_timeout: float):
        self.sock, self.write_timeout = sock, write_timeout
        self.deadline = time.monotonic()
        self.timed_out = False
        sock.settimeout(write_timeout)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError("timed out")
            self.sock.settimeout(left)
            return self.sock.recv_into(buffer)
        except TimeoutError:
            self.timed_out = True
            raise
        finally:
            self.sock.settimeout(self.write_timeout)


ALLOWED = {"GET": ("GET", "HEAD", "OPTIONS"), "POST": ("POST", "OPTIONS")}   # by an endpoint's method
ENDPOINTS = {"/health": "GET", "/v1/models": "GET", "/v1/completions": "POST", "/v1/chat/completions": "POST"}
CONTENT_LENGTH = re.compile(r"[0-9]{1,15}")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"     # keep-alive for plain responses; streams close the connection
    default_request_version = "HTTP/1.1"   # a malformed request line too gets a status line and headers
    server: OpenAIServer

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: with Nagle's algorithm the body would wait for
        # the client's delayed ACK of the headers (~40 ms per keep-alive request on Linux).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = DeadlineReader(self.connection, self.server.request_timeout)
        self.rfile = io.BufferedReader(self.reader, self.rbufsize if self.rbufsize > 0 else io.DEFAULT_BUFFER_SIZE)

    def handle_one_request(self) -> None:
        """Wait up to the keep-alive timeout for a request to start, then give it the request timeout to
        arrive whole; one that does not gets a 408 and the connection is closed."""
        self.reader.deadline = time.monotonic() + self.server.keep_alive_timeout
        try:
            started = self.rfile.peek(1)
        except OSError:       # a timeout (idle) or a reset: nothing to answer
            started = b""
        if not started:
            self.close_connection = True
            return
        self.reader.deadline = time.monotonic() + self.server.request_timeout
        self.reader.timed_out = self.responded = self.body_pending = False
        self.requestline, self.command, self.request_version = "", "", self.default_request_version
        super().handle_one_request()      # reports a timeout only in the log: answer it here
        if self.reader.timed_out and not self.responded:
            self.send_error(408, f"the request did not arrive within {self.server.request_timeout:g} s")

    def send_response(self, code: int, message: str | None = None) -> None:
        self.responded = True
        super().send_response(code, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """Every refusal as JSON, also the standard library's own (a malformed request line, headers too
        long, an unknown method): the connection is closed after it, as the library does."""
        self.close_connection = True
        status = HTTPStatus(code)
        try:
            self._json(code, APIError(code, message or status.phrase, code=status.name.lower()).body())
        except OSError:
            pass               # the client is gone

    def log_message(self, format: str, *args) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _answer(self) -> None:
        """Every method's entry: _route answers, refuses (APIError) or fails (one request, not the server)."""
        try:
            self._route()
        except APIError as e:
            if self.body_pending:
                self._discard_body()
            self._json(e.status, e.body(), e.headers)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            self.close_connection = True
        except Exception as e:   # a bug must cost one request, not the server
            log.exception("request failed")
            self._json(500, APIError(500, f"internal error: {type(e).__name__}: {e}").body())

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _answer

    def _route(self) -> None:
        self.body_pending = "Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0") != "0"
        path = self.path.split("?", 1)[0]
        method = ENDPOINTS.get(path)
        if method is None:
            raise APIError(404, f"{path}: no such endpoint", code="not_found")
        allow = {"Allow": ", ".join(ALLOWED[method])}
        if self.command == "OPTIONS":
            self._no_content(allow)
        elif self.command not in ALLOWED[method]:
            raise APIError(405, f"{self.command} {path}: use {method}", code="method_not_allowed", headers=allow)
        elif path == "/health":
            self._json(200, {"status": "ok"})
        elif path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                         "created": self.server.created, "owned_by": "edgemoe"}]})
        else:
            self._generate(CHAT if path == "/v1/chat/completions" else COMPLETION)

    def _generate(self, kind: str) -> None:
        job = self.server.parse(kind, self._read_json())
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
        length = self._content_length()
        if length > self.server.max_body_bytes:
            self._drop_body(length)
            raise APIError(413, f"request body of {length} bytes is larger than the limit of "
                           f"{self.server.max_body_bytes} bytes", code="request_too_large")
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            self.close_connection = True
            raise APIError(408, f"the request body did not arrive within {self.server.request_timeout:g} s",
                           code="request_timeout") from None
        self.body_pending = False
        if len(data) < length:
            self.close_connection = True
            raise APIError(400, f"the body ended after {len(data)} of the {length} bytes its Content-Length "
                           f"announced", code="invalid_content_length")
        try:
            return json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None

    def _content_length(self) -> int:
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths or "Transfer-Encoding" in self.headers:
            raise APIError(411, "a Content-Length header is required (a chunked body is not read)",
                           code="length_required")
        if len(set(lengths)) > 1 or not CONTENT_LENGTH.fullmatch(lengths[0]):
            raise APIError(400, f"Content-Length {', '.join(lengths)!r}: expected one non-negative integer",
                           code="invalid_content_length")
        return int(lengths[0])

    def _discard_body(self) -> None:
        """The body of a refused request, unread, would be taken for the next request: read it away and
        close the connection."""
        try:
            length = self._content_length()
        except APIError:       # no length to read by: closing is all there is
            length = 0
        self._drop_body(length)

    def _drop_body(self, length: int) -> None:
        """Read a body away (up to a bound) so that the client, still sending, gets the error answer: a
        socket closed with unread data resets the connection, and the client may lose the answer."""
        self.close_connection = True
        self.body_pending = False
        left = min(length, DRAIN_LIMIT_BYTES)
        while left > 0:
            try:
                chunk = self.rfile.read(min(left, 1 << 16))
            except TimeoutError:
                return
            if not chunk:
                return
            left -= len(chunk)

    # ---- answers --------------------------------------------------------------------------------------------
    def _json(self, status: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _no_content(self, headers: dict[str, str]) -> None:
        self.send_response(204)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

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
        if job.kind == CHAT:
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
        chat = job.kind == CHAT
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


def serve(model: MoEModel, host: str, port: int, model_name: str | None = None, max_batch: int = 16,
          max_connections: int = MAX_CONNECTIONS, request_timeout: float = REQUEST_TIMEOUT,
          keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = OpenAIServer(model, host, port, model_name=model_name, max_batch=max_batch,
                          max_connections=max_connections, request_timeout=request_timeout,
                          keep_alive_timeout=keep_alive_timeout)
    log.info("serving %s at %s (POST /v1/completions, /v1/chat/completions)", server.model_name, server.url)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
