"""`edgemoe serve` over HTTP on 127.0.0.1 (ephemeral port, in-process): the openai client parses every
answer; concurrent and streaming clients get what the model generates alone; a client that leaves
mid-stream is dropped while another goes on; every bad request, the HTTP layer's included, gets an
error in OpenAI's shape (bodies generated from the server's FIELDS table); under a bounded load (64
streaming clients, 3 rounds) nothing is lost and threads and requests are released; stalled clients
are cut off after the (short, configured) timeouts."""

import http.client
import gc
import json
import logging
import select
import socket
import struct
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.options import OptionError
from edgemoe.server import CHAT, COMPLETION, CONTEXT, FIELDS, OpenAIServer

NAME = "shakespeare-moe"


@pytest.fixture(scope="module")
def model():
    return edgemoe.load(bundled_model_path())


@pytest.fixture(scope="module")
def server(model):
    srv = OpenAIServer(model, "127.0.0.1", 0, max_body_bytes=64 * 1024)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, temperature=0.0)


def post(server, path, body, raw=False):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", path, body if raw else json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, json.loads(data)


def test_health_and_models(server, client):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/health")
    assert json.loads(conn.getresponse().read()) == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [NAME]


def test_completion_equals_the_model_alone_with_usage(model, client):
    answer = client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=10, temperature=0)
    assert answer.choices[0].text == greedy(model, "ROMEO:", 10)
    assert answer.choices[0].finish_reason == "length"
    prompt_tokens = len(model.tokenizer.encode("ROMEO:"))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens, answer.usage.total_tokens) == \
        (prompt_tokens, 10, prompt_tokens + 10)


def test_the_engine_steps_on_the_thread_that_serves_and_shutdown_waits_for_it(model):
    """serve_forever() runs the engine's loop on its caller's thread (`edgemoe serve`: the main thread,
    which loaded the model), not on a thread of its own; shutdown() returns once serve_forever() has."""
    srv = OpenAIServer(model, "127.0.0.1", 0)
    stepped_on = set()
    step = srv.engine.step
    srv.engine.step = lambda: (stepped_on.add(threading.get_ident()), step())[1]
    serving = threading.Thread(target=srv.serve_forever)
    serving.start()
    try:
        status, answer = post(srv, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0})
        assert status == 200 and answer["choices"][0]["text"] == greedy(model, "ROMEO:", 3)
    finally:
        srv.shutdown()
        srv.server_close()
    assert not serving.is_alive()
    assert stepped_on == {serving.ident}


def test_chat_streamed_and_whole_give_the_templated_generation(model, client):
    messages = [{"role": "user", "content": "Who art thou?"}]
    expected = greedy(model, model.tokenizer.encode_chat(messages), 12)
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and len({c.id for c in chunks}) == 1


def test_stop_strings_end_the_text_with_finish_reason_stop(model, client):
    full = greedy(model, "ROMEO:", 20)
    answer = client.completions.create(model=NAME, prompt="ROMEO:", max_tokens=20, temperature=0,
                                       stop=[full[8:11], "never in this text \u2603"])
    assert answer.choices[0].text == full[:full.index(full[8:11])]
    assert answer.choices[0].finish_reason == "stop"


def test_concurrent_clients_each_get_their_own_generation(model, client):
    prompts = ["ROMEO:", "JULIET:\nO", "To be, or not to be", "KING.\nWhat"]

    def ask(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [greedy(model, p, 8) for p in prompts]


def test_a_client_leaving_mid_stream_is_dropped_and_another_goes_on(model, server, client, monkeypatch):
    endings = []
    deliver = server.engine._deliver
    monkeypatch.setattr(server.engine, "_deliver", lambda request, event: (
        event.finish_reason and endings.append(event.finish_reason), deliver(request, event)))
    leaving = socket.create_connection(server.server_address[:2], timeout=30)
    body = json.dumps({"prompt": "ROMEO:", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    leaving.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    received = b""
    while b"data: " not in received:                # the stream has started
        received += leaving.recv(4096)
    staying = client.completions.create(model=NAME, prompt="JULIET:", max_tokens=15, temperature=0, stream=True)
    first = next(staying)
    leaving.close()
    rest = "".join(c.choices[0].text for c in staying)
    assert first.choices[0].text + rest == greedy(model, "JULIET:", 15)
    deadline = time.monotonic() + 10
    while ("cancelled" not in endings or server.engine.active) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert endings.count("cancelled") == 1 and "length" in endings and server.engine.active == []


def test_generation_reaching_the_context_stops_with_length(model, client):
    context = model.spec.max_position_embeddings
    prompt = [5] * (context - 3)
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=100, temperature=0)
    assert answer.choices[0].finish_reason == "length" and answer.usage.total_tokens == context


def test_unknown_fields_are_ignored(server):
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 2, "user": "x",
                                                    "frequency_penalty": 0, "logit_bias": {}, "whatever": [1]})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2


