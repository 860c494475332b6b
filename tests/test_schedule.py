"""The schedule is pure arithmetic: its invariants are checked exhaustively
(hypothesis), the speedup solver against brute force."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skipdecode.schedule import MODES, SOLVER_TOLERANCE, ScheduleError, SkipSchedule, layers_for_budget


@st.composite
def schedules(draw, max_layers: int = 40) -> SkipSchedule:
    L = draw(st.integers(1, max_layers))
    mode = draw(st.sampled_from(MODES))
    w = draw(st.integers(0, L - 1)) if mode != "nested" else 0
    order = tuple(draw(st.permutations(range(L)))) if mode == "nested" else None
    floor = w if mode == "skip" else 0
    min_e = draw(st.integers(floor + 1, L))
    max_e = draw(st.integers(min_e, L))
    horizon = draw(st.integers(1, 80))
    return SkipSchedule(L, max_e, min_e, horizon=horizon, warmup_layers=w, mode=mode, layer_order=order)


@given(schedules(), st.integers(0, 120))
def test_budgets_are_non_increasing_and_within_bounds(s, n):
    b = s.budgets(n + 2)
    assert all(b1 >= b2 for b1, b2 in zip(b, b[1:]))
    floor = s.warmup_layers if s.mode == "skip" else 0
    assert all(floor < x <= s.num_layers for x in b)
    assert all(s.min_exit_layer <= x <= s.max_exit_layer for x in b)
    assert s.budget(0) == s.max_exit_layer
    assert s.budget(s.horizon) == s.budget(s.horizon + n) == s.min_exit_layer


@given(schedules(), st.integers(0, 100))
def test_layer_sets_shrink_and_match_budgets(s, i):
    """layers(i+1) is a subset of layers(i): every key/value an active layer
    attends to was written by an earlier, deeper position."""
    L = s.num_layers
    cur, nxt = s.layers(i), s.layers(i + 1)
    assert cur == sorted(set(cur)) and all(0 <= l < L for l in cur)
    assert len(cur) == s.budget(i) and len(nxt) == s.budget(i + 1)
    assert set(nxt) <= set(cur)
    assert [l for l in range(L) if s.layer_runs(l, s.budget(i))] == cur
    if s.mode == "skip":
        assert L - 1 in cur, "the last layer always runs"
        assert cur[: s.warmup_layers] == list(range(s.warmup_layers)), "the warm-up layers always run"
        assert cur[s.warmup_layers:] == list(range(L - (s.budget(i) - s.warmup_layers), L)), "then the top ones"
    elif s.mode == "nested":
        assert cur == sorted(s.layer_order[: s.budget(i)]), "the first b layers of the order"
    else:
        assert cur == list(range(s.budget(i)))


@given(schedules(max_layers=24), st.integers(0, 60))
def test_steps_using_layer_counts_a_prefix_of_the_steps(s, n):
    for layer in range(s.num_layers):
        runs = [layer in s.layers(i) for i in range(n)]
        k = s.steps_using_layer(layer, n)
        assert k == sum(runs)
        assert runs == [True] * k + [False] * (n - k)


@given(schedules(), st.integers(1, 100))
def test_decode_layer_speedup_is_layers_over_mean_budget_of_fed_tokens(s, n):
    got = s.decode_layer_speedup(n)
    if n == 1:
        assert got == 1.0  # the only token is never fed back
    else:
        assert got == pytest.approx(s.num_layers * (n - 1) / sum(s.budget(i) for i in range(n - 1)))
        assert 1.0 <= got <= s.num_layers / (s.min_exit_layer)


@given(st.integers(1, 64), st.integers(1, 100))
def test_full_depth_schedule_is_1x(L, n):
    s = SkipSchedule.full_depth(L)
    assert s.decode_layer_speedup(n) == 1.0
    assert all(s.layers(i) == list(range(L)) for i in (0, 1, n))


def _brute_force_best(L: int, target: float, n: int, H: int, w: int) -> float:
    """Smallest |achieved - target| over every valid (max_exit, min_exit)."""
    best = math.inf
    for max_e in range(w + 1, L + 1):
        for min_e in range(w + 1, max_e + 1):
            got = SkipSchedule(L, max_e, min_e, horizon=H, warmup_layers=w).decode_layer_speedup(n)
            best = min(best, abs(got - target))
    return best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_for_speedup_hits_the_target_or_the_closest_achievable(data):
    L = data.draw(st.integers(2, 24), "layers")
    mode = data.draw(st.sampled_from(MODES), "mode")
    w = data.draw(st.integers(0, min(3, L - 1)), "warmup")
    wf = w if mode == "skip" else 0
    target = data.draw(st.floats(1.0, L / (wf + 1)), "target")
    n = data.draw(st.integers(1, 48), "expected_new_tokens")
    order = tuple(data.draw(st.permutations(range(L)), "order")) if mode == "nested" else None
    s = SkipSchedule.for_speedup(target, n, L, warmup_layers=w, mode=mode, layer_order=order)
    assert (s.num_layers, s.warmup_layers, s.mode, s.layer_order) == (L, w if mode != "nested" else 0, mode, order)
    assert s.horizon == max(n - 1, 1)
    got = s.decode_layer_speedup(n)
    best = _brute_force_best(L, target, n, s.horizon, wf)
    assert abs(got - target) <= max(SOLVER_TOLERANCE * target, best) + 1e-9, (got, target, best)


@pytest.mark.parametrize("target, n, L", [(2.0, 64, 30), (3.0, 64, 30), (2.0, 24, 30), (1.5, 10, 12)])
def test_for_speedup_decays_instead_of_staying_flat(target, n, L):
    s = SkipSchedule.for_speedup(target, n, L)
    assert abs(s.decode_layer_speedup(n) / target - 1) <= SOLVER_TOLERANCE
    assert s.max_exit_layer > s.min_exit_layer, "early positions get more depth than late ones"


def test_for_speedup_of_1_is_full_depth():
    s = SkipSchedule.for_speedup(1.0, 32, 30)
    assert s.decode_layer_speedup(32) == 1.0 and s.layers(31) == list(range(30))


def test_for_speedup_with_explicit_horizon():
    s = SkipSchedule.for_speedup(2.0, 40, 30, horizon=10)
    assert s.horizon == 10
    assert abs(s.decode_layer_speedup(40) / 2 - 1) <= SOLVER_TOLERANCE


# -- invalid schedules: clear errors, never silent fallbacks ------------------

def _s(**kw) -> dict:
    return dict(dict(num_layers=12, max_exit_layer=8, min_exit_layer=4, horizon=8), **kw)


@pytest.mark.parametrize("kwargs, message", [
    (_s(max_exit_layer=4, min_exit_layer=6), r"min_exit_layer \(6\) must be <= max_exit_layer \(4\)"),
    (_s(max_exit_layer=13), r"max_exit_layer \(13\) exceeds the model's 12 layers"),
    (_s(min_exit_layer=2, warmup_layers=2), r"min_exit_layer \(2\) must be >= warmup_layers \+ 1 = 3"),
    (_s(min_exit_layer=0, mode="early_exit"), r"must be >= warmup_layers \+ 1 = 1"),
    (_s(mode="top_down"), r"mode must be one of .*'top_down'"),
    (_s(horizon=0), r"horizon must be >= 1"),
    (_s(num_layers=0), r"num_layers must be a positive integer"),
    (_s(warmup_layers=-1), r"warmup_layers must be an integer >= 0"),
])
def test_invalid_schedules_raise_schedule_error(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        SkipSchedule(**kwargs)


@pytest.mark.parametrize("target, L, w, message", [
    (16.0, 30, 1, r"16.0x decode-layer speedup is impossible on 30 layers with 1 warm-up layer\(s\): "
                  r"at most 15.00x"),
    (4.1, 12, 2, r"impossible on 12 layers with 2 warm-up layer\(s\): at most 4.00x"),
    (0.5, 30, 1, r"target speedup must be a number >= 1"),
    (float("nan"), 30, 1, r"target speedup must be a number >= 1"),
])
def test_impossible_speedups_raise_schedule_error(target, L, w, message):
    with pytest.raises(ScheduleError, match=message):
        SkipSchedule.for_speedup(target, 16, L, warmup_layers=w)


def test_the_largest_possible_speedup_is_reached():
    s = SkipSchedule.for_speedup(4.0, 16, 12, warmup_layers=2)  # 12 / (2 + 1): budget 3 everywhere
    assert s.decode_layer_speedup(16) == 4.0 and s.budgets(15) == [3] * 15


def test_negative_position_and_zero_expected_tokens_are_errors():
    with pytest.raises(ScheduleError, match="generated position must be >= 0"):
        SkipSchedule(12, 8, 4, horizon=8).budget(-1)
    with pytest.raises(ScheduleError, match="expected_new_tokens must be an integer >= 1, got 0"):
        SkipSchedule.for_speedup(2.0, 0, 12)


def test_layers_for_budget_examples():
    assert layers_for_budget(8, 4, 1) == [0, 5, 6, 7]
    assert layers_for_budget(8, 4, 2) == [0, 1, 6, 7]
    assert layers_for_budget(8, 4, 0) == [4, 5, 6, 7]
    assert layers_for_budget(8, 4, 1, "early_exit") == [0, 1, 2, 3]
    assert layers_for_budget(8, 8, 1) == list(range(8))


def test_budget_rounds_half_up():
    s = SkipSchedule(10, 10, 5, horizon=2)  # b(1) = 10 - 5 * 0.5 = 7.5
    assert s.budgets(3) == [10, 8, 5]


# -- files ---------------------------------------------------------------------

@given(schedules())
def test_from_dict_round_trip(s):
    assert SkipSchedule.from_dict(s.to_dict()) == s
    assert SkipSchedule.from_dict(json.loads(json.dumps(s.to_dict())), num_layers=s.num_layers) == s


def test_from_file_round_trip(tmp_path):
    s = SkipSchedule(30, 22, 8, horizon=24, warmup_layers=2, mode="skip")
    f = tmp_path / "s.json"
    f.write_text(json.dumps(s.to_dict()))
    assert SkipSchedule.from_file(f) == s
    assert SkipSchedule.from_file(str(f), num_layers=30) == s
    # num_layers may be left to the model
    d = s.to_dict()
    del d["num_layers"], d["warmup_layers"], d["mode"]
    f.write_text(json.dumps(d))
    assert SkipSchedule.from_file(f, num_layers=30) == SkipSchedule(30, 22, 8, horizon=24)


@pytest.mark.parametrize("content, num_layers, message", [
    ('{"num_layers": 30, "max_exit_layer": 20, "min_exit_layer": 8, "horizon": 10, "speed": 2}', None,
     r"unknown schedule field\(s\) \['speed'\]"),
    ('{"num_layers": 30, "max_exit_layer": 20, "horizon": 10}', None, r"missing field\(s\) \['min_exit_layer'\]"),
    ('{"max_exit_layer": 20, "min_exit_layer": 8, "horizon": 10}', None, r"missing field\(s\) \['num_layers'\]"),
    ('{"num_layers": 30, "max_exit_layer": 20.5, "min_exit_layer": 8, "horizon": 10}', None,
     r"'max_exit_layer' must be an integer, got 20.5"),
    ('{"num_layers": 30, "max_exit_layer": 20, "min_exit_layer": 8, "horizon": 10}', 12,
     r"schedule is for 30 layers but the model has 12"),
    ('{"num_layers": 30, "max_exit_layer": 8, "min_exit_layer": 20, "horizon": 10}', None,
     r"must be <= max_exit_layer"),
    ('{"max_exit_layer": 20, "min_exit_layer": 8, "horizon": 10', 30, r"is not valid JSON"),
    ('[20, 8, 10]', 30, r"must hold a JSON object"),
    ('', 30, r"is not valid JSON"),
])
def test_schedule_file_errors(tmp_path, content, num_layers, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    with pytest.raises(ScheduleError, match=message):
        SkipSchedule.from_file(f, num_layers)


def test_missing_schedule_file(tmp_path):
    with pytest.raises(ScheduleError, match=r"schedule file .*nope.json does not exist"):
        SkipSchedule.from_file(tmp_path / "nope.json")


def test_decay_chooses_how_steeply_a_solved_budget_falls():
    steep = SkipSchedule.for_speedup(2, 29, 30)
    gentle = SkipSchedule.for_speedup(2, 29, 30, decay=1.25)
    flat = SkipSchedule.for_speedup(2, 29, 30, decay=1.0)
    assert (steep.max_exit_layer, steep.min_exit_layer) == (24, 5)
    assert steep.max_exit_layer > gentle.max_exit_layer > flat.max_exit_layer
    assert flat.max_exit_layer == flat.min_exit_layer == 15
    for s in (steep, gentle, flat):
        assert abs(s.decode_layer_speedup(29) - 2) <= 0.02 * 2


@pytest.mark.parametrize("decay", [0.5, 0.999, float("nan"), float("inf"), "1.5", True])
def test_decay_below_one_or_not_a_finite_number_is_a_schedule_error(decay):
    with pytest.raises(ScheduleError, match="decay"):
        SkipSchedule.for_speedup(2, 29, 30, decay=decay)


@pytest.mark.parametrize("target", [2, 3, 4, 5])
def test_a_short_horizon_with_a_high_decay_front_loads_the_budget(target):
    """The first tokens run (near) full depth, the floor is reached by token 3, and the
    speedup still hits the target: the depth goes where the answer's first words are."""
    front = SkipSchedule.for_speedup(target, 29, 30, horizon=3, decay=5)
    linear = SkipSchedule.for_speedup(target, 29, 30, decay=1.25)
    assert abs(front.decode_layer_speedup(29) - target) <= 0.01 * target
    assert front.budget(0) >= max(19, linear.budget(0) + 7)
    assert front.budgets(29)[3:] == [front.min_exit_layer] * 26
    assert front.min_exit_layer <= 30 / target  # the rest of the answer pays for the deep start
    # a decay past full depth is full depth: nothing changes above it
    assert SkipSchedule.for_speedup(2, 29, 30, horizon=3, decay=2) == SkipSchedule.for_speedup(
        2, 29, 30, horizon=3, decay=40)


