"""Static layer drop (ShortGPT): block influence is 1 - cos(in, out) per layer, the least
influential layers go, and the pruned checkpoint is exactly the original with those layers
skipped at every position, in our pass and in transformers."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _train_helpers import make_tiny, one_thread, write_e2e_csv  # noqa: E402
from skipdecode.checkpoint import load_model  # noqa: E402
from skipdecode.cli import main  # noqa: E402
from skipdecode.policies.static_drop import (PruneError, block_influence, drop_layers,  # noqa: E402
                                             layers_to_drop, save_pruned)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.mark.parametrize("arch", ["llama", "opt", "gpt2"])
def test_block_influence_is_one_minus_cosine_of_each_layers_input_and_output(tmp_path, arch):
    net, _ = load_model(make_tiny(tmp_path / "m", arch=arch, layers=4, tokenizer=False))
    seqs = [[5, 6, 7, 8, 9], [40, 41, 42]]
    bi = block_influence(net, seqs)
    # by hand: run the blocks one at a time and average over all 8 tokens
    want = torch.zeros(4, dtype=torch.float64)
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            pos = torch.arange(len(s))[None]
            x, rope = net.embed(ids, pos)
            from skipdecode.model import attention_mask

            mask = attention_mask(len(s), 0, None, x.device)
            for layer, block in enumerate(net.layers):
                y = block(x, rope, mask, None, layer, 0)
                want[layer] += (1 - torch.nn.functional.cosine_similarity(x[0].double(), y[0].double(), -1)).sum()
                x = y
    assert bi == pytest.approx((want / 8).tolist(), rel=1e-6)
    assert all(0 <= v <= 2 for v in bi)


def test_the_least_influential_layers_are_dropped_to_reach_the_speedup():
    bi = [0.9, 0.1, 0.05, 0.3, 0.02, 0.04, 0.2, 0.5]
    assert layers_to_drop(bi, 2) == [1, 2, 4, 5]
    assert layers_to_drop(bi, 4) == sorted([4, 5, 2, 1, 6, 3])
    assert layers_to_drop(bi, 1) == []
    with pytest.raises(PruneError, match="speedup"):
        layers_to_drop(bi, 0.5)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_pruned_checkpoint_equals_the_original_with_those_layers_skipped_everywhere(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    src = make_tiny(tmp_path / "m", arch=arch, layers=6, tokenizer=False)
    net, path = load_model(src)
    drop = [1, 2, 4]
    out = save_pruned(net, path, tmp_path / "pruned", drop, [0.0] * 6, 2.0)
    pruned, _ = load_model(out)
    assert pruned.n_layers == 3
    assert json.loads((out / "skipdecode.json").read_text())["static_layer_drop"]["dropped_layers"] == drop
    ids = torch.tensor([[3, 9, 27, 81, 11, 33]])
    pos = torch.arange(6)[None]
    with torch.no_grad():
        skipped = net(ids, pos, [0 if layer in drop else 6 for layer in range(6)])
        got = pruned(ids, pos)
        hf = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
        full = net(ids, pos)
    torch.testing.assert_close(got, skipped, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hf, skipped, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(full, skipped, atol=1e-2)  # the dropped layers did matter
    assert net.n_layers == 6  # the original is untouched
    with pytest.raises(PruneError):
        drop_layers(net, list(range(6)))


def test_prune_cli_writes_a_smaller_model_measured_on_the_data(tmp_path, capsys):
    model = make_tiny(tmp_path / "m", layers=6)
    data = write_e2e_csv(tmp_path / "e2e.csv")
    assert main(["prune", "--model", str(model), "--data", str(data), "--speedup", "3", "--calibration", "4",
                 "--val-groups", "1", "-o", str(tmp_path / "out")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kept"] == 2 and len(rep["dropped_layers"]) == 4 and len(rep["block_influence"]) == 6
    assert load_model(tmp_path / "out")[0].n_layers == 2
    with pytest.raises(SystemExit) as e:
        main(["prune", "--model", str(model), "--data", str(data), "--speedup", "3", "--calibration", "0",
              "-o", str(tmp_path / "o2")])
    assert e.value.code == 2
    assert "argument --calibration: must be an integer >= 1, got 0" in capsys.readouterr().err
