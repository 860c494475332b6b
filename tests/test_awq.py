"""Activation-aware channel scales (skipdecode.awq): the same fp32 function, less int4 rounding error."""

from __future__ import annotations

import json

import pytest
import torch

from skipdecode.awq import apply_scales, check_supported, linear_inputs
from skipdecode.checkpoint import load_model
from skipdecode.config import ModelError
from skipdecode.schedule import SkipSchedule


def _with_outlier_channels(net):
    """Real checkpoints have a few input channels with far larger activations than the rest
    (random tiny ones do not): scale some norm channels up so int4 rounding meets them."""
    with torch.no_grad():
        for block in net.layers:
            block.attn_norm.weight[[3, 17]] *= 25
            block.mlp_norm.weight[[5, 40]] *= 25
    return net


def _calibration(net, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    items = [(torch.randint(3, 250, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist(),
              torch.randint(3, 250, (10,), generator=g).tolist()) for _ in range(n)]
    L = net.n_layers
    return items, [SkipSchedule.full_depth(L), SkipSchedule.for_speedup(2, 10, L)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # grouped KV heads; q/k/v biases
def test_scaled_model_computes_the_same_fp32_function_and_rounds_to_int4_closer_to_it(tiny_dirs, arch):
    net = _with_outlier_channels(load_model(tiny_dirs[arch])[0])
    items, schedules = _calibration(net)
    tokens = torch.randint(3, 250, (3, 14), generator=torch.Generator().manual_seed(7))
    pos = torch.arange(14)[None].expand(3, -1)
    with torch.no_grad():
        before = net(tokens, pos)
    original = {k: v.clone() for k, v in net.state_dict().items()}

    records = apply_scales(net, linear_inputs(net, items, schedules))
    with torch.no_grad():
        after = net(tokens, pos)
    assert ((after - before).norm() / before.norm()).item() < 1e-4  # fp32 rounding only
    # folded in float64, where rounding the scaled weights costs nothing: the same function to 1e-12
    net64 = _with_outlier_channels(load_model(tiny_dirs[arch])[0]).double()
    with torch.no_grad():
        want = net64(tokens, pos)
    apply_scales(net64, linear_inputs(net64, items, schedules))
    with torch.no_grad():
        assert ((net64(tokens, pos) - want).norm() / want.norm()).item() < 1e-12
    assert len(records) == 4 * net.n_layers
    assert all(r["error_share"] <= 1.0 for r in records)
    moved = [r for r in records if r["linear"] in ("wqkv", "w13")]
    assert all(r["exponent"] > 0 and r["error_share"] < 0.9 for r in moved), moved

    def int4_logits(state):
        m = load_model(tiny_dirs[arch])[0]
        m.load_state_dict(state)
        m.pack_for_inference(weights="int4")
        with torch.no_grad():
            return m(tokens, pos)

    err_plain = (int4_logits(original) - before).norm().item()
    err_scaled = (int4_logits(net.state_dict()) - before).norm().item()
    assert err_scaled < 0.8 * err_plain, (err_scaled, err_plain)


def test_awq_refuses_layers_it_cannot_fold_into(tiny_dirs):
    with pytest.raises(ModelError, match="pre-norm SwiGLU"):
        check_supported(load_model(tiny_dirs["opt"])[0])


def test_awq_command_writes_a_checkpoint_that_keeps_its_metadata_and_generates_as_before(tiny_cli_dir, tmp_path):
    from skipdecode import LLM
    from skipdecode.cli import main

    data = tmp_path / "cal.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"pub {i} by the river", "target": f"a quiet pub {i}."}) + "\n"
                            for i in range(8)))
    (tiny_cli_dir / "skipdecode.json").write_text(json.dumps({"expected_new_tokens": 6}))
    out = tmp_path / "awq"
    try:
        assert main(["awq", "--model", str(tiny_cli_dir), "--data", str(data), "--calibration", "8",
                     "--speedups", "1", "2", "--rounding", "nearest", "-o", str(out)]) == 0
    finally:
        (tiny_cli_dir / "skipdecode.json").unlink()
    meta = json.loads((out / "skipdecode.json").read_text())
    assert meta["expected_new_tokens"] == 6 and meta["awq"]["examples"] == 8 and meta["awq"]["speedups"] == [1.0, 2.0]
    kw = dict(max_new_tokens=6, ignore_eos=True)
    want = LLM.load(tiny_cli_dir).generate("Describe a pub.", **kw)[0].token_ids
    assert LLM.load(out).generate("Describe a pub.", **kw)[0].token_ids == want