def test_a_speedup_becomes_a_schedule_in_one_place():
    """Trained targets mean their training schedule; other targets are solved in the checkpoint's
    shape (warm-up, decay); an explicit length or warm-up solves even a trained target; 1x is full depth."""
    from skipdecode.policies.select import schedule_for_speedup

    trained = {"1x": SkipSchedule.full_depth(30).to_dict(),
               "2x": SkipSchedule(30, 20, 12, horizon=28, warmup_layers=2).to_dict()}
    assert schedule_for_speedup(2, 30, 29, trained=trained) == SkipSchedule(30, 20, 12, horizon=28, warmup_layers=2)
    assert schedule_for_speedup(1, 30, 29, trained=trained) == SkipSchedule.full_depth(30)
    solved = schedule_for_speedup(3, 30, 29, trained=trained, decay=1.25)
    assert solved == SkipSchedule.for_speedup(3, 29, 30, warmup_layers=2, decay=1.25)  # the checkpoint's warm-up
    assert schedule_for_speedup(2, 30, 29, trained=trained, solve=True) == SkipSchedule.for_speedup(
        2, 29, 30, warmup_layers=2)
    assert schedule_for_speedup(2, 30, 29, trained=trained, mode="early_exit").mode == "early_exit"
    assert schedule_for_speedup(2, 30, 29) == SkipSchedule.for_speedup(2, 29, 30, warmup_layers=1)
    with pytest.raises(ScheduleError, match="target speedup"):
        schedule_for_speedup(0.5, 30, 29)