def test_malformed_json_and_non_object_bodies(server):
    status, body = post(server, "/v1/completions", b'{"prompt": "ROMEO:", ', raw=True)
    assert status == 400 and body["error"]["code"] == "invalid_json" and body["error"]["type"] == "invalid_request_error"
    status, body = post(server, "/v1/chat/completions", [1, 2])
    assert status == 400 and "JSON object" in body["error"]["message"]


def test_unknown_model_is_a_404_the_client_understands(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="gpt-4", prompt="ROMEO:", max_tokens=2)
    assert error.value.body["code"] == "model_not_found" and "gpt-4" in error.value.body["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 2}, "n"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, "stop"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "a", "seed": 1.5}, "seed"),
    ("/v1/completions", {"prompt": "a", "seed": 2**64}, "seed"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
])
def test_bad_fields_are_400s_naming_the_field(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"]["param"] == param and param in answer["error"]["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "ab\ud800cd"}, "prompt"),
    ("/v1/completions", {"prompt": ["ab\ud800cd"]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "stop": ["x", "ab\ud800cd"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "user", "content": "ab\ud800cd"}]}, "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab\ud800cd"}]}]},
     "messages[0].content"),
])
def test_text_that_is_not_utf8_is_a_400_naming_the_field_and_the_byte(server, path, body, param):
    """A JSON string may hold a lone surrogate (valid JSON, not text): refused, not a 500."""
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"] == {
        "message": f"{param}: not valid UTF-8 at byte 2 (a lone surrogate U+D800)", "type": "invalid_request_error",
        "param": param, "code": "invalid_value"}


def test_prompt_longer_than_the_context_is_refused(model, client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=NAME, prompt=[5] * model.spec.max_position_embeddings, max_tokens=2)
    assert error.value.body["code"] == "context_length_exceeded"
    long_text = "To be, or not to be, that is the question. " * 40
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": long_text}])
    assert error.value.body["code"] == "context_length_exceeded" and error.value.body["param"] == "messages"


def test_oversize_body_is_a_413(server):
    status, body = post(server, "/v1/completions", {"prompt": "x" * (server.max_body_bytes + 1)})
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_unknown_path_and_wrong_method(server):
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
    conn.request("GET", "/v1/nothing")
    response = conn.getresponse()
    assert response.status == 404 and "error" in json.loads(response.read())
    conn.request("GET", "/v1/completions")
    response = conn.getresponse()
    assert response.status == 405 and json.loads(response.read())["error"]["code"] == "method_not_allowed"


