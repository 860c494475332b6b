"""The shipped adapters (``default-e2e``, ``qwen2.5-coder-0.5b-e2e``): they load by
name, merge once, and make SkipDecode at 2x and 3x produce restaurant
descriptions on E2E-style input."""

from __future__ import annotations

import json

import pytest

from skipdecode import LLM
from skipdecode.checkpoint import SHIPPED_MODELS, resolve, shipped_adapter

pytestmark = pytest.mark.slow

MRS = [
    "name[The Golden Palace], eatType[coffee shop], food[French], priceRange[cheap], area[riverside]",
    "name[Loch Fyne], eatType[restaurant], food[Japanese], customer rating[low], near[The Rice Boat]",
    "name[The Mill], eatType[pub], food[Italian], area[city centre]",
    "name[Blue Spice], priceRange[high], customer rating[average], familyFriendly[yes]",
]


@pytest.fixture(scope="module")
def tuned() -> LLM:
    return LLM.load("default-e2e")


@pytest.mark.parametrize("name, base", [("default-e2e", "default"), ("qwen2.5-coder-0.5b-e2e", "qwen2.5-coder-0.5b")])
def test_shipped_adapter_is_compact_and_portable(name, base):
    assert name in SHIPPED_MODELS
    d = shipped_adapter(name)
    size = sum(f.stat().st_size for f in d.iterdir())
    assert size <= 40 * 2**20  # the package carries it: at most 40 MB
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == base
    assert json.loads((d / "skipdecode.json").read_text())["schedules"]  # the schedules it was trained with


def test_the_shipped_0_5b_model_describes_a_restaurant_at_3x():
    """The skip-trained 0.5B adapter on its pulled base (skipped where the base is not pulled)."""
    from skipdecode.pull import converted_dir, is_pulled

    if not (is_pulled("qwen2.5-coder-0.5b") or (converted_dir("qwen2.5-coder-0.5b") / "model.safetensors").is_file()):
        pytest.skip("qwen2.5-coder-0.5b is not pulled here (skipdecode pull qwen2.5-coder-0.5b-e2e)")
    llm = LLM.load("qwen2.5-coder-0.5b-e2e")
    outs = llm.generate([f"Write one sentence describing this restaurant: {mr}." for mr in MRS], speedup=3,
                        max_new_tokens=60)
    assert all(o.finish_reason == "eos" for o in outs), [o.text for o in outs]
    assert all(o.decode_layer_speedup > 2 for o in outs)
    named = sum(mr.split("]")[0].split("[")[1] in o.text for mr, o in zip(MRS, outs))
    assert named >= len(MRS) - 1, [o.text for o in outs]


def test_default_e2e_is_merged_once(tuned, monkeypatch):
    import skipdecode.lora

    monkeypatch.setattr(skipdecode.lora, "merge_lora", lambda *a, **k: pytest.fail("merged a second time"))
    assert resolve("default-e2e") == tuned.path


@pytest.mark.parametrize("speedup", [2, 3])
def test_skip_trained_model_describes_the_restaurant_at_speedup(tuned, speedup):
    outs = tuned.generate([f"Write one sentence describing this restaurant: {mr}." for mr in MRS],
                          speedup=speedup, max_new_tokens=60)
    named = 0
    for mr, o in zip(MRS, outs):
        assert o.finish_reason == "eos", o.text  # it learned to stop
        named += mr.split("]")[0].split("[")[1] in o.text
        assert o.decode_layer_speedup > 1 + 0.5 * (speedup - 1)  # short outputs decay less
        # uses the schedule it was trained with for this target
        assert o.active_layers[0] == tuned.make_schedule(speedup=speedup).layers(0)
    # quality is measured in benchmarks/results/quality.md; here: most texts name the place
    assert named >= len(MRS) - 1, [o.text for o in outs]
