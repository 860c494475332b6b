"""The benchmark scripts' own logic, where a mistake would skew what they measure."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from conftest import needs_kernels
from skipdecode import kernels
from skipdecode.checkpoint import load_model

SCRIPTS = Path(__file__).resolve().parent.parent / "benchmarks"


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _OtherVersion:
    """Another kernel module, as kernel_ab builds one from another source: the same calls, another object."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


@needs_kernels
def test_kernel_ab_runs_the_other_kernel_version_in_the_native_decode_loop_as_this_one(tiny_dirs):
    """kernel_ab puts the other version on every compiled call of the model, so both versions decode
    in native bursts: given the layers alone, the final norm and LM head kept this checkout's module
    and the other version decoded in Python steps, a bias toward this checkout."""
    kernel_ab = _script("kernel_ab")
    net = load_model(tiny_dirs["llama"])[0].pack_for_inference()
    assert net.native_greedy(1), "the tiny model's fused layers must run the native loop for this test"
    other = _OtherVersion(kernels.load())
    kernel_ab.use_kernels(net, other)
    net.build_layer_stack()
    assert net.native_greedy(1)
    assert all(m.kernels is other for m in net.modules() if getattr(m, "kernels", None) is not None)
    assert net.lm_head.kernels is other and net.norm.kernels is other


def test_interleaved_hands_out_every_rounds_time_after_the_warm_up_and_takes_the_best_of_them(tiny_dirs):
    """kernel_ab's paired ratio is the median over these rounds of the two versions' ratio, so each
    run's list must hold one time per round, warm-up left out, its least the best reported."""
    kernel_ab = _script("kernel_ab")
    net = load_model(tiny_dirs["llama"])[0]
    from skipdecode.schedule import SkipSchedule

    L = net.cfg.n_layers
    rounds: dict = {}
    best, tokens = kernel_ab.interleaved({"a": lambda: net, "b": lambda: net}, [[1, 5, 9, 3]],
                                         SkipSchedule.full_depth(L), rounds=3, rounds_out=rounds)
    assert set(rounds) == {"a", "b"} and all(len(v) == 3 for v in rounds.values())
    assert best == {name: min(v) for name, v in rounds.items()}
    assert tokens["a"] == tokens["b"]


def test_each_skipping_step_meets_the_fixed_step_of_its_own_budget_at_the_same_position():
    """skip_vs_fixed_depth's per-step control: step j of the skipping run against step j of the
    fixed-depth run of step j's budget, from one round, or each step's best over the rounds (as the
    bench sums them). Matching another step or another budget would fold a step's position (its
    cached keys and values) or depth into what skipping is charged with."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    try:
        svf = _script("skip_vs_fixed_depth")
    finally:
        sys.path.remove(str(SCRIPTS))
    budgets = [3, 3, 2, 1]
    skipping = [[1.0, 1.0, 0.7, 0.5], [0.9, 1.2, 0.6, 0.4]]  # [round][step]
    fixed = {3: [[1.0, 1.1, 1.2, 1.3], [0.8, 1.0, 9.0, 9.0]],
             2: [[5.0, 5.0, 0.6, 5.0], [5.0, 5.0, 0.8, 5.0]],
             1: [[5.0, 5.0, 5.0, 0.3], [5.0, 5.0, 5.0, 0.5]]}
    assert svf.same_layers_each_step(budgets, skipping, fixed, 0) == pytest.approx((1.0 + 1.1 + 0.6 + 0.3, 3.2))
    assert svf.same_layers_each_step(budgets, skipping, fixed, 1) == pytest.approx((0.8 + 1.0 + 0.8 + 0.5, 3.1))
    assert svf.same_layers_each_step(budgets, skipping, fixed, None) == pytest.approx(
        (0.8 + 1.0 + 0.6 + 0.3, 0.9 + 1.0 + 0.6 + 0.4))
