"""What a careless or hostile client can do to ``skipdecode serve`` (a real
process on 127.0.0.1): every case is answered with a 4xx in OpenAI's shape or
succeeds, never a 5xx, never stalls other requests, and ``/health`` stays 200.
Every loop here is bounded in count and time."""

from __future__ import annotations

import hmac
import json
import socket
import threading
import time

import pytest

from _server_helpers import Server
from conftest import build_chat_model

KEY = "sk-hostile"
NAME = "tiny"
SEQS, QUEUE = 3, 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("hostile") / "llama", seed=5, layers=4,
                            chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(model_dir, "--api-key", KEY, "--served-model-name", NAME, "--max-num-seqs", str(SEQS),
               "--max-queue", str(QUEUE), "--max-body-bytes", "65536", "--max-prefill-tokens", "8")
    yield s
    assert s.health() == 200, "the server survived every hostile client"
    s.stop()


def raw_request(server, body: bytes, path: str = "/v1/completions", headers: dict | None = None,
                timeout: float = 60) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a plain socket (bodies http.client would refuse to build)."""
    h = {"Host": "127.0.0.1", "Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
         "Connection": "close", "Content-Length": str(len(body)), **(headers or {})}
    head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items() if v is not None) + "\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(head.encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, data.split(b"\r\n\r\n", 1)[1]


def post(server, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    status, data = raw_request(server, json.dumps(body).encode(), path)
    return status, json.loads(data) if data.startswith(b"{") else {}


def assert_openai_4xx(status: int, err: dict, code: int | None = None) -> None:
    assert 400 <= status < 500 and (code is None or status == code), (status, err)
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]


def test_bodies_over_the_size_limit_are_413_declared_or_chunked(server):
    big = json.dumps({"model": NAME, "prompt": "x" * 70000}).encode()
    status, data = raw_request(server, big)
    assert_openai_4xx(status, json.loads(data), 413)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (big[i:i + 8192] for i in range(0, len(big), 8192)))
    status, data = raw_request(server, chunked + b"0\r\n\r\n",
                               headers={"Content-Length": None, "Transfer-Encoding": "chunked"})
    assert_openai_4xx(status, json.loads(data), 413)
    status, data = raw_request(server, b"{}", headers={"Content-Length": "99999999999"}, timeout=10)
    assert_openai_4xx(status, json.loads(data), 413)
    assert server.health() == 200


@pytest.mark.parametrize("fields", [
    {"max_tokens": 10**6}, {"max_tokens": 2**70}, {"prompt": [7] * 600, "max_tokens": 1},
    {"stop": ["x"] * 5000}, {"stop": "y" * 5000},
    {"schedule": {"max_exit_layer": 10**30, "min_exit_layer": 2, "horizon": 3}},
    {"schedule": {"max_exit_layer": 4, "min_exit_layer": -10**30, "horizon": 3}},
    {"schedule": {"max_exit_layer": 4, "min_exit_layer": 2, "horizon": -1}},
    {"schedule": {"max_exit_layer": 4, "min_exit_layer": 2, "horizon": 3, "warmup_layers": 10**20}},
    {"speedup": 1e308}, {"speedup": -1}, {"seed": 2**64}, {"seed": -1}, {"top_k": -5}, {"logprobs": 10**9},
    {"draft_tokens": 10**9, "lossless": True}, {"temperature": 1e308}, {"prompt": "a\ud800b"},
    {"prompt": [2**40]}, {"prompt": [-1]}, {"prompt": [[[1]]]},
])
def test_out_of_range_fields_are_4xx_in_openai_shape(server, fields):
    status, err = post(server, {"model": NAME, "prompt": "hi", "max_tokens": 4, **fields})
    assert_openai_4xx(status, err)


def test_deeply_nested_json_and_garbage_bodies_are_400(server):
    for depth in (100, 10000, 30000):
        body = '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "x": ' + "[" * depth + "]" * depth + "}"
        status, data = raw_request(server, body.encode())
        assert status in (200, 400), status  # shallow: an ignored field; deep: refused
        if status == 400:
            assert_openai_4xx(status, json.loads(data))
    for garbage in (b"\x00\xff\xfe", b'{"model": "tiny", "prompt": "hi"', b"[]", b"null", b'"str"', b"1e999999"):
        status, data = raw_request(server, garbage)
        assert_openai_4xx(status, json.loads(data), 400)
    assert server.health() == 200


def test_nul_bytes_are_text_and_lone_surrogates_are_400(server):
    status, out = post(server, {"model": NAME, "prompt": "a\x00b\x00", "max_tokens": 3, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    status, out = post(server, {"model": NAME, "messages": [{"role": "user", "content": "\x00"}], "max_tokens": 2},
                       "/v1/chat/completions")
    assert status == 200
    for path, body in (("/v1/completions", {"prompt": "x\udc80"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]})):
        status, err = post(server, {"model": NAME, "max_tokens": 2, **body}, path)
        assert_openai_4xx(status, err, 400)


def _stream_socket(server, body: dict, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(60)
    s.connect(("127.0.0.1", server.port))
    data = json.dumps(dict(body, stream=True)).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
              + data)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    return out


def _body(response: bytes) -> bytes:
    """The body of a raw HTTP/1.1 response, chunked transfer decoded."""
    head, rest = response.split(b"\r\n\r\n", 1)
    if b"transfer-encoding: chunked" not in head.lower():
        return rest
    out = b""
    while rest:
        size, rest = rest.split(b"\r\n", 1)
        n = int(size, 16)
        if n == 0:
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return out


def _text(sse: bytes) -> str:
    events = [json.loads(line[6:]) for line in sse.decode().splitlines() if line.startswith("data: {")]
    return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))


def test_a_client_reading_its_stream_slowly_stalls_nobody_and_loses_nothing(server):
    body = {"model": NAME, "prompt": "Tell a long story.", "max_tokens": 400, "temperature": 0}
    status, want = post(server, body)
    assert status == 200
    slow = _stream_socket(server, body, rcvbuf=2048)
    first = slow.recv(64)  # the stream started; now it is not read for a while
    t = time.monotonic()
    status, other = post(server, {"model": NAME, "prompt": "quick", "max_tokens": 20, "temperature": 0})
    assert status == 200 and other["usage"]["completion_tokens"] == 20
    assert time.monotonic() - t < 20, "another request waited for the slow reader"
    time.sleep(1.0)
    assert server.metric("vllm:num_requests_running", model_name=NAME) == 0, \
        "the engine finished the slow reader's request without waiting for it to read"
    sse = _body(first + _read_all(slow))
    assert sse.rstrip().endswith(b"data: [DONE]")
    assert _text(sse) == want["choices"][0]["text"], "the merged stream holds every token, in order"


def test_a_burst_past_the_queue_never_holds_more_than_it_allows(server):
    limit = SEQS + QUEUE
    results: list[tuple[int, float]] = []  # (status, when the response ended)
    sent_at: list[float] = []  # when each request was fully sent
    peak = [0.0]
    stop = threading.Event()

    def sample():  # the engine's own count of requests running and waiting
        while not stop.is_set():
            n = server.metric("vllm:num_requests_running", model_name=NAME) + \
                server.metric("vllm:num_requests_waiting", model_name=NAME)
            peak[0] = max(peak[0], n)
            time.sleep(0.01)

    def one():
        s = _stream_socket(server, {"model": NAME, "prompt": "burst", "max_tokens": 300})
        sent_at.append(time.monotonic())
        data = _read_all(s)
        results.append((int(data.split(b" ", 2)[1]), time.monotonic()))

    sampler = threading.Thread(target=sample)
    sampler.start()
    clients = [threading.Thread(target=one) for _ in range(24)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(120)
    stop.set()
    sampler.join(10)
    statuses = [st for st, _ in results]
    assert len(statuses) == 24 and set(statuses) <= {200, 429}
    assert peak[0] <= limit
    # a request that ended before the last one arrived freed its place (threads start late on a busy
    # machine); a client thread notes its response's end after the server's last byte, up to a
    # scheduling delay later, so one that ended just before the last arrival may read as just after
    slack = 0.1
    finished_early = sum(1 for st, t in results if st == 200 and t < max(sent_at) + slack)
    assert limit >= statuses.count(200) - finished_early >= 1
    assert server.health() == 200


def test_a_client_that_disconnects_during_prefill_frees_its_kv(server):
    before = server.metric("vllm:request_success_total", model_name=NAME, finished_reason="abort")
    for stream in (False, True):
        body = json.dumps({"model": NAME, "prompt": list(range(1, 256)) * 2, "max_tokens": 1,
                           "stream": stream}).encode()
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        s.close()  # gone while its 510-token prompt runs 8 tokens per step
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.metric("vllm:kv_cache_usage_perc", model_name=NAME) == 0 and \
                server.metric("vllm:num_requests_running", model_name=NAME) == 0 and \
                server.metric("vllm:num_requests_waiting", model_name=NAME) == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a disconnected client's request still holds KV")
    done = server.metric("vllm:request_success_total", model_name=NAME)
    assert done >= before
    assert server.health() == 200


def test_the_api_key_is_compared_in_constant_time_and_only_health_and_metrics_are_open(model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    import skipdecode.server.app as app_mod
    from skipdecode.server import ServerConfig, build_app

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(app_mod.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    app = build_app(ServerConfig(model=str(model_dir), served_model_name=NAME, api_key=KEY), load_in_background=False)
    with TestClient(app) as tc:
        assert tc.get("/v1/models").status_code == 401 and calls
        assert tc.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert tc.post("/v1/completions", json={"model": NAME, "prompt": "hi"}).status_code == 401
        assert tc.post("/v1/chat/completions", json={}).status_code == 401
        assert tc.get("/health").status_code == 200 and tc.get("/metrics").status_code == 200