def test_a_failing_model_step_is_a_500_and_the_server_goes_on(model, server, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("expert file unreadable")

    monkeypatch.setattr(model, "forward", broken)
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3})
    assert status == 500 and body["error"]["type"] == "server_error" and "unreadable" in body["error"]["message"]
    monkeypatch.undo()
    status, body = post(server, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["choices"][0]["text"] == greedy(model, "ROMEO:", 3)


def test_a_prompt_of_no_tokens_is_a_400(server, monkeypatch):
    monkeypatch.setattr(server.model.tokenizer, "encode", lambda text, add_special_tokens=True: [])
    status, body = post(server, "/v1/completions", {"prompt": ""})
    assert status == 400 and body["error"]["param"] == "prompt" and "empty" in body["error"]["message"]


# ---- under load: backlog, connection limit, slow clients -------------------------------------------------
SHORT = 0.5      # the request and keep-alive timeouts of the servers below, in seconds


@pytest.fixture
def start_server(model):
    """start_server(**options) -> a serving OpenAIServer (serve=False: bound and listening, not accepting)."""
    started = []

    def start(serve=True, **options):
        srv = OpenAIServer(model, "127.0.0.1", 0, **options)
        srv.handler_threads = []             # this server's connection threads (other servers' are not counted)
        run_connection = srv.process_request_thread
        srv.process_request_thread = lambda *args: (srv.handler_threads.append(threading.current_thread()),
                                                    run_connection(*args))
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        if serve:
            thread.start()
        started.append((srv, thread))
        return srv

    yield start
    for srv, thread in started:
        if thread.is_alive():
            srv.shutdown()
        srv.server_close()


def raw_request(body: dict, headers: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s"
            b"Content-Length: %d\r\n\r\n%s" % (headers, len(data), data))


def read_until_closed(sock) -> bytes:
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def live_handlers(srv) -> int:
    return sum(t.is_alive() for t in srv.handler_threads)


def wait_for(condition, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_a_burst_of_connections_before_the_first_accept_is_served_whole(start_server):
    srv = start_server(serve=False)          # listening, accepting nothing yet: connections queue in the backlog
    sockets = [socket.create_connection(srv.server_address[:2], timeout=10) for _ in range(64)]
    for sock in sockets:
        sock.sendall(raw_request({"prompt": "ROMEO:", "max_tokens": 1}, b"Connection: close\r\n"))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    answers = [read_until_closed(sock) for sock in sockets]
    assert all(a.startswith(b"HTTP/1.1 200") for a in answers)


@pytest.mark.parametrize("partial", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                     raw_request({"prompt": "ROMEO:"})[:-5]],
                         ids=["nothing", "part of the headers", "part of the body"])
def test_a_stalled_client_is_cut_off_and_its_thread_freed(start_server, partial):
    srv = start_server(request_timeout=SHORT, keep_alive_timeout=SHORT)
    sock = socket.create_connection(srv.server_address[:2], timeout=30)
    sock.sendall(partial)
    answer = read_until_closed(sock)         # returns once the server closes the connection
    if partial:
        head, body = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
    else:
        assert answer == b""                 # idle: closed without a word
    assert len(srv.handler_threads) == 1 and wait_for(lambda: live_handlers(srv) == 0)


def test_a_trickling_client_is_cut_off_at_the_request_timeout_in_total(start_server):
    srv = start_server(request_timeout=SHORT, keep_alive_timeout=SHORT)
    sock = socket.create_connection(srv.server_address[:2], timeout=30)
    cut_off = False
    for byte in b"POST /v1/completions HTTP/1.1\r\nHost: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n":   # 6 s of it
        if select.select([sock], [], [], 0.1)[0]:   # the server answered (its 408) or closed
            cut_off = True
            break
        try:
            sock.sendall(bytes([byte]))     # one byte every 0.1 s: each read is quick, the whole is not
        except OSError:
            cut_off = True
            break
    assert cut_off, "the server still read after the request timeout"


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(start_server):
    srv = start_server(request_timeout=SHORT, keep_alive_timeout=SHORT)
    conn = http.client.HTTPConnection(*srv.server_address[:2], timeout=30)
    conn.request("GET", "/health")
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Connection") != "close"
    response.read()
    assert read_until_closed(conn.sock) == b""


def test_past_max_connections_a_connection_waits_to_be_accepted_and_is_then_served(start_server):
    srv = start_server(max_connections=1, request_timeout=SHORT, keep_alive_timeout=SHORT)
    stalled = socket.create_connection(srv.server_address[:2], timeout=30)
    stalled.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    assert wait_for(lambda: live_handlers(srv) == 1)
    status, body = post(srv, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    stalled.setblocking(False)               # the only worker went to the stalled client: it was cut off first
    assert stalled.recv(65536).startswith(b"HTTP/1.1 408")


# ---- every refusal is OpenAI-shaped JSON: generated from the validation table --------------------------------
ENDPOINT_PATHS = {CHAT: "/v1/chat/completions", COMPLETION: "/v1/completions"}
VALID = {CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
         COMPLETION: {"prompt": "ROMEO:", "max_tokens": 1}}
WRONG_KINDS = {"number": ["hot", True, [1], {}], "integer": [1.5, "1", True, [1]], "boolean": ["yes", 1, [True]],
               "string": [5, ["a"], {}], "strings": [5, [1], ["a", 2], {}], "object": ["x", 5, [1]],
               "prompt": [5, [], {}, [1.5], ["a", "b"], [-1], [True]], "messages": [5, "hi", [], {}]}


def out_of_range(field, context):
    high = context if field.high == CONTEXT else field.high
    values = [] if field.low is None else [field.low - 1] + ([field.low] if field.low_open else [])
    return values + ([] if high is None else [high + 1])


def set_field(body, name, value):
    """body with the (dotted) field set to value, its parents made objects."""
    body = json.loads(json.dumps(body))
    *parents, last = name.split(".")
    inner = body
    for part in parents:
        inner = inner.setdefault(part, {})
    inner[last] = value
    return body


def bad_bodies():
    context = edgemoe.load(bundled_model_path()).context_length
    for field in FIELDS:
        for endpoint in field.endpoints:
            for value in WRONG_KINDS[field.kind] + (out_of_range(field, context) if field.low is not None else []):
                yield pytest.param(endpoint, set_field(VALID[endpoint], field.name, value), field.name,
                                   id=f"{ENDPOINT_PATHS[endpoint]}-{field.name}={value!r}")


@pytest.mark.parametrize("endpoint, body, param", bad_bodies())
def test_every_wrong_kind_of_every_field_is_a_400_naming_it(server, endpoint, body, param):
    status, answer = post(server, ENDPOINT_PATHS[endpoint], body)
    assert status == 400 and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and param in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"role": "tool", "content": "42", "tool_call_id": "t"}], "messages[0].role"),
    (["hi"], "messages[0]"),
])
def test_a_message_without_a_servable_role_or_content_is_a_400_naming_it(server, messages, param):
    status, answer = post(server, "/v1/chat/completions", {"messages": messages})
    assert status == 400 and answer["error"]["param"] == param and param in answer["error"]["message"]


