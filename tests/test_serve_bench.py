"""``skipdecode bench --serve``'s parts: the report's ratios, and the
``vllm bench serve`` driver against a real ``skipdecode serve`` process (when
the vLLM virtualenv exists; CI does not build it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _server_helpers import Server
from conftest import build_chat_model
from skipdecode.bench.serve import _vllm_bench, render_markdown, vllm_version

VLLM_VENV = Path(__file__).resolve().parents[1] / ".venv-vllm"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _row(system: str, rate, tok_s: float, tpot99: float, goodput: float) -> dict:
    return {"system": system, "rate": rate, "requests": 4, "generated_tokens": 100, "seconds": 1.0,
            "tokens_per_s": tok_s, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "tpot_p50_ms": tpot99 / 2,
            "tpot_p99_ms": tpot99, "request_goodput": goodput}


def test_the_goodput_table_divides_each_system_by_its_peers():
    report = {"machine": {"cpu": "cpu", "cores": 2, "platform": "linux", "python": "3", "torch": "2",
                          "skipdecode": "0", "date": "today"},
              "settings": {"model": "m", "model_dir": "/m", "requests_per_run": 4, "max_tokens": 8,
                           "client": "vllm bench serve", "quick": True, "tpot_limit_ms": 100.0, "vllm": "0.32.0",
                           "driver": "vllm-bench"},
              "runs": [_row("skipdecode 1x", 2.0, 300.0, 80.0, 1.5), _row("vllm", 2.0, 100.0, 90.0, 0.5),
                       _row("llama.cpp", 2.0, 150.0, 120.0, 0.0)],
              "sustainable_tokens_per_s": {"skipdecode 1x": 300.0, "vllm": 100.0, "llama.cpp": 0.0},
              "max_request_goodput": {"skipdecode 1x": 1.5, "vllm": 0.5, "llama.cpp": 0.0}}
    md = render_markdown(report)
    assert "`skipdecode bench --serve --quick --driver vllm-bench`" in md
    assert "| skipdecode 1x | 300.0 | 3.00x |  | 1.50 | 3.00x |  |" in md
    assert "| skipdecode 1x | 2.0 | 300.0 | 0.10 / 0.20 | 40 / 80 | 1.50 |" in md


@pytest.mark.skipif(vllm_version(VLLM_VENV) is None, reason="no vLLM virtualenv (make vllm-venv)")
def test_vllm_bench_serve_drives_skipdecode_serve_to_every_token(tmp_path):
    model = build_chat_model(tmp_path / "llama", seed=11, layers=6, chat_template=CHAT_TEMPLATE)
    s = Server(model, "--served-model-name", "bench")
    try:
        prompts = ["Describe a pub.", "Name a colour.", "A cafe by the river.", "Tea or coffee?"]
        r = _vllm_bench(VLLM_VENV, s.url, model, prompts, float("inf"), 8, 0, {"speedup": 2}, tmp_path / "vb")
    finally:
        s.stop()
    assert r["requests"] == 4 and r["generated_tokens"] == 4 * 8  # EOS never wins greedy on this model
    assert r["tokens_per_s"] > 0 and r["tpot_p99_ms"] > 0 and 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
