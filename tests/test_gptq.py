"""GPTQ rounding to int4 (skipdecode.gptq): Q4_0's format, a smaller product error than nearest."""

from __future__ import annotations

import json

import pytest
import torch

from skipdecode.awq import LINEARS
from skipdecode.checkpoint import load_model
from skipdecode.gptq import apply, hessians, product_error, round_int4
from skipdecode.model import dequantize_int4, quantize_int4

from test_awq import _calibration, _with_outlier_channels


def _correlated_inputs(k: int, rows: int = 2000, rank: int = 12, seed: int = 0) -> torch.Tensor:
    """Activations like a transformer's: a few directions carry most of the energy, one channel huge."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, rank, generator=g) @ torch.randn(rank, k, generator=g) + 0.1 * torch.randn(rows, k, generator=g)
    x[:, 3] *= 30
    return x


def _nearest(w: torch.Tensor) -> torch.Tensor:
    return dequantize_int4(*quantize_int4(w))


@pytest.mark.parametrize("shape", [(48, 64), (40, 160)])
def test_gptq_weights_round_back_to_the_same_q4_0_codes_and_scales(shape):
    n, k = shape
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(1)) * 0.05
    x = _correlated_inputs(k)
    q = round_int4(w, x.double().T @ x.double(), block=64)
    codes, scales = quantize_int4(q)
    assert torch.equal(dequantize_int4(codes, scales), q)  # what --dtype int4 packs is exactly q
    assert (codes.view(n, k // 32, 32) == 0).any(-1).all()  # every group's scale set by an entry at -8 d
    assert not torch.equal(q, _nearest(w))


def test_gptq_rounds_the_product_closer_than_nearest_on_correlated_inputs():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    x = _correlated_inputs(128)
    h = x.double().T @ x.double()
    share = product_error(w, round_int4(w, h), h) / product_error(w, _nearest(w), h)
    assert share < 0.5, share


def test_inputs_that_never_arrive_leave_zero_weights_and_no_nan():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(3))
    x = _correlated_inputs(64)
    x[:, 40:] = 0
    q = round_int4(w, x.double().T @ x.double())
    assert torch.isfinite(q).all() and (q[:, 40:] == 0).all()


def test_gptq_refuses_shapes_it_cannot_round():
    with pytest.raises(ValueError, match="groups of 32"):
        round_int4(torch.zeros(4, 40), torch.eye(40))
    with pytest.raises(ValueError, match=r"\[64, 64\] input Hessian"):
        round_int4(torch.zeros(4, 64), torch.eye(32))


def test_a_gptq_rounded_model_holds_q4_0_values_and_its_int4_logits_are_closer_to_fp32_than_nearest(tiny_dirs):
    net = _with_outlier_channels(load_model(tiny_dirs["llama"])[0])
    items, schedules = _calibration(net, n=16)
    tokens = torch.tensor(items[0][0] + items[0][1])[None]
    pos = torch.arange(tokens.shape[1])[None]
    original = {k: v.clone() for k, v in net.state_dict().items()}
    with torch.no_grad():
        want = net(tokens, pos)
    records = apply(net, hessians(net, items, schedules))
    assert len(records) == 4 * net.n_layers and all(r["rows"] > 0 for r in records)
    assert all(r["error_share"] < 1.0 for r in records), records
    for block in net.layers:
        for name in LINEARS:  # --dtype int4 packs exactly these values (quantize_int4 reproduces them)
            w = getattr(block, name).weight
            assert torch.equal(_nearest(w), w)

    def logits(state, weights):
        m = load_model(tiny_dirs["llama"])[0]
        m.load_state_dict(state)
        m.pack_for_inference(weights=weights)
        with torch.no_grad():
            return m(tokens, pos)

    err_gptq = (logits(net.state_dict(), "int4") - want).norm().item()
    err_nearest = (logits(original, "int4") - want).norm().item()
    assert err_gptq < err_nearest, (err_gptq, err_nearest)


def test_awq_command_with_gptq_rounding_writes_int4_values_and_records_the_fit(tiny_cli_dir, tmp_path):
    from skipdecode.cli import main

    data = tmp_path / "cal.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"pub {i} by the river", "target": f"a quiet pub {i}."}) + "\n"
                            for i in range(8)))
    out = tmp_path / "gptq"
    assert main(["awq", "--model", str(tiny_cli_dir), "--data", str(data), "--calibration", "8",
                 "--speedups", "1", "2", "--rounding", "gptq", "-o", str(out)]) == 0
    meta = json.loads((out / "skipdecode.json").read_text())
    net = load_model(out)[0]
    assert meta["gptq"]["examples"] == 8 and len(meta["gptq"]["linears"]) == 4 * net.n_layers
    for block in net.layers:
        for name in LINEARS:
            w = getattr(block, name).weight
            assert torch.equal(_nearest(w), w)


def test_dtype_parity_holds_a_gptq_checkpoint_against_the_fp32_model_it_was_made_from(tiny_cli_dir, tmp_path):
    import shutil

    from skipdecode.bench.dtype_parity import reference_model

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_cli_dir, ckpt)
    assert reference_model(str(ckpt)) == str(ckpt)  # no skipdecode.json: its own fp32
    (ckpt / "skipdecode.json").write_text(json.dumps({"awq": {"source": "default-e2e"}}))
    assert reference_model(str(ckpt)) == str(ckpt)  # scales only: the same fp32 function
    (ckpt / "skipdecode.json").write_text(json.dumps({"awq": {"source": "default-e2e"}, "gptq": {"linears": []}}))
    assert reference_model(str(ckpt)) == "default-e2e"