def exchange(server, request: bytes) -> tuple[int, dict, dict]:
    """Send raw bytes, read one answer: (status, headers, JSON body or {} when it has none)."""
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(request)
        response = http.client.HTTPResponse(sock, method=request.split(b" ", 1)[0].decode())
        response.begin()
        data = response.read()
    return response.status, dict(response.getheaders()), json.loads(data) if data else {}


def assert_openai_error(status, headers, body, expected_status, code):
    assert status == expected_status and headers["Content-Type"] == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")


@pytest.mark.parametrize("method", ["DELETE", "PUT", "PATCH", "GET"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_wrong_method_on_a_post_endpoint_is_a_405_with_allow(server, method, path):
    status, headers, body = exchange(server, b"%s %s HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"
                                     % (method.encode(), path.encode()))
    assert_openai_error(status, headers, body, 405, "method_not_allowed")
    assert headers["Allow"] == "POST, OPTIONS"


@pytest.mark.parametrize("method", ["DELETE", "PUT", "PATCH", "POST"])
def test_a_wrong_method_on_a_get_endpoint_is_a_405_with_allow(server, method):
    status, headers, body = exchange(server, b"%s /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"
                                     % method.encode())
    assert_openai_error(status, headers, body, 405, "method_not_allowed")
    assert headers["Allow"] == "GET, HEAD, OPTIONS"


def test_options_lists_the_methods_and_head_answers_headers_only(server):
    status, headers, body = exchange(server, b"OPTIONS /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 204 and headers["Allow"] == "POST, OPTIONS" and body == {}
    status, headers, body = exchange(server, b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 200 and int(headers["Content-Length"]) > 0 and body == {}


@pytest.mark.parametrize("request_bytes, status, code", [
    (b"DELETE /v1/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"),
    (b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 501, "not_implemented"),
    (b"GARBAGE\r\n\r\n", 400, "bad_request"),
    (b"GET /health HTTP/1.1\r\n" + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n", 431, "request_header_fields_too_large"),
    (b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n", 414, "request_uri_too_long"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n", 411, "length_required"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411,
     "length_required"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -3\r\n\r\n", 400, "invalid_content_length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1e3\r\n\r\n", 400, "invalid_content_length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
     "invalid_content_length"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 9\r\n\r\n{}", 408, "request_timeout"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\n{", 400, "invalid_json"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 70000\r\n\r\n", 413, "request_too_large"),
], ids=["unknown path", "unknown method", "malformed request line", "header too long", "request line too long",
        "no Content-Length",
        "chunked", "negative Content-Length", "Content-Length not an integer", "two Content-Lengths",
        "Content-Length longer than the body", "body not JSON", "body too large"])
def test_every_http_level_refusal_is_openai_shaped_json(start_server, request_bytes, status, code):
    srv = start_server(max_body_bytes=64 * 1024, request_timeout=SHORT, keep_alive_timeout=SHORT)
    assert_openai_error(*exchange(srv, request_bytes), status, code)


def test_a_refused_request_with_an_unread_body_closes_the_connection(server):
    # the body of a 405 is not parsed: kept alive, its bytes would be taken for the next request
    status, headers, _ = exchange(server, b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\n"
                                  b"GET / HT")
    assert status == 405 and headers["Connection"] == "close"


# ---- a bounded load: 64 streaming clients, 3 rounds, stalled clients among them ---------------------------
def stream_completion(address, prompt, max_tokens) -> list[dict]:
    """One streamed completion over a fresh connection: its chunks; raises unless it ends with [DONE]."""
    conn = http.client.HTTPConnection(*address, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0, "stream": True}))
    response = conn.getresponse()
    assert response.status == 200, response.read()
    lines = [line.rstrip(b"\r\n") for line in response if line.strip()]
    conn.close()
    assert lines[-1] == b"data: [DONE]", lines[-3:]
    return [json.loads(line[len(b"data: "):]) for line in lines[:-1]]


def test_64_streaming_clients_in_3_rounds_lose_nothing_and_leave_nothing(model, start_server, monkeypatch):
    srv = start_server(max_batch=16, request_timeout=SHORT, keep_alive_timeout=SHORT)
    submitted, waiting = [], []
    submit, admit = srv.engine.submit, srv.engine._admit

    def submit_and_remember(*args, **kwargs):
        request = submit(*args, **kwargs)
        submitted.append(weakref.ref(request))
        return request

    monkeypatch.setattr(srv.engine, "submit", submit_and_remember)
    monkeypatch.setattr(srv.engine, "_admit", lambda: (waiting.append(srv.engine._waiting.qsize()), admit()))
    prompts = ["ROMEO:", "JULIET:\nO", "To be, or not to be", "KING.\nWhat"]
    expected = {p: greedy(model, p, 4) for p in prompts}
    for _ in range(3):
        stalled = [socket.create_connection(srv.server_address[:2], timeout=30) for _ in range(4)]
        for sock in stalled:                 # slow clients among the streams: headers begun, then silence
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        with ThreadPoolExecutor(64) as pool:
            streams = list(pool.map(lambda i: stream_completion(srv.server_address[:2], prompts[i % 4], 4), range(64)))
        for i, chunks in enumerate(streams):
            assert "".join(c["choices"][0]["text"] for c in chunks) == expected[prompts[i % 4]]
            assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert all(read_until_closed(sock).startswith(b"HTTP/1.1 408") for sock in stalled)
        assert wait_for(lambda: live_handlers(srv) == 0)
        gc.collect()                         # no request (hence no KV cache) outlives its round
        assert srv.engine.active == [] and srv.engine._waiting.empty() and all(r() is None for r in submitted)
    assert len(submitted) == 3 * 64 and max(waiting) > 0    # some waited for a place in the batch
    assert len(srv.handler_threads) == 3 * (64 + 4)          # a thread per connection, each ended


def test_a_client_resetting_mid_request_costs_one_log_line_not_a_traceback(start_server, capfd, caplog):
    caplog.set_level(logging.INFO, logger="edgemoe.server")
    srv = start_server()
    sock = socket.create_connection(srv.server_address[:2], timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close with a reset
    sock.close()
    assert wait_for(lambda: any("connection ended" in r.getMessage() for r in caplog.records))
    assert "Traceback" not in capfd.readouterr().err


def test_a_refused_request_s_large_body_is_read_away_so_the_client_gets_the_answer(server):
    # closed with the body unread, the socket would reset the connection while the client still sends
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    conn.request("PUT", "/v1/completions", b"x" * (4 << 20), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 405 and json.loads(response.read())["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("option, value", [("max_connections", 0), ("request_timeout", 0), ("keep_alive_timeout", -1),
                                           ("request_timeout", float("nan"))])
def test_limits_that_would_hang_or_cut_off_every_client_are_refused(model, option, value):
    with pytest.raises(OptionError, match=f"{option}="):
        OpenAIServer(model, "127.0.0.1", 0, **{option: value})
