"""``skipdecode serve --ray``: replicas on a local Ray Serve (127.0.0.1), each
its own engine behind the same routes. 40 concurrent requests get the text a
single server gives and are spread over both replicas; a replica killed
mid-run is restarted by Ray and requests keep succeeding, while requests on
the other replica are unaffected; replicas whose model cannot load end the
command with exit code 1 and the reason, instead of restarting forever."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from _server_helpers import Server, free_port

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from test_server import chat_model_dir  # noqa: E402,F401  (the tiny model with a chat template)


@pytest.fixture(scope="module")
def ray_server(chat_model_dir):  # noqa: F811
    s = Server(chat_model_dir, "--ray", "--num-replicas", "2", "--replica-cpus", "1", "--served-model-name", "tiny",
               timeout=240)
    try:
        _until_both_replicas_route(s)
        yield s
    finally:
        s.stop()


def _until_both_replicas_route(server, timeout: float = 120.0) -> None:
    """Serve reports the application ready once its replicas run, but its HTTP
    proxy learns of them asynchronously: a first burst may all go to one. Wait
    (bounded) until a burst reaches both."""
    async def burst():
        c = _client(server)
        return {rid for rid, _, _ in await asyncio.gather(*(_one(c, f"warm {i}", 1, 8) for i in range(16)))}

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(asyncio.run(burst())) == 2:
            return
        time.sleep(1)
    raise RuntimeError(f"the Ray Serve proxy routed to one replica only for {timeout} s: {server.output()}")


@pytest.fixture(scope="module")
def llm(chat_model_dir):  # noqa: F811
    from skipdecode import LLM

    return LLM.load(chat_model_dir)


async def _one(c, prompt: str, sp: float, max_tokens: int = 24):
    r = await c.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, extra_body={"speedup": sp})
    return r.headers.get("x-skipdecode-replica"), int(r.headers.get("x-skipdecode-replica-pid")), r.parse()


def _client(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_forty_concurrent_requests_spread_over_two_replicas_and_equal_one_server(ray_server, llm):
    prompts = [f"Request {i}: a pub near the river." for i in range(40)]
    speedups = [(1, 2, 3)[i % 3] for i in range(40)]
    want = [llm.generate(p, speedup=sp, max_new_tokens=24, chat=False)[0].text for p, sp in zip(prompts, speedups)]

    async def main():
        c = _client(ray_server)
        return await asyncio.wait_for(asyncio.gather(*(_one(c, p, sp) for p, sp in zip(prompts, speedups))), 240)

    res = asyncio.run(main())
    assert [r.choices[0].text for _, _, r in res] == want
    assert len({rid for rid, _, _ in res}) == 2, "both replicas served requests"
    assert ray_server.health() == 200


def test_a_killed_replica_is_restarted_and_requests_keep_succeeding(ray_server):
    async def main():
        c = _client(ray_server)
        first = await asyncio.gather(*(_one(c, f"warm {i}", 1) for i in range(16)))
        pids = {pid for _, pid, _ in first}
        assert len(pids) == 2
        victim, survivor = sorted(pids)

        async def opened(i):  # a stream with its headers in: the replica serving it is known
            r = c.completions.with_streaming_response.create(
                model="tiny", prompt=f"long {i}", max_tokens=400, temperature=0, stream=True)
            resp = await r.__aenter__()
            return r, resp, int(resp.headers["x-skipdecode-replica-pid"])

        async def finish(r, resp):  # streams that outlive the kill; those on the survivor must finish
            try:
                text = "".join([line async for line in resp.iter_lines()])
                return text.rstrip().endswith("[DONE]")
            except Exception:  # noqa: BLE001 - the killed replica's streams may break
                return False
            finally:
                await r.__aexit__(None, None, None)

        streams = []
        for b in range(4):  # open until both replicas serve some (the router may send a batch to one): 32 at most
            streams += await asyncio.wait_for(asyncio.gather(*(opened(8 * b + i) for i in range(8))), 120)
            if {pid for _, _, pid in streams} == pids:
                break
        os.kill(victim, signal.SIGKILL)
        done = await asyncio.wait_for(asyncio.gather(*(finish(r, resp) for r, resp, _ in streams)), 240)
        on_survivor = [ok for (_, _, pid), ok in zip(streams, done) if pid == survivor]
        assert on_survivor and all(on_survivor), "requests on the other replica are unaffected"

        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # Ray replaces the replica; then every request succeeds
            try:
                res = await asyncio.gather(*(_one(c, f"after {i}", 2) for i in range(10)))
            except Exception:  # noqa: BLE001 - routed to the dead replica before Ray noticed
                await asyncio.sleep(1)
                continue
            now = {pid for _, pid, _ in res}
            if len(now) == 2 and victim not in now:
                return True
            await asyncio.sleep(1)
        return False

    assert asyncio.run(main()), "the killed replica was not replaced within 180 s"
    assert ray_server.health() == 200


def test_the_health_check_fails_once_the_replicas_engine_loop_dies(chat_model_dir):  # noqa: F811
    """What Ray's health check runs on a replica: fine while the engine loop
    lives, an error once it has died (Ray then replaces the replica)."""
    from fastapi.testclient import TestClient

    from skipdecode.server import ServerConfig, build_app
    from skipdecode.server.ray_app import check_replica

    app = build_app(ServerConfig(model=str(chat_model_dir), served_model_name="tiny"), load_in_background=False)
    with TestClient(app) as tc:
        state = app.state.skipdecode
        check_replica(state)
        state.llm.model.decode = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("simulated kernel failure"))
        # greedy: a sampled first token may be EOS, which ends the request before any decode step
        r = tc.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert r.status_code >= 500, r.text  # the loop records its error before it fails its waiters
        with pytest.raises(RuntimeError, match="engine loop not alive.*simulated kernel failure"):
            check_replica(state)


def test_replicas_whose_model_fails_to_load_end_serve_with_exit_1_and_the_reason(chat_model_dir, tmp_path):  # noqa: F811
    """The model loads inside each replica, so a broken weights file surfaces only
    there: its start fails, Ray gives up after its retries (one here, to keep the
    test short) and the command says why."""
    import shutil

    bad = tmp_path / "broken"
    shutil.copytree(chat_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT="1")
    r = subprocess.run([sys.executable, "-m", "skipdecode.cli", "serve", "--model", str(bad), "--ray",
                        "--replica-cpus", "1", "--host", "127.0.0.1", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-4000:]
    line = next((x for x in r.stderr.splitlines() if x.startswith("skipdecode: error: the Ray Serve replicas")), "")
    assert "failed to load" in line and "model.safetensors" in line, r.stderr[-4000:]
