"""``skipdecode serve`` in a real process on 127.0.0.1, driven by the official
``openai`` client, concurrent streams, schemathesis and raw HTTP: the same
text as ``generate``, errors in OpenAI's shape (never a 5xx), aborts that free
KV, a SIGTERM that lets requests in flight finish. A tiny 6-layer Llama with a
byte-level tokenizer and a chat template keeps it fast."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from _server_helpers import Server
from conftest import build_chat_model
from skipdecode.schedule import SkipSchedule

openai = pytest.importorskip("openai")

KEY = "sk-test"
NAME = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    """6 layers, 512 positions, a byte-level tokenizer with a chat template; EOS never wins greedy."""
    return build_chat_model(tmp_path_factory.mktemp("serve") / "llama", seed=11, layers=6,
                            chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(chat_model_dir):
    s = Server(chat_model_dir, "--api-key", KEY, "--served-model-name", NAME, "--max-num-seqs", "16",
               "--kv-tokens", "16384")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(chat_model_dir):
    from skipdecode import LLM

    return LLM.load(chat_model_dir)


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def test_completions_and_chat_through_the_openai_client_equal_generate(server, llm):
    c = client(server)
    prompt = "Describe a pub by the river."
    for sp in (1, 2, 3):
        want = llm.generate(prompt, speedup=sp, max_new_tokens=12, chat=False)[0]
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"speedup": sp})
        assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        assert r.usage.model_extra["decode_layer_speedup"] == pytest.approx(want.decode_layer_speedup, abs=1e-4)
        streamed = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                        extra_body={"speedup": sp})
        assert "".join(ch.choices[0].text for ch in streamed) == want.text

    want = llm.generate("Name a colour.", speedup=2, max_new_tokens=10)[0]  # the chat template, one user turn
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0,
                                  extra_body={"speedup": 2, "trace": True})
    ch = r.choices[0]
    assert ch.message.content == want.text and ch.message.role == "assistant"
    assert ch.model_extra["token_ids"] == want.token_ids
    assert ch.model_extra["active_layers"] == want.active_layers
    chunks = list(c.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"speedup": 2}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert [m.id for m in c.models.list().data] == [NAME]


def test_a_schedule_and_sampling_fields_are_honoured(server, llm):
    c = client(server)
    sched = {"max_exit_layer": 6, "min_exit_layer": 2, "horizon": 4, "warmup_layers": 1}
    s = SkipSchedule.from_dict(sched, 6)
    r = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0,
                             extra_body={"schedule": sched, "trace": True})
    assert r.choices[0].model_extra["active_layers"][:-1] == [s.layers(i) for i in range(7)]
    a = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=1.0, seed=5, top_p=0.9,
                             extra_body={"top_k": 20})
    b = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=1.0, seed=5, top_p=0.9,
                             extra_body={"top_k": 20})
    assert a.choices[0].text == b.choices[0].text, "a seeded sampled request is reproducible"
    stop = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0)
    cut = stop.choices[0].text[2:4]
    if cut:
        r = c.completions.create(model=NAME, prompt="Hello", max_tokens=8, temperature=0, stop=cut)
        assert r.choices[0].finish_reason == "stop" and cut not in r.choices[0].text


def test_lossless_streams_only_verified_tokens_and_reports_its_drafting_in_usage(server, llm):
    """A lossless request gives full depth's text; every streamed prefix is a
    prefix of it (no draft is shown and then taken back); usage reports the
    drafted and accepted tokens and the layer work; stop strings hold."""
    c = client(server)
    prompt = "Describe a pub by the river."
    want = llm.generate(prompt, max_new_tokens=16, chat=False)[0]  # full depth
    for sp, k, conf, lookup in ((2, 1, 0.0, None), (2.5, 4, 0.5, 2), (3, 8, 0.0, None)):
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"speedup": sp, "lossless": True, "draft_tokens": k, "trace": True,
                                             "draft_confidence": conf, "prompt_lookup": lookup})
        assert r.choices[0].text == want.text
        assert r.choices[0].model_extra["token_ids"] == want.token_ids
        u = r.usage.model_extra
        assert u["drafted_tokens"] >= u["accepted_tokens"] >= 0 and u["drafted_tokens"] > 0
        assert u["lookup_drafted_tokens"] >= u["lookup_accepted_tokens"] >= 0
        if lookup is None:
            assert u["lookup_drafted_tokens"] == 0
        assert u["draft_layers"] > 0 and u["verify_layers"] >= 6 * 15
        assert u["layer_work_vs_full_depth"] == pytest.approx((u["draft_layers"] + u["verify_layers"]) / (6 * 15),
                                                              abs=1e-4)
        text = ""
        chunks = c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                      stream_options={"include_usage": True},
                                      extra_body={"speedup": sp, "lossless": True, "draft_tokens": k,
                                                  "draft_confidence": conf})
        for ch in chunks:
            if ch.choices:
                text += ch.choices[0].text
                assert want.text.startswith(text), "a stream shows verified tokens only"
            else:
                assert ch.usage.model_extra["drafted_tokens"] == u["drafted_tokens"]
        assert text == want.text
    drafted = server.metric("skipdecode:lossless_draft_tokens_total", model_name=NAME)
    assert drafted >= server.metric("skipdecode:lossless_accepted_tokens_total", model_name=NAME) >= 0
    assert drafted >= u["drafted_tokens"] > 0
    cut = want.text[3:5]
    if cut.strip():
        r = c.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0, stop=cut,
                                 extra_body={"speedup": 3, "lossless": True})
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want.text[:want.text.index(cut)]
    with pytest.raises(openai.BadRequestError, match="draft_tokens"):
        c.completions.create(model=NAME, prompt=prompt, max_tokens=4, extra_body={"draft_tokens": 3})
    for body in ({"draft_confidence": 0.5}, {"lossless": True, "draft_confidence": 1.0}):
        with pytest.raises(openai.BadRequestError, match="draft_confidence"):
            c.completions.create(model=NAME, prompt=prompt, max_tokens=4, extra_body=body)
    for body in ({"prompt_lookup": 2}, {"lossless": True, "prompt_lookup": 7}):
        with pytest.raises(openai.BadRequestError, match="prompt_lookup"):
            c.completions.create(model=NAME, prompt=prompt, max_tokens=4, extra_body=body)


def test_64_concurrent_streaming_clients_with_mixed_speedups_each_get_their_solo_output(server, llm):
    prompts = [f"Request {i}: describe restaurant number {i * 7 % 13}." for i in range(64)]
    speedups = [(1, 2, 3)[i % 3] for i in range(64)]
    solo = [llm.generate(p, speedup=sp, max_new_tokens=16, chat=False)[0].text for p, sp in zip(prompts, speedups)]

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)

        async def one(p, sp):
            s = await c.completions.create(model=NAME, prompt=p, max_tokens=16, temperature=0, stream=True,
                                           extra_body={"speedup": sp})
            return "".join([ch.choices[0].text async for ch in s])

        return await asyncio.wait_for(asyncio.gather(*(one(p, sp) for p, sp in zip(prompts, speedups))), 180)

    got = asyncio.run(main())
    assert got == solo
    assert server.health() == 200


def test_an_adaptive_request_runs_its_own_budgets_as_generate_does(server, llm):
    """``adaptive`` rides as a body field: the server's tokens and layers are generate's;
    a model with no calibrated threshold says so (400), as does a threshold outside [0, 1]."""
    c = client(server)
    prompt = "Describe a pub by the river."
    want = llm.generate(prompt, speedup=3, max_new_tokens=12, chat=False, adaptive=0.3)[0]
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                             extra_body={"speedup": 3, "adaptive": 0.3, "trace": True})
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.choices[0].model_extra["active_layers"] == want.active_layers
    for bad, match in ((True, "calibrated"), (1.5, r"\[0, 1\]")):
        with pytest.raises(openai.BadRequestError, match=match):
            c.completions.create(model=NAME, prompt=prompt, max_tokens=4, extra_body={"speedup": 3, "adaptive": bad})


def _post(server, path: str, body, key: str | None = KEY, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request("POST", path, body=raw if raw is not None else json.dumps(body), headers=headers)
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), json.loads(data) if data else None


@pytest.mark.parametrize("body, param", [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"n": 2}, None),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": "yes"}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
    ({"speedup": 0.5}, "speedup"), ({"speedup": 2, "schedule": {"max_exit_layer": 6, "min_exit_layer": 2,
                                                                 "horizon": 3}}, None),
    ({"schedule": {"max_exit_layer": 9, "min_exit_layer": 2, "horizon": 3}}, None),
    ({"stop": [1, 2]}, "stop"), ({"prompt": ""}, "prompt"), ({"top_p": 0}, "top_p"),
    ({"seed": -3}, "seed"), ({"prompt": [300]}, None),
])
def test_invalid_fields_are_400_in_openai_shape(server, body, param):
    status, _, err = _post(server, "/v1/completions", {"model": NAME, "prompt": "hi", **body})
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    if param:
        assert err["error"]["param"] == param


def test_errors_for_context_model_key_and_bad_json(server):
    status, _, err = _post(server, "/v1/completions", {"model": NAME, "prompt": "x" * 500, "max_tokens": 50})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded"
    assert err["error"]["param"] == "max_tokens"  # the prompt fits; with max_tokens it does not
    status, _, err = _post(server, "/v1/completions", {"model": NAME, "prompt": [5] * 600, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == "prompt"  # longer than the 512-token context by itself
    status, _, err = _post(server, "/v1/completions", {"model": "gpt-9", "prompt": "hi"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    for key in (None, "wrong"):
        status, _, err = _post(server, "/v1/completions", {"model": NAME, "prompt": "hi"}, key=key)
        assert status == 401 and err["error"]["code"] == "invalid_api_key"
    status, _, err = _post(server, "/v1/chat/completions", None, raw=b"{not json")
    assert status == 400 and "error" in err
    status, _, err = _post(server, "/v1/chat/completions", {"model": NAME, "messages": []})
    assert status == 400 and err["error"]["param"] == "messages"


def test_a_client_that_disconnects_mid_stream_aborts_its_request_and_frees_its_kv(server):
    before = server.metric("vllm:request_success_total", model_name=NAME, finished_reason="abort")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": NAME, "prompt": "Tell a long story.", "max_tokens": 480, "temperature": 0, "stream": True}),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    r = conn.getresponse()
    assert r.status == 200
    r.readline()  # the first event arrived: the request is running
    conn.sock.shutdown(2)
    conn.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.metric("vllm:request_success_total", model_name=NAME, finished_reason="abort") > before and \
                server.metric("vllm:num_requests_running", model_name=NAME) == 0 and \
                server.metric("vllm:kv_cache_usage_perc", model_name=NAME) == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the request was not aborted: {server.metrics()}")
    assert server.health() == 200


@pytest.mark.skipif(shutil.which("schemathesis") is None and shutil.which("st") is None and
                    not os.path.exists(os.path.join(os.path.dirname(sys.executable), "schemathesis")),
                    reason="schemathesis is not installed")
def test_schemathesis_finds_no_server_error_and_the_server_survives(server, tmp_path):
    exe = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    r = subprocess.run([exe, "run", server.url + "/openapi.json", "--checks", "not_a_server_error",
                        "--max-examples", "40", "-H", f"Authorization: Bearer {KEY}", "--request-timeout", "30",
                        "--max-response-time", "30", "--no-color"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert server.health() == 200


def test_queue_full_is_429_with_retry_after(chat_model_dir):
    """With one running slot and no queue, a request that arrives while another
    streams is refused: 429, Retry-After, ``queue_full``. The long request runs
    on a tiny model, so it may end before the second arrives: then (only then)
    the attempt is repeated, at most 5 times."""
    s = Server(chat_model_dir, "--max-num-seqs", "1", "--max-queue", "0")
    try:
        for _ in range(5):
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            conn.request("POST", "/v1/completions", body=json.dumps(
                {"model": str(chat_model_dir), "prompt": "Tell a long story.", "max_tokens": 480, "temperature": 0,
                 "stream": True}),
                headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            r.readline()
            ended: list[float] = []  # when the long stream ended
            reader = threading.Thread(target=lambda: (r.read(), ended.append(time.monotonic())))
            reader.start()
            sent = time.monotonic()
            status, headers, err = _post(s, "/v1/completions", {"model": str(chat_model_dir), "prompt": "hi"},
                                         key=None)
            answered = time.monotonic()
            reader.join(60)
            conn.close()
            if status == 429 or ended[0] > answered:  # the long one ran all along: the answer is the verdict
                break
        assert status == 429 and headers.get("retry-after") == "1" and err["error"]["code"] == "queue_full"
        assert ended[0] > sent, "the long request was still streaming when the second was refused"
    finally:
        s.stop()


def test_sigterm_lets_requests_in_flight_finish_and_exits_0(chat_model_dir):
    s = Server(chat_model_dir, "--grace", "60")
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps(
        {"model": str(chat_model_dir), "prompt": "Tell a long story.", "max_tokens": 480, "temperature": 0,
         "stream": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    first = r.readline()
    assert first.startswith(b"data: ")
    s.proc.send_signal(signal.SIGTERM)
    rest = r.read().decode()
    events = [json.loads(line[6:]) for line in (first.decode() + rest).splitlines()
              if line.startswith("data: {")]
    assert rest.rstrip().endswith("data: [DONE]")
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert s.proc.wait(60) == 0
    assert s.health() is None, "it stopped accepting connections"
    s.stop()


def test_health_fails_and_requests_get_503_when_the_engine_loop_dies(chat_model_dir):
    """In process: break the model so the engine loop dies on its next step;
    the request in flight gets a 503 (no hang), /health turns 503."""
    from fastapi.testclient import TestClient

    from skipdecode.server import ServerConfig, build_app

    app = build_app(ServerConfig(model=str(chat_model_dir), served_model_name=NAME), load_in_background=False)
    with TestClient(app) as tc:
        assert tc.get("/health").status_code == 200
        state = app.state.skipdecode

        def broken(*a, **kw):
            raise RuntimeError("simulated kernel failure")

        state.llm.model.decode = broken
        r = tc.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 5})
        assert r.status_code == 503 and "engine loop" in r.json()["error"]["message"]
        assert tc.get("/health").status_code == 503
        r = tc.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 5})
        assert r.status_code == 503


def test_health_is_503_while_the_model_loads(chat_model_dir, monkeypatch):
    from fastapi.testclient import TestClient

    import skipdecode.llm
    from skipdecode.server import ServerConfig, build_app

    gate = __import__("threading").Event()
    real = skipdecode.llm.LLM.load
    monkeypatch.setattr(skipdecode.llm.LLM, "load", classmethod(lambda cls, *a, **k: gate.wait(30) and real(*a, **k)))
    app = build_app(ServerConfig(model=str(chat_model_dir), served_model_name=NAME))
    with TestClient(app) as tc:
        r = tc.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "loading"
        r = tc.post("/v1/completions", json={"model": NAME, "prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        gate.set()
        for _ in range(300):
            if tc.get("/health").status_code == 200:
                break
            time.sleep(0.1)
        assert tc.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 3}).status_code == 200


def test_a_stream_whose_engine_dies_ends_with_an_error_event(chat_model_dir):
    from fastapi.testclient import TestClient

    from skipdecode.server import ServerConfig, build_app

    app = build_app(ServerConfig(model=str(chat_model_dir), served_model_name=NAME), load_in_background=False)
    with TestClient(app) as tc:
        app.state.skipdecode.llm.model.decode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
        r = tc.post("/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 5, "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "service_unavailable" and "engine loop" in err["message"]


def test_unknown_fields_are_accepted_with_a_warning_and_known_ones_still_validated(server):
    body = {"model": NAME, "prompt": "hi", "max_tokens": 3, "temperature": 0, "tools": [{"type": "function"}],
            "response_format": {"type": "text"}, "vendor_flag": 1, "stream_options": None}  # greedy: EOS never wins
    status, _, out = _post(server, "/v1/completions", body)
    assert status == 200 and out["usage"]["completion_tokens"] == 3
    status, _, out = _post(server, "/v1/chat/completions",
                           {"model": NAME, "messages": [{"role": "user", "content": "hi", "name": "x"}],
                            "max_tokens": 2, "parallel_tool_calls": False})
    assert status == 200
    log = server.output()
    assert "ignoring request field(s)" in log and "vendor_flag" in log and "parallel_tool_calls" in log
    status, _, err = _post(server, "/v1/completions", {**body, "temperature": -1})
    assert status == 400 and err["error"]["param"] == "temperature"


@pytest.mark.parametrize("message", [
    {"role": "user"}, {"role": "user", "content": None}, {"role": "user", "content": ""},
    {"role": "user", "content": []}, {"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},
    {"role": "user", "content": [{"type": "text"}]}, {"role": "user", "content": [{"type": "text", "text": ""}]},
    {"role": "user", "content": 5}, {"role": "robot", "content": "hi"}, {"content": "hi"}, "hello", None,
    {"role": "user", "content": "a\ud800b"},
])
def test_every_malformed_chat_message_is_a_400(server, message):
    raw = json.dumps({"model": NAME, "messages": [{"role": "system", "content": "Be brief."}, message],
                      "max_tokens": 2})
    status, _, err = _post(server, "/v1/chat/completions", None, raw=raw.encode())
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == "messages"


def test_logprobs_for_completions_and_chat_are_the_engines_streamed_or_not(server, llm):
    prompt = "The tiny model says"
    eng = llm.engine()
    eng.add(llm.request(eng, prompt, speedup=2, max_new_tokens=6, logprobs=2, chat=False))
    (want,) = eng.run()
    c = client(server)
    r = c.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                             extra_body={"speedup": 2})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(0 < len(t) <= 2 for t in lp.top_logprobs)
    streamed = []
    for ch in c.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=2, stream=True,
                                   extra_body={"speedup": 2}):
        if ch.choices[0].logprobs is not None:
            streamed += ch.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-4)

    msgs = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                  top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for e in content:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token
    streamed = []
    for ch in c.chat.completions.create(model=NAME, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                        stream=True):
        if ch.choices and ch.choices[0].logprobs is not None:
            streamed += [e.logprob for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content], abs=1e-4)
    status, _, err = _post(server, "/v1/chat/completions", {"model": NAME, "messages": msgs, "top_logprobs": 2})
    assert status == 400 and "logprobs" in err["error"]["message"]


def test_a_model_that_fails_to_load_is_logged_and_the_server_exits_non_zero(tmp_path):
    from _server_helpers import free_port

    r = subprocess.run([sys.executable, "-m", "skipdecode.cli", "serve", "--model", str(tmp_path / "missing"),
                        "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 1
    assert "failed to load" in r.stderr and "missing" in r.stderr and "Traceback" not in r.stderr


def test_max_model_len_chat_template_and_the_startup_and_stats_lines(chat_model_dir, tmp_path, llm):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    s = Server(chat_model_dir, "--served-model-name", NAME, "--max-model-len", "64", "--chat-template",
               str(template), "--log-level", "info", "--stats-interval", "0.2")
    try:
        status, _, err = _post(s, "/v1/completions", {"model": NAME, "prompt": "x" * 60, "max_tokens": 10}, key=None)
        assert status == 400 and err["error"]["code"] == "context_length_exceeded" and "64" in err["error"]["message"]
        status, _, out = _post(s, "/v1/chat/completions",
                               {"model": NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3},
                               key=None)
        assert status == 200 and out["usage"]["prompt_tokens"] == len(llm.tokenizer("hello\n")["input_ids"])
        status, _, out = _post(s, "/v1/chat/completions",  # no max_tokens: what the 64-token context leaves
                               {"model": NAME, "messages": [{"role": "user", "content": "y" * 40}],
                                "temperature": 0}, key=None)  # greedy: this model's EOS never wins, sampled it may
        assert status == 200 and out["usage"]["total_tokens"] == 64 + 1
        deadline = time.monotonic() + 20
        while "generation" not in s.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = s.output()
        assert "skipdecode: serving" in log and "loaded in" in log and "KV pool" in log
        assert "tok/s" in log and "decode layers run" in log
    finally:
        s.stop()


def test_a_server_with_native_bursts_answers_as_generate_does(chat_model_dir, llm):
    """`serve --decode-burst 8`: greedy completions, streamed or not, several at once, give the
    text generate gives (whose bursts give one Python step's tokens), each token streamed once."""
    s = Server(chat_model_dir, "--api-key", KEY, "--served-model-name", NAME, "--decode-burst", "8")
    try:
        c = client(s)
        prompts = ["Describe a pub by the river.", "Name a colour.", "Write about a cafe."]
        for sp in (1, 3):
            want = [llm.generate(p, speedup=sp, max_new_tokens=20, chat=False)[0].text for p in prompts]
            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                got = list(pool.map(lambda p: c.completions.create(model=NAME, prompt=p, max_tokens=20, temperature=0,
                                                                   extra_body={"speedup": sp}), prompts))
            assert [r.choices[0].text for r in got] == want
            streamed = c.completions.create(model=NAME, prompt=prompts[0], max_tokens=20, temperature=0, stream=True,
                                            extra_body={"speedup": sp})
            assert "".join(ch.choices[0].text for ch in streamed) == want[0]
    finally:
        s.stop()


def test_a_server_on_a_float16_kv_cache_answers_as_generate_on_one_does(chat_model_dir):
    """`serve --kv-dtype float16`: completions give the text generate gives on a float16 cache, and
    the start-up line names the pool's dtype."""
    from skipdecode import LLM

    half = LLM.load(chat_model_dir, kv_dtype="float16")
    s = Server(chat_model_dir, "--api-key", KEY, "--served-model-name", NAME, "--kv-dtype", "float16",
               "--log-level", "info")
    try:
        c = client(s)
        for sp in (1, 3):
            want = half.generate("Describe a pub by the river.", speedup=sp, max_new_tokens=16, chat=False)[0].text
            r = c.completions.create(model=NAME, prompt="Describe a pub by the river.", max_tokens=16, temperature=0,
                                     extra_body={"speedup": sp})
            assert r.choices[0].text == want
        assert "float16" in next(ln for ln in s.output().splitlines() if "KV pool" in ln)
    finally:
        s.stop()
