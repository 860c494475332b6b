"""Adaptive per-request monotone budgets: a request steps down its schedule only
after confident tokens, never up, in a continuous batch beside static requests,
token for token as a recompute-everything reference says."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import build_deep_llama, drive
from skipdecode.checkpoint import load_model
from skipdecode.engine import Engine, EngineConfig, EngineError
from skipdecode.policies.adaptive import calibrate, clock_budget, worst_case
from skipdecode.reference import naive_adaptive_generate, naive_generate
from skipdecode.schedule import SkipSchedule

L = 10
VOCAB = 256


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    d = tmp_path_factory.mktemp("adaptive") / "llama"
    build_deep_llama(d, seed=11, layers=L)
    return load_model(d)[0], load_model(d)[0].pack_for_inference()


def _budgets(out) -> list[int]:
    return [len(a) for a in out.active_layers[:-1]]


def test_threshold_zero_is_the_static_schedule_and_one_never_steps_down(deep):
    _, model = deep
    sched = SkipSchedule.for_speedup(3, 12, L, horizon=4, decay=3)
    prompt = list(range(5, 40))
    eng = Engine(model, EngineConfig(kv_slots=2048))
    eng.add_request(prompt, schedule=sched, max_new_tokens=12, request_id="static", ignore_eos=True)
    eng.add_request(prompt, schedule=sched, max_new_tokens=12, request_id="t0", ignore_eos=True,
                    adaptive_threshold=0.0)
    eng.add_request(prompt, schedule=sched, max_new_tokens=12, request_id="t1", ignore_eos=True,
                    adaptive_threshold=1.0)
    out = {o.request_id: o for o in eng.run()}
    assert out["t0"].token_ids == out["static"].token_ids and _budgets(out["t0"]) == sched.budgets(11)
    assert _budgets(out["t1"]) == [sched.budget(0)] * 11  # never sure enough: stays at its first budget


def test_adaptive_requests_in_a_mixed_batch_match_the_naive_reference(deep):
    ref, model = deep
    rng = random.Random(1)
    g = torch.Generator().manual_seed(1)
    arrivals: dict[int, list[dict]] = {}
    specs = {}
    for r in range(10):
        new = rng.randint(4, 10)
        sched = SkipSchedule.for_speedup(rng.choice([2, 3, 4]), new, L, horizon=rng.randint(1, 4), decay=3)
        spec = dict(prompt_token_ids=torch.randint(3, VOCAB, (rng.randint(1, 120),), generator=g).tolist(),
                    schedule=sched, max_new_tokens=new, request_id=f"r{r}")
        if r % 3 != 2:  # two in three adaptive, the rest static batch-mates
            spec["adaptive_threshold"] = rng.choice([0.08, 0.1, 0.12])  # the tiny model's top-1 median is ~0.1
        specs[spec["request_id"]] = spec
        arrivals.setdefault(rng.randint(0, 12), []).append(spec)
    eng = Engine(model, EngineConfig(max_num_seqs=4, max_prefill_tokens=64, prefill_chunk=32, kv_slots=600))
    done = drive(eng, arrivals)
    mixed = 0
    for rid, spec in specs.items():
        out, sched, new = done[rid], spec["schedule"], spec["max_new_tokens"]
        t = spec.get("adaptive_threshold")
        if t is None:
            assert out.token_ids == naive_generate(ref, spec["prompt_token_ids"], sched, new), rid
            continue
        tokens, budgets = naive_adaptive_generate(ref, spec["prompt_token_ids"], sched, t, new)
        assert out.token_ids == tokens, rid
        assert _budgets(out) == budgets, rid
        assert all(a >= b for a, b in zip(budgets, budgets[1:])), "a budget never increases"
        assert all(b >= sched.budget(i) for i, b in enumerate(budgets)), "never shallower than the schedule"
        mixed += budgets != sched.budgets(len(budgets)) and len(set(budgets)) > 1
    assert mixed, "some adaptive request both waited and stepped down"
    assert eng.pool.used_slots == 0


def test_the_kv_reservation_covers_a_request_that_never_steps_down():
    sched = SkipSchedule.for_speedup(3, 20, L, horizon=3, decay=3)
    w = worst_case(sched)
    assert all(w.budget(i) == sched.budget(0) for i in range(30))
    assert clock_budget(sched, 0) == clock_budget(sched, 1) == sched.budget(0)
    assert clock_budget(sched, 5) == sched.budget(4)


def test_adaptive_and_lossless_do_not_combine_and_thresholds_are_probabilities(deep):
    _, model = deep
    eng = Engine(model, EngineConfig(kv_slots=256))
    with pytest.raises(EngineError, match="lossless"):
        eng.make_request([5, 6], adaptive_threshold=0.5, lossless=True)
    for bad in (-0.1, 1.5, float("nan"), True, "0.5"):
        with pytest.raises(EngineError, match=r"\[0, 1\]"):
            eng.make_request([5, 6], adaptive_threshold=bad)


def test_calibration_finds_the_threshold_whose_speedup_meets_the_target():
    def achieved(t: float) -> float:  # falls as the threshold rises, like a real model's
        return 5.0 - 4.0 * t

    t, s = calibrate(achieved, 3.0)
    assert abs(s - 3.0) <= 0.06 and abs(t - 0.5) < 0.02
    assert calibrate(lambda t: 2.0, 3.0) == (0.0, 2.0)  # unreachable: the static schedule's speedup


@pytest.mark.slow
def test_thresholds_calibrated_on_select_are_what_adaptive_true_runs():
    """Calibration searches thresholds on the select split only; its recorded speedup is
    what that threshold achieves; ``adaptive=True`` then runs exactly that threshold on
    that schedule, and a model without a record says so."""
    from pathlib import Path

    from skipdecode import LLM
    from skipdecode.evaluation.evaluate import calibrate_adaptive, load_items
    from skipdecode.generate import GenerationError

    data = Path(__file__).resolve().parents[2] / "shared" / "data" / "e2e" / "devset.csv"
    llm = LLM.load("default-e2e")
    assert set(llm.training["adaptive"]) == {"2x", "3x", "4x"}, "the shipped model carries its thresholds"
    with pytest.raises(GenerationError, match="no adaptive threshold calibrated for 5"):
        llm.generate("hi", speedup=5, adaptive=True)
    rep = calibrate_adaptive("e2e", data, "default-e2e", [2.0], split="select", limit=4, max_new_tokens=24, llm=llm)
    entry = rep["adaptive"]["2x"]
    assert rep["calibrated_on"]["split"] == "select" and 0 <= entry["threshold"] <= 1
    prompts = [it.prompt for it in load_items("e2e", data, "select")[:4]]
    sched = llm.make_schedule(entry["schedule_speedup"])
    outs = llm.generate(prompts, schedule=sched, max_new_tokens=24, adaptive=entry["threshold"])
    fed = sum(len([a for a in o.active_layers if a]) for o in outs)
    ran = sum(len(a) for o in outs for a in o.active_layers)
    assert llm.num_layers * fed / ran == pytest.approx(entry["achieved"], abs=1e-3)
    llm.training["adaptive"] = rep["adaptive"]
    again = llm.generate(prompts, speedup=2, max_new_tokens=24, adaptive=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
