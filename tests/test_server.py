"""`edgemoe serve` over HTTP on 127.0.0.1 (ephemeral port, in-process): the openai client parses every
answer; concurrent and streaming clients get what the model generates alone; a client that leaves
mid-stream is dropped while another goes on; bad requests get 4xx errors in OpenAI's shape."""

import http.client
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import edgemoe
from edgemoe.bundled import bundled_model_path
from edgemoe.server import OpenAIServer

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
    finish = server.engine._finish
    monkeypatch.setattr(server.engine, "_finish", lambda request, reason, *a, **k: (
        endings.append(reason), finish(request, reason, *a, **k)))
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
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0]"),
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
    ("/v1/chat/completions", {"messages": [{"role": "ab\ud800cd", "content": "hi"}]}, "messages[0].role"),
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
