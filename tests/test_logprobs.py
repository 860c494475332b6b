"""Log-probabilities: each generated token's, under the pass that chose it, against
the recompute-everything reference (skipped steps: the skipped pass; lossless:
full depth)."""

from __future__ import annotations

import pytest
import torch

from conftest import _LLAMA, build_tiny
from skipdecode.checkpoint import load_model
from skipdecode.engine import Engine, EngineConfig, EngineError
from skipdecode.reference import naive_logits
from skipdecode.schedule import SkipSchedule

L = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("logprobs") / "llama"
    build_tiny("llama", d, seed=3, **dict(_LLAMA, num_hidden_layers=L))
    ref = load_model(d)[0]
    return ref, load_model(d)[0].pack_for_inference()


def _reference(ref, prompt, new_ids, sched):
    """log_softmax of the naive logits that chose each generated token."""
    logits = naive_logits(ref, list(prompt) + new_ids[:-1], len(prompt), sched)
    return torch.log_softmax(logits[len(prompt) - 1:].double(), -1)


@pytest.mark.parametrize("speedup,lossless", [(1, False), (3, False), (3, True)])
def test_logprobs_are_those_of_the_pass_that_chose_each_token(model, speedup, lossless):
    ref, packed = model
    sched = SkipSchedule.full_depth(L) if speedup == 1 else SkipSchedule.for_speedup(speedup, 12, L)
    eng = Engine(packed, EngineConfig(kv_slots=512))
    prompt = [5, 17, 42, 9, 3]
    eng.add_request(prompt, schedule=sched, max_new_tokens=12, logprobs=3, lossless=lossless)
    streamed = []
    done = None
    while eng.has_unfinished():
        for o in eng.step():
            assert o.new_logprobs is not None and len(o.new_logprobs) == len(o.new_token_ids)
            streamed += o.new_logprobs
            done = o if o.finished else done
    assert done.logprobs == streamed and len(done.logprobs) == len(done.token_ids) == 12
    # a lossless request's tokens are full depth's, and so are their log-probabilities
    want = _reference(ref, prompt, done.token_ids, SkipSchedule.full_depth(L) if lossless else sched)
    for i, e in enumerate(done.logprobs):
        assert e.token_id == done.token_ids[i]
        assert e.logprob == pytest.approx(float(want[i, e.token_id]), abs=1e-3)
        top_ids = [t for t, _ in e.top]
        assert len(e.top) == 3 and top_ids[0] == done.token_ids[i]  # greedy: the chosen token is the top one
        assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
        for t, v in e.top:
            assert v == pytest.approx(float(want[i, t]), abs=1e-3)


def test_requests_without_logprobs_carry_none_and_bad_counts_are_clear_errors(model):
    _, packed = model
    eng = Engine(packed, EngineConfig(kv_slots=256))
    eng.add_request([1, 2, 3], max_new_tokens=3)
    (out,) = eng.run()
    assert out.logprobs is None and out.new_logprobs is None
    for bad in (-1, 21, 2.5, True):
        with pytest.raises(EngineError, match="logprobs must be an integer"):
            eng.make_request([1, 2], max_new_tokens=2, logprobs=bad)
