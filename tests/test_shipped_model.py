"""The shipped ``default-e2e`` adapter: it loads by name, merges once, and makes
SkipDecode at 2x and 3x produce restaurant descriptions on E2E-style input."""

from __future__ import annotations

import json

import pytest

from skipdecode import LLM
from skipdecode.checkpoint import resolve, shipped_adapter

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


def test_shipped_adapter_is_compact_and_portable():
    d = shipped_adapter("default-e2e")
    size = sum(f.stat().st_size for f in d.iterdir())
    assert size <= 40 * 2**20  # the package carries it: at most 40 MB
    assert json.loads((d / "adapter_config.json").read_text())["base_model_name_or_path"] == "default"


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
