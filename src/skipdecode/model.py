"""One compact decoder for Llama-family, OPT and GPT-2 checkpoints, with the
skipping forward pass shared by generation, training and the reference.

The skipping forward pass takes ``active_len``: for every layer, how many
*leading* positions of the chunk run it. Budgets never increase along the
sequence, so at any layer the positions that run it are always a prefix:

- prefill: every layer runs every prompt position (full depth);
- one decode step: ``active_len[l]`` is 1 if the step's layer set holds ``l``;
- training: prompt positions plus a prefix of target positions.

Positions past the prefix carry their hidden state through unchanged. The
prefix only attends to itself (causal), so nothing it reads is missing.

``Transformer.decode`` is the same pass for one position per request, along
the other axis: requests at different points of their own schedules share a
step, and layer ``l`` runs on exactly the rows whose layer set holds it. Each
row reads and writes only its own slots of a KV pool (``engine/kv_cache.py``).

Checked against transformers' own modules (logits to 1e-4) in
``tests/test_parity_transformers.py``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import dispatch, kernels
from .config import WEIGHT_DTYPES, ModelConfig


A8_DTYPES = {"w8a8": "int8", "w4a8": "int4", "w8a16": "int8", "w4a16": "int4"}  # -> the weights they run on
A8_FORM = {"w8a8": 1, "w4a8": 1, "w8a16": 2, "w4a16": 2}  # the kernels' activation form: int8, two int8 limbs


DRAFT_VOCAB = 8192  # token ids a lossless draft scores (benchmarks/results/lossless.md measures the effect)


class PackedLinear(nn.Module):
    """Inference-only linear layer on a weight packed once, in the forms this CPU runs fastest.

    A decode step multiplies a handful of rows by every weight, where plain
    ``F.linear`` reaches about half the memory bandwidth. ``weights``:

    - ``float32``: the compiled kernels' 16-column panels (``packed``) and/or
      oneDNN's blocked layout (``onednn``); per row-count bucket, the form the
      autotuner measured faster on this machine runs (``dispatch.plan_for``);
    - ``bfloat16``: the same panels in bf16 (widened to fp32 in registers: half
      the bytes) or oneDNN's bf16 layout (AMX or AVX-512-BF16 where present,
      fp32 accumulation), per bucket the faster; plain ``F.linear`` without either;
    - ``int8``: weight-only int8 with one scale per output channel: the same
      panels in int8 (widened to fp32 in registers, the scale applied to each
      finished sum) or torch's int8 GEMM (bf16 activations), per bucket the
      faster. Half the bytes of bf16 per decode step, which is memory-bound;
    - ``int4``: weight-only 4-bit codes with one bf16 scale per output channel
      and group of 32 inputs (llama.cpp's Q4_0 rule, ``quantize_int4``), on the
      compiled kernels' int4 panels only (a quarter of int8's bytes, plus the
      scales); without the kernels, the dequantized weight on torch's bf16 GEMM.
      A linear whose ``in_features`` is not a multiple of 32 keeps int8, and
      so does the LM head (``Transformer.pack_for_inference``);
    - ``w8a8``, ``w4a8``: the int8 or int4 panels with each row's activations
      quantized to int8 in blocks of 32 (llama.cpp's Q8_0 activations), on the
      CPU's integer dot-product units (AVX512-VNNI; elsewhere AVX2's
      vpmaddubsw/vpmaddwd: the same integer sums, the same outputs). Exact int32 sums make a row's
      result independent of the other rows of the call (batch-invariant). A
      linear whose ``in_features`` is not a multiple of 32 keeps weight-only int8;
    - ``w8a16``, ``w4a16``: the same panels and integer units with activations
      rounded to 15 bits per block of 32 (finer than bf16 near each block's
      largest entry), held as two int8 limbs: two integer dot products per 4
      k instead of widening every weight to fp32, so a memory-bound step is
      no longer bound by the widening. Batch-invariant as w8a8.

    Reduced-precision weights are weight-only: the layer takes and returns the
    model's fp32 activations (rounded to bf16 for the GEMM's input), so norms,
    RoPE and attention keep their fp32 kernels; the KV pool is fp32 unless
    ``kv_dtype`` says otherwise.
    On CPUs with AMX-BF16 the compiled panels run ``bfloat16``, ``int8`` and
    ``int4`` calls of 8 rows or more (``int4`` of 4-5 too), and ``float32`` of
    32 or more, on the tile unit, the activations split into bf16 limbs that sum
    to them exactly: fp32 products summed in the tile's order (``kernels.amx_bf16``).

    The dense weight is dropped after packing, so memory does not double.
    """

    PACK_BATCH_HINT = 32  # oneDNN: one packing serves batch 1..32 at full speed (measured)

    def __init__(self, linear: nn.Linear, kernel_module=None, weights: str = "float32", keep_panels: bool = False):
        super().__init__()
        if weights not in WEIGHT_DTYPES:
            raise ValueError(f"weights must be one of {WEIGHT_DTYPES}, got {weights!r}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        if weights in ("int4", *A8_DTYPES) and not kernels.whole_groups(self.in_features):
            weights = "int8"  # no whole groups of 32 along this weight's inputs
        # int8 activations run on the compiled panels only; without them, weight-only as int8/int4 does
        self.a8 = A8_FORM.get(weights, 0) if kernel_module is not None else 0
        weights = A8_DTYPES.get(weights, weights)
        self.weights = weights
        self.kernels = kernel_module
        self.packed = self.onednn = self.dense = self.qweight = self.scales = self.panel_scales = None
        w = linear.weight.detach()
        if weights == "float32":
            self.plan = dispatch.plan_for(self.out_features, self.in_features, self.kernels)
            if "hand" in self.plan or (keep_panels and self.kernels is not None):  # the fused layer reads them
                self.packed = kernels.pack_weight(w.float())
            if "onednn" in self.plan:
                self.onednn = torch.ops.mkldnn._reorder_linear_weight(w.float(), self.PACK_BATCH_HINT)
        elif weights == "bfloat16":
            has_dnn = dispatch.cpu_features()["onednn_bf16"]
            self.plan = dispatch.plan_for(self.out_features, self.in_features, self.kernels, "bfloat16") \
                if has_dnn else tuple("hand" for _ in dispatch.BUCKETS)
            if self.kernels is not None and ("hand" in self.plan or keep_panels):
                self.packed = kernels.pack_weight(w.bfloat16())
            if has_dnn and "onednn" in self.plan:
                self.onednn = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), self.PACK_BATCH_HINT)
            elif self.packed is None:
                self.dense = w.bfloat16().contiguous()
        elif weights == "int4":
            q, sc = quantize_int4(w)
            self.plan = dispatch.plan_for(self.out_features, self.in_features, self.kernels, "int4")
            if self.kernels is not None:
                self.packed, self.panel_scales = kernels.pack_int4_vnni(q, sc) if self.a8 else kernels.pack_int4(q, sc)
            else:  # no compiled kernels: the same rounding, dequantized, on torch's bf16 GEMM
                self.dense = dequantize_int4(q, sc).bfloat16()
        else:
            q, sc = quantize_int8(w)
            self.plan = dispatch.plan_for(self.out_features, self.in_features, self.kernels,
                                          "w8a8" if self.a8 else "int8")
            if self.kernels is not None and ("hand" in self.plan or keep_panels):
                self.packed = kernels.pack_int8_vnni(q) if self.a8 else kernels.pack_weight(q)
                self.panel_scales = kernels.pack_scales(sc)
            if dispatch.int8mm_takes(self.in_features) and "int8mm" in self.plan:
                self.qweight, self.scales = q, sc
            elif self.packed is None:  # no kernels and a shape torch's int8 GEMM cannot take:
                self.dense = (q.float() * sc.float()[:, None]).bfloat16()  # the same rounding, dequantized
        self.bias = None if linear.bias is None else linear.bias.detach().float()  # the kernels add fp32 bias
        self.bias_bf16 = None if self.bias is None else self.bias.bfloat16()  # torch's bf16 / int8 GEMMs
        # an fp32 LM head's bf16 or int8 copy (with its scales) and its bound, or an int8 head's
        # int8-activation copy, for greedy picks (Transformer.greedy_steps)
        self.approx = self.approx_scale = self.approx_bound = None
        # per bucket, whether greedy steps pick from the copy's pass (dispatch.greedy_head_plan)
        self.greedy_plan: tuple[bool, ...] = tuple(False for _ in dispatch.BUCKETS)

    def uses_hand(self, rows: int) -> bool:
        """Whether a call with ``rows`` rows runs the compiled kernels (the fused decode layer needs it)."""
        library = self.onednn if self.onednn is not None else self.qweight
        return self.packed is not None and (library is None or self.plan[dispatch.bucket(rows)] == "hand")

    def panels(self, x: torch.Tensor) -> torch.Tensor:
        """The product on the compiled kernels' panels (the form the fused decode layer runs), fp32 in and out."""
        return self.kernels.linear(x, self.packed, self.bias, self.out_features, self.panel_scales, a8=self.a8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.uses_hand(x.numel() // self.in_features):
            return self.panels(x)
        if self.weights == "float32":
            return torch.ops.mkldnn._linear_pointwise(x, self.onednn, self.bias, "none", [], "")
        xb = x.to(torch.bfloat16)
        if self.qweight is not None:
            y = torch._weight_int8pack_mm(xb.reshape(-1, self.in_features), self.qweight, self.scales)
            y = (y if self.bias_bf16 is None else y + self.bias_bf16).view(*x.shape[:-1], self.out_features)
        elif self.dense is not None:
            y = F.linear(xb, self.dense, self.bias_bf16)
        else:
            y = torch.ops.mkldnn._linear_pointwise(xb, self.onednn, self.bias_bf16, "none", [], "")
        return y.to(x.dtype)


def head_bound(w: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Per output ``n`` of an fp32 weight ``w [N, K]`` and its rounded copy ``approx``, a ``c_n``
    with ``|approx_n . x - w_n . x| <= ||x||_2 c_n`` for every ``x``, each product as the compiled
    kernels compute it (``kernels.greedy_head`` keeps every output this leaves in doubt).
    ``||w_n - approx_n||_2`` bounds the rounding's share (Cauchy-Schwarz); fp32 summation of K
    products, in any order or tile form, is off by at most about ``(K + 4) 2^-24 sum_k |x_k w_nk|``
    on each side, and that sum is at most ``||x||_2 ||w_n||_2``: counted twice over. On the tile
    unit the approximate side takes x's top bf16 half alone, off by under 2^-7 |x_k| each:
    ``2^-7 ||x||_2 ||approx_n||_2`` more. The whole 5% over, plus 2^-40 for products the tile unit
    flushes to zero below fp32's normal range."""
    out = torch.empty(w.shape[0])
    for i in range(0, w.shape[0], 4096):  # in float64, a block of rows at a time (not three copies of w)
        wd, ad = w[i:i + 4096].double(), approx[i:i + 4096].double()
        summed = 4 * (w.shape[1] + 4) * 2.0 ** -24 * torch.maximum(wd.norm(dim=1), ad.norm(dim=1))
        c = 1.05 * ((wd - ad).norm(dim=1) + summed + 2.0 ** -7 * ad.norm(dim=1)) + 2.0 ** -40
        out[i:i + 4096] = torch.nextafter(c.float(), torch.tensor(float("inf")))  # float32, rounded up
    return out


def int8_head_bound(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per output ``n`` of an int8 head (``q [N, K]``, ``scales [N]``: the exact row ``w_n = s_n q_n``)
    ``||w_n||_2``, rounded up: ``kernels.greedy_head_int8`` multiplies it by each row's own factor
    (its activations' quantization error and both sides' fp32 summation, see there)."""
    out = torch.empty(q.shape[0])
    for i in range(0, q.shape[0], 4096):
        n = (q[i:i + 4096].double() * scales[i:i + 4096].double()[:, None]).norm(dim=1)
        out[i:i + 4096] = torch.nextafter((n * (1 + 2.0 ** -20)).float(), torch.tensor(float("inf")))
    return out


def fp32_head_int8_bound(w: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """For an fp32 head ``w [N, K]`` and its int8 copy (``q``, ``scales``: ``w~_n = s_n q_n``),
    ``[2, N]``: ``c_n = ||w~_n||_2`` (``int8_head_bound``) and ``d_n``, the copy's rounding
    ``||w_n - w~_n||_2`` plus the exact side's fp32 summation over K products (at most
    ``(K + 4) 2^-24 ||x||_2 ||w_n||_2``, counted four times over), rounded up:
    ``kernels.greedy_head`` bounds the copy's pass by ``nx_r c_n + mx_r d_n``."""
    out = torch.empty(2, w.shape[0])
    out[0] = int8_head_bound(q, scales)
    K = w.shape[1]
    for i in range(0, w.shape[0], 4096):
        wd = w[i:i + 4096].double()
        wq = q[i:i + 4096].double() * scales[i:i + 4096].double()[:, None]
        d = (wd - wq).norm(dim=1) + 4 * (K + 4) * 2.0 ** -24 * wd.norm(dim=1)
        out[1, i:i + 4096] = torch.nextafter((d * (1 + 2.0 ** -20)).float(), torch.tensor(float("inf")))
    return out


def fp32_head_copy(w: torch.Tensor, form: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """An fp32 LM head's copy for ``kernels.greedy_head``'s greedy picks, as ``(approx, approx_scale,
    bound)``: ``"bfloat16"`` (``w`` rounded to bf16, no scales, ``head_bound``) or ``"int8"``
    (``quantize_int8``'s rows packed for int8 activations, their scales, ``fp32_head_int8_bound``)."""
    from . import kernels

    w = w.float().contiguous()
    if form == "bfloat16":
        hi = w.bfloat16()
        return kernels.pack_weight(hi), None, head_bound(w, hi)
    if form == "int8":
        q, sc = quantize_int8(w)
        return kernels.pack_int8_vnni(q), kernels.pack_scales(sc), fp32_head_int8_bound(w, q, sc.float())
    raise ValueError(f"an fp32 head's copy is 'bfloat16' or 'int8', not {form!r}")


def int8_panel_weights(packed: torch.Tensor, n: int, vnni: bool = False) -> torch.Tensor:
    """The ``[n, K]`` int8 weights of int8 panels (``kernels.pack_weight``'s layout, or with ``vnni``
    ``kernels.pack_int8_vnni``'s)."""
    NP, K, P = packed.shape
    if vnni:  # [NP, K/4, 16, 4] bytes offset by 128 -> [NP, 16, K]
        u = packed.view(torch.uint8).reshape(NP, K // 4, P, 4).permute(0, 2, 1, 3).reshape(NP * P, K)
        return (u.to(torch.int16) - 128).to(torch.int8)[:n].contiguous()
    return packed.transpose(1, 2).reshape(NP * P, K)[:n].contiguous()


def int8_head_row_factor(x: torch.Tensor, two_limbs: bool = False) -> torch.Tensor:
    """Per row of ``x [R, K]`` (K a multiple of 32), in float64, the factor ``nx_r`` that
    ``kernels.greedy_head_int8`` multiplies ``int8_head_bound`` by: the row's own error from
    quantizing it as the int8-activation pass does (blocks of 32, scale max|x| / 127, round half to
    even), plus, for a head on ``two_limbs``, its error as that head quantizes it (top 127 * 128),
    5% over, plus both sides' fp32 summation. For tests and benchmarks that check the bound or
    count the ids it leaves in doubt."""
    R, K = x.shape
    xb = x.reshape(R, K // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    e = torch.zeros(R, dtype=torch.float64)
    for top in (127.0, 127.0 * 128) if two_limbs else (127.0,):
        inv = torch.where(amax > 0, top / amax, 0.0)  # fp32, as the kernels compute it
        xt = torch.round(xb * inv).clamp(-top, top).double() * (amax / top).double()
        e += (xb.double() - xt).reshape(R, K).norm(dim=1)
    nrm = x.double().norm(dim=1)
    return 1.05 * (e + 4 * (K + 4) * 2.0 ** -24 * (nrm + e)) + 2.0 ** -40 * nrm


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``w ~= qweight * scales[:, None]`` (scales in bf16,
    the activation dtype torch's int8 GEMM takes)."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-8).bfloat16()
    q = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise 4-bit weights, llama.cpp's Q4_0 rule: per output channel and group of 32 inputs,
    the scale maps the entry of largest magnitude to -8 (``d = m / -8``), and each weight is
    ``(q - 8) * d`` with ``q`` in 0..15. Returns codes ``[N, K]`` (uint8) and bf16 scales
    ``[N, K/32]`` (the codes are rounded against the bf16 scale actually stored)."""
    g = kernels.INT4_GROUP
    n, k = w.shape
    if k % g:
        raise ValueError(f"int4 weights need in_features divisible by {g}, got {k}")
    wg = w.float().reshape(n, k // g, g)
    d, inv, _ = int4_scale(wg)
    q = torch.round(wg * inv + 8).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k).contiguous(), d.squeeze(-1).bfloat16().contiguous()


def int4_scale(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0's scale of each group along the last dim of fp32 ``groups``: ``d`` (bf16-rounded, as
    stored) maps the entry of largest magnitude to code 0 (``-8 d``); returns ``d`` and ``1 / d``
    (0 for an all-zero group), each with a trailing dim of 1, and that entry's index."""
    top = groups.abs().argmax(dim=-1, keepdim=True)
    d = (groups.gather(-1, top) / -8).bfloat16().float()
    return d, torch.where(d == 0, torch.zeros_like(d), 1 / d), top


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight int4 codes stand for: ``(q - 8) * scale`` of their group."""
    n, k = q.shape
    g = kernels.INT4_GROUP
    return ((q.float().reshape(n, k // g, g) - 8) * scales.float()[..., None]).reshape(n, k)


def can_pack(dtype: torch.dtype, kernel_module=None) -> bool:
    return torch.backends.mkldnn.is_available() or kernel_module is not None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.kernels = None  # the compiled CPU kernels, set by Transformer.pack_for_inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:  # one fused loop instead of ~8 dispatched ops per call
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _norm(cfg: ModelConfig, dim: int) -> nn.Module:
    return RMSNorm(dim, cfg.norm_eps) if cfg.norm == "rms" else nn.LayerNorm(dim, eps=cfg.norm_eps)


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "relu":
        return F.relu(x)
    if name == "gelu":
        return F.gelu(x)
    return F.gelu(x, approximate="tanh")


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama 3's frequency-dependent scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs:  # rope_type == "llama3"
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / lo, old_len / hi
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(is_medium, smoothed, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, nh, hd); cos/sin: (B, T, 1, hd). HF's "rotate_half" convention.
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


@dataclass
class LayerRows:
    """The rows of a decode step that run one layer.

    rows: None (every row), an int ``n`` (rows ``0..n-1``: with rows ordered by
    budget, the rows running a layer are a leading block for ``skip`` and
    ``early_exit``), or a ``LongTensor`` of row indices (any other mix).
    slots: ``(n, 2)`` int64, each row's (first slot, slot count) in this layer's
    pool, the count including the position being decoded.
    """

    rows: int | torch.Tensor | None
    slots: torch.Tensor


@dataclass
class PrefillChunk:
    """One request's prompt chunk in a packed prefill: ``tokens`` at positions
    ``start..start+len-1``, whose keys/values ``cache.update`` writes (as in
    ``Block.attention``)."""

    tokens: Sequence[int]
    start: int
    cache: Any


BLOCK_LINEARS = ("wqkv", "wo", "w13", "w2")  # every Block's linears, in the order a layer runs them


class Block(nn.Module):
    """One transformer layer: attention + MLP, pre- or post-norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        H, K, hd, D, I = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.dim, cfg.intermediate_size
        self.attn_norm = _norm(cfg, D)
        self.mlp_norm = _norm(cfg, D)
        self.wqkv = nn.Linear(D, (H + 2 * K) * hd, bias=cfg.qkv_bias)  # fused: one GEMM
        self.wo = nn.Linear(H * hd, D, bias=cfg.o_bias)
        if cfg.mlp == "swiglu":
            self.w13 = nn.Linear(D, 2 * I, bias=cfg.mlp_bias)  # gate and up, fused
        else:
            self.w13 = nn.Linear(D, I, bias=cfg.mlp_bias)  # fc1
        self.w2 = nn.Linear(I, D, bias=cfg.mlp_bias)
        self.kernels = None  # the compiled CPU kernels, set by Transformer.pack_for_inference
        self.fused_decode = False  # one kernel call per decode step, set by Transformer.pack_for_inference
        self.fuse_plan: tuple[bool, ...] = ()  # per row-count bucket: run the fused call (dispatch.fused_plan)
        self._fused_args: tuple | None = None  # the fused call's fixed arguments, set with fused_decode (_fuse)

    def can_fuse_decode(self, packed: bool = True) -> bool:
        """Whether ``kernels.decode_block`` implements this layer: pre-norm
        Llama family (RMSNorm, RoPE, SwiGLU), with the weights in the kernels' panels."""
        cfg = self.cfg
        return (self.kernels is not None and cfg.pre_norm and cfg.norm == "rms" and cfg.mlp == "swiglu"
                and cfg.pos == "rope" and cfg.head_dim % 8 == 0
                and (not packed or all(isinstance(getattr(self, n), PackedLinear) and getattr(self, n).packed
                                       is not None for n in BLOCK_LINEARS)
                     # one call runs its four linears with or without int8 activations, not a mix
                     and len({getattr(self, n).a8 for n in BLOCK_LINEARS}) == 1))

    def qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``(B, T, H, hd)``, keys and values ``(B, T, K, hd)``, rotated."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        qk, v = self.wqkv(x).split([(H + K) * hd, K * hd], dim=-1)
        qk = qk.view(B, T, H + K, hd)
        if rope is not None and self.kernels is not None:
            self.kernels.rope_(qk, *rope)  # in place, queries and keys in one pass
        elif rope is not None:
            qk = apply_rope(qk, *rope)  # queries and keys rotated in one pass
        q, k = qk.split([H, K], dim=2)
        return q, k, v.view(B, T, K, hd)

    def attention(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                  mask: torch.Tensor | None, cache, layer: int, start: int) -> torch.Tensor:
        """Attention over a dense cache (prefill, training, the reference).
        ``cache.update(layer, start, k, v)`` stores this chunk's keys/values
        at slots ``start..start+T`` and returns slots ``0..start+T``."""
        cfg = self.cfg
        B, T, _ = x.shape
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = self.qkv(x, rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, nh, T, hd)
        if cache is not None:
            k, v = cache.update(layer, start, k, v)  # (B, K, start+T, hd)
        if T == 1 and self.kernels is not None and hd % 8 == 0:  # keys/values read once per KV group
            return self.wo(self.kernels.decode_attention(q[:, :, 0], k, v, mask, hd ** -0.5))
        if T == 1 and H != K:
            # GQA decode: fold the query heads of a KV group into the query axis,
            # so keys/values are read once per group and never repeated.
            y = F.scaled_dot_product_attention(q.reshape(B, K, H // K, hd), k, v, attn_mask=mask)
        else:
            if H != K:
                k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.reshape(B, H, T, hd).transpose(1, 2).reshape(B, T, H * hd))

    def attention_pool(self, x: torch.Tensor, rope, kpool: torch.Tensor, vpool: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
        """One position per row over a KV pool ``(K, pool_slots, hd)``: row ``r``
        owns slots ``slots[r, 0] .. slots[r, 0] + slots[r, 1] - 1``; its new
        key/value goes to the last of them and it attends to all of them."""
        cfg = self.cfg
        R = x.shape[0]
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = self.qkv(x, rope)  # (R, 1, nh, hd)
        last = slots[:, 0] + slots[:, 1] - 1
        kpool[:, last] = k[:, 0].transpose(0, 1).to(kpool.dtype)  # rounded to the pool's dtype
        vpool[:, last] = v[:, 0].transpose(0, 1).to(vpool.dtype)
        if self.kernels is not None and hd % 8 == 0:  # reads each row's own slots, nothing else
            return self.wo(self.kernels.decode_attention(q[:, 0].contiguous(), kpool, vpool, None, hd ** -0.5, slots))
        # plain torch: gather each row's slots into a padded block, mask the tail
        n = int(slots[:, 1].max())
        offs = torch.arange(n)
        idx = (slots[:, :1] + offs).clamp(max=kpool.shape[1] - 1)  # (R, n)
        valid = offs[None, :] < slots[:, 1:]
        kg, vg = (p[:, idx].transpose(0, 1).to(q.dtype) for p in (kpool, vpool))  # (R, K, n, hd)
        y = F.scaled_dot_product_attention(q[:, 0].reshape(R, K, H // K, hd), kg, vg,
                                           attn_mask=valid[:, None, None, :])
        return self.wo(y.reshape(R, 1, H * hd))

    def attention_chunks(self, x: torch.Tensor, rope, chunks: Sequence[PrefillChunk], layer: int) -> torch.Tensor:
        """Prompt chunks of several requests packed into one row ``(1, sum T, dim)``:
        the projections run as one GEMM over every chunk's tokens, attention runs
        per chunk over its own request's cache, exactly as ``attention`` would."""
        cfg = self.cfg
        H, K, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q, k, v = self.qkv(x, rope)  # (1, sum T, nh, hd)
        ys, lo = [], 0
        for c in chunks:
            T = len(c.tokens)
            qc, kc, vc = (t[:, lo:lo + T].transpose(1, 2) for t in (q, k, v))
            kc, vc = c.cache.update(layer, c.start, kc, vc)
            if H != K:
                kc, vc = kc.repeat_interleave(H // K, dim=1), vc.repeat_interleave(H // K, dim=1)
            y = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=attention_mask(T, c.start, None, x.device))
            ys.append(y.transpose(1, 2).reshape(1, T, H * hd))
            lo += T
        return self.wo(torch.cat(ys, 1))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w13(x)
        if self.cfg.mlp == "swiglu" and self.kernels is not None:
            return self.w2(self.kernels.silu_mul(h))
        if self.cfg.mlp == "swiglu":
            gate, up = h.chunk(2, dim=-1)
            return self.w2(F.silu(gate) * up)
        return self.w2(_act(self.cfg.mlp, h))

    def _residual(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The layer around its attention: pre-norm (Llama, GPT-2, OPT) or post-norm (OPT-350m)."""
        if self.cfg.pre_norm:
            x = x + attend(self.attn_norm(x))
            return x + self.mlp(self.mlp_norm(x))
        x = self.attn_norm(x + attend(x))
        return self.mlp_norm(x + self.mlp(x))

    def forward(self, x, rope, mask, cache, layer: int, start: int) -> torch.Tensor:
        """Every position of a chunk ``(B, T, dim)`` over a dense cache (or none)."""
        return self._residual(x, lambda h: self.attention(h, rope, mask, cache, layer, start))

    def fuses(self, rows: int, bucket: int | None = None) -> bool:
        """Whether a decode call with ``rows`` rows runs as the fused kernel call (``decode``);
        ``bucket``: ``dispatch.bucket(rows)`` when the caller has it."""
        return self.fused_decode and self.fuse_plan[dispatch.bucket(rows) if bucket is None else bucket]

    def decode(self, x: torch.Tensor, rope, kpool: torch.Tensor, vpool: torch.Tensor, slots: torch.Tensor,
               bucket: int | None = None) -> torch.Tensor:
        """One position per row ``(R, 1, dim)`` over this layer's KV pool. ``bucket``:
        ``dispatch.bucket(R)`` when the caller has it (one lookup per step rather than per layer)."""
        if self.fuses(x.shape[0], bucket):
            # the same layer as one kernel call on the compiled kernels' panels (tests/test_kernels.py)
            weights, heads, scales = self._fused_args
            return self.kernels.decode_block(x, *weights, kpool, vpool, slots, rope[0], rope[1], *heads, *scales)
        return self._residual(x, lambda h: self.attention_pool(h, rope, kpool, vpool, slots))

    def _fuse(self) -> None:
        """Set ``fused_decode`` and, when on, the fused call's fixed arguments, gathered once:
        looked up per call (a dozen module attributes) they cost 13.7 us a layer against 1.6 us
        (benchmarks/step_overhead.py), where the kernel takes about 100 us for a SmolLM2 layer in
        w4a8 at one row."""
        self.fused_decode = self.can_fuse_decode()
        if not self.fused_decode:
            self._fused_args = None
            return
        a, m, lin = self.attn_norm, self.mlp_norm, (self.wqkv, self.wo, self.w13, self.w2)
        weights = (a.weight, m.weight, a.eps, *(t for w in lin for t in (w.packed, w.bias)))
        self._fused_args = (weights, (self.cfg.n_heads, self.cfg.head_dim ** -0.5),
                            (*(w.panel_scales for w in lin), self.wqkv.a8))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        E = cfg.embed_proj_dim or cfg.dim
        self.tok_emb = nn.Embedding(cfg.vocab_size, E)
        self.pos_emb = nn.Embedding(cfg.max_position + cfg.pos_offset, cfg.dim) if cfg.pos == "learned" else None
        self.project_in = nn.Linear(E, cfg.dim, bias=False) if cfg.embed_proj_dim else None
        self.project_out = nn.Linear(cfg.dim, E, bias=False) if cfg.embed_proj_dim else None
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _norm(cfg, cfg.dim) if cfg.final_norm else None
        self.lm_head = nn.Linear(E, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        if cfg.pos == "rope":
            self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self.kernels = None  # the compiled CPU kernels, set by pack_for_inference
        self.weights = "float32"  # the packed weights' dtype, set by pack_for_inference
        # the KV pool's dtype for an engine on this model (None: the parameters'); float16 or
        # bfloat16 halve the keys/values a decode step reads and stores (see kv_cache.KV_DTYPES)
        self.kv_dtype: torch.dtype | None = None
        self.draft_vocab = cfg.vocab_size  # token ids a lossless draft scores (see draft_logits)
        self.draft_head: nn.Module | None = None
        self._head_rows: torch.Tensor | None = None  # the dense LM head, for a draft's extra token ids
        self._stack = self._stack_kernels = None  # the fused layers as one kernel call (build_layer_stack)
        self._stack_plan: tuple[bool, ...] = ()  # per row-count bucket: every layer fuses
        self._stack_layers: tuple = ()  # the blocks the stack was built from, in order
        self._rope_tables: dict = {}  # per dtype: _rope's values for positions 0..n-1 (_rope_lookup)
        # greedy_steps picks from the fp32 head's int8 or bf16 copy where it has one (kernels.greedy_head);
        # False: every logit from the fp32 head (the same picks, for timing one against the other)
        self.greedy_approx = True

    @property
    def n_layers(self) -> int:
        return self.cfg.n_layers

    def pack_for_inference(self, use_kernels: bool = True, weights: str | None = None,
                           draft_vocab: int = DRAFT_VOCAB) -> "Transformer":
        """Swap every block linear and the LM head for ``PackedLinear``; give
        RMSNorm, RoPE, SwiGLU and decode attention the compiled kernels (no autograd).

        ``weights``: ``float32``, ``bfloat16``, ``int8`` or ``int4`` (default: the
        parameters' dtype); reduced precision applies to the linears' weights
        only (see ``PackedLinear``), everything else stays as loaded. Only for generation:
        training keeps the plain modules. With ``use_kernels=False`` (or where
        they cannot be built) fp32 linears run on oneDNN and the rest on plain torch.
        ``draft_vocab``: the token ids a lossless request's drafts score (``draft_logits``).
        """
        self.set_draft_vocab(draft_vocab)
        dtype = self.lm_head.weight.dtype
        weights = weights or {torch.float32: "float32", torch.bfloat16: "bfloat16"}.get(dtype)
        if weights not in WEIGHT_DTYPES:
            return self  # float16: plain modules
        k = kernels.load() if use_kernels and dtype == torch.float32 else None  # the kernels are fp32
        if not can_pack(dtype, k):
            return self
        names = BLOCK_LINEARS
        for block in self.layers:
            block.kernels = k
            if block.can_fuse_decode(packed=False):
                block.fuse_plan = dispatch.fused_plan([tuple(getattr(block, n).weight.shape) for n in names], k,
                                                      weights)
            fuse = any(block.fuse_plan)
            for name in names:
                setattr(block, name, PackedLinear(getattr(block, name), k, weights, keep_panels=fuse))
        # int4 keeps the LM head in int8, as llama.cpp's Q4_0 keeps its output matrix at 6 bits: 4-bit
        # logits cost a 135M model 13 BLEU on E2E (benchmarks/results/dtype-parity.md's history)
        head = {"int4": "int8", "w4a8": "w8a8", "w4a16": "w8a16"}.get(weights, weights)
        greedy = head == "float32" and self.lm_head.bias is None and k is not None
        greedy8 = head in ("int8", "w8a16") and self.lm_head.bias is None and k is not None \
            and hasattr(k, "greedy_head_int8") \
            and kernels.whole_groups(self.lm_head.in_features)  # int8 activations: blocks of 32
        self.lm_head = PackedLinear(self.lm_head, k, head, keep_panels=greedy or greedy8)
        if greedy:
            w = self._head_rows.float().contiguous()  # the dense head (tied: the embedding), kept for drafts
            self._head_rows = w
            h = self.lm_head
            copy = dispatch.greedy_head_copy(*w.shape, k)  # int8 where its picks were no slower than bf16's
            h.approx, h.approx_scale, h.approx_bound = fp32_head_copy(w, copy)
            # where the head's plan has oneDNN, greedy steps may still pick faster from the copy's pass
            h.greedy_plan = dispatch.greedy_head_plan(*w.shape, k, h.plan, copy)
            if not any(h.greedy_plan):  # neither the panels nor the copy's pass ever run: drop them
                h.packed = h.approx = h.approx_scale = h.approx_bound = None
        if greedy8 and self.lm_head.packed is not None and self.lm_head.packed.dtype == torch.int8:
            # greedy steps pick from an int8-activation pass over an int8 head where measured faster
            # (kernels.greedy_head_int8; many rows): fp32-activation heads keep a copy packed for it,
            # two-limb heads (w8a16, w4a16) are packed so already
            h = self.lm_head
            h.greedy_plan = dispatch.int8_greedy_head_plan(h.out_features, h.in_features, k, h.plan, h.a8)
            if any(h.greedy_plan):
                q = int8_panel_weights(h.packed, h.out_features, vnni=h.a8 != 0)
                sc = h.panel_scales[:h.out_features]
                h.approx = h.packed if h.a8 else kernels.pack_int8_vnni(q)
                h.approx_bound = int8_head_bound(q, sc)
            elif "hand" not in h.plan:  # kept for the pass alone, which never runs: drop them
                h.packed = h.panel_scales = None
        if self.draft_head is not None:
            self.draft_head = PackedLinear(self.draft_head, k, head)
        for m in self.modules():
            if isinstance(m, (RMSNorm, Block)):
                m.kernels = k
        self._weights_on_huge_pages()
        for block in self.layers:
            block._fuse()
        self.kernels = k
        self.weights = weights
        self.build_layer_stack()
        self._time_fusion()
        return self

    def _time_fusion(self) -> None:
        """Where the linears' times left a bucket unfused (``dispatch.fused_plan``), time the whole
        layers both ways there and fuse where that is faster (``dispatch.layers_fused_plan``)."""
        if self._stack is None:
            return
        cfg = self.cfg
        signature = (f"{self.n_layers} x dim {cfg.dim} ffn {cfg.intermediate_size} heads {cfg.n_heads}/"
                     f"{cfg.n_kv_heads}x{cfg.head_dim} {self.weights}")
        plan = dispatch.layers_fused_plan(signature, self._stack_plan, self.kernels, self._time_layers)
        if plan != self._stack_plan:
            for b in self.layers:
                b.fuse_plan = tuple(p or q for p, q in zip(b.fuse_plan, plan))
            self.build_layer_stack()

    @torch.inference_mode()
    def _time_layers(self, rows: int, context: int = 64) -> tuple[float, float]:
        """Seconds of one decode position of ``rows`` rows (each ``context`` positions in) through
        every layer: as the layer stack's one fused call, and layer by layer unfused (each linear in
        its own plan's form). Random activations; one KV pool that every layer shares."""
        cfg, L = self.cfg, self.n_layers
        S = context + 1
        kpool = torch.randn(cfg.n_kv_heads, rows * S, cfg.head_dim) * 0.1
        vpool = torch.randn_like(kpool)
        slots = torch.tensor([[r * S, S] for r in range(rows)])
        x = torch.randn(rows, 1, cfg.dim)
        rope = self._rope_lookup(torch.full((rows, 1), context), x.dtype)
        b = dispatch.bucket(rows)
        plans = [blk.fuse_plan for blk in self.layers]

        def fused() -> torch.Tensor:
            return self._stack.run(x, list(range(L)), [rows] * L, [kpool] * L, [vpool] * L, [slots] * L, *rope)

        def unfused() -> torch.Tensor:
            h = x
            for blk in self.layers:
                h = blk.decode(h, rope, kpool, vpool, slots, b)
            return h

        try:
            for blk in self.layers:
                blk.fuse_plan = tuple(False for _ in blk.fuse_plan)
            t_fused, t_unfused = dispatch._median_times([fused, unfused], 3)
        finally:
            for blk, p in zip(self.layers, plans):
                blk.fuse_plan = p
        return t_fused, t_unfused

    def _weights_on_huge_pages(self) -> None:
        """Move the compiled kernels' panels and scales, in the order a step reads them, into one
        arena on 2 MB pages (``kernels.huge_page_arena``): the same bytes, fewer TLB misses."""
        linears = [getattr(b, n) for b in self.layers for n in BLOCK_LINEARS]
        linears += [m for m in (self.lm_head, self.draft_head) if m is not None]
        shared = {id(m) for m in linears if isinstance(m, PackedLinear) and m.approx is not None
                  and m.approx is m.packed}  # a two-limb int8 head is its own pass's panels: one copy
        slots = [(m, a) for m in linears if isinstance(m, PackedLinear) for a in ("packed", "panel_scales", "approx")
                 if getattr(m, a) is not None and not (a == "approx" and id(m) in shared)]
        for (m, a), t in zip(slots, kernels.huge_page_arena([getattr(m, a) for m, a in slots])):
            setattr(m, a, t)
        for m in linears:
            if id(m) in shared:
                m.approx = m.packed

    def build_layer_stack(self) -> None:
        """Gather the fused layers' fixed arguments into one ``kernels.LayerStack`` (from the
        layers' own kernels, which must be one module), so that a decode step whose rows all run
        the same layers is one kernel call: per layer, a separate call costs its Python and its
        arguments' conversion again each step. Called by ``pack_for_inference``; call it again
        after giving the layers other kernels or weights."""
        self._stack = self._stack_kernels = None
        self._stack_plan, self._stack_layers = (), ()
        k = self.layers[0].kernels if len(self.layers) else None
        if k is None or not hasattr(k, "LayerStack") or not all(b.fused_decode and b.kernels is k for b in self.layers):
            return
        stack = k.LayerStack()
        for b in self.layers:
            weights, heads, scales = b._fused_args
            stack.add(*weights, *heads, *scales)
        self._stack, self._stack_kernels, self._stack_layers = stack, k, tuple(self.layers)
        self._stack_plan = tuple(all(p) for p in zip(*(b.fuse_plan for b in self.layers)))

    def set_draft_vocab(self, n: int) -> None:
        """Score lossless drafts over the first ``n`` token ids only (all of them when ``n`` >= the vocabulary)."""
        V = self.cfg.vocab_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"draft_vocab must be an integer >= 1, got {n!r}")
        self.draft_vocab = min(n, V)
        self.draft_head = None
        if isinstance(self.lm_head, nn.Linear):  # before packing drops the dense weight
            self._head_rows = self.lm_head.weight.detach()
        if self.draft_vocab < V:
            w = self._head_rows
            self.draft_head = nn.Linear(w.shape[1], self.draft_vocab, bias=False, dtype=w.dtype)
            self.draft_head.weight = nn.Parameter(w[:self.draft_vocab].clone(), requires_grad=False)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy pick per row of ``(B, vocab)`` logits, exactly ``logits.argmax(-1)``."""
        if self.kernels is not None and logits.dtype == torch.float32:
            return self.kernels.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # (B, T, 1, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _rope_lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rope``'s tables by lookup, for a decode step: rows of a table ``_rope`` computed for
        positions 0..n-1 (grown by doubling, rebuilt if ``inv_freq`` changes), so a step indexes
        two tensors instead of running six ops. The same values (tests/test_parity_transformers.py)."""
        n = int(positions.max()) + 1
        t = self._rope_tables.get(dtype)
        if t is None or t[0] is not self.inv_freq or t[1] != self.inv_freq._version or t[2].shape[0] < n:
            size = max(1024, 1 << (n - 1).bit_length())
            cos, sin = self._rope(torch.arange(size, device=self.inv_freq.device)[None], dtype)
            t = self._rope_tables[dtype] = (self.inv_freq, self.inv_freq._version, cos[0], sin[0])
        return t[2][positions], t[3][positions]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        active_len: Sequence[int] | None = None,
        *,
        cache=None,
        start: int = 0,
        key_valid: torch.Tensor | None = None,
        last_only: bool = False,
        logits_from: int = 0,
    ) -> torch.Tensor:
        """The skipping forward pass; returns logits ``(B, T or 1, vocab)``.

        tokens, positions: ``(B, T)``; positions are per row (left padding in training).
        active_len: per layer, how many leading positions run it (None = all).
        cache/start: write keys/values at slots ``start..start+T``.
        key_valid: ``(B, start+T)`` bool, False for padding slots.
        last_only / logits_from: compute logits for the last column only, or
        from column ``logits_from`` on (training needs none for the prompt).
        """
        B, T = tokens.shape
        x, rope = self.embed(tokens, positions)
        mask = attention_mask(T, start, key_valid, x.device)
        for layer, block in enumerate(self.layers):
            n = T if active_len is None else active_len[layer]
            if n == T:
                x = block(x, rope, mask, cache, layer, start)
            elif n > 0:
                r = None if rope is None else (rope[0][:, :n], rope[1][:, :n])
                m = None if mask is None else mask[:, :, :n, : start + n]
                x = torch.cat([block(x[:, :n], r, m, cache, layer, start), x[:, n:]], dim=1)
        if last_only:
            x = x[:, -1:]
        elif logits_from:
            x = x[:, logits_from:]
        return self.head(x)

    def prefill(self, chunks: Sequence[PrefillChunk]) -> torch.Tensor:
        """Prompt chunks of several requests at full depth in one pass, packed
        into one row so every linear layer runs one GEMM over all their tokens
        (a chunk of a few dozen tokens alone leaves most of the GEMM's speed
        unused); returns the logits ``(chunks, vocab)`` of each chunk's last token."""
        tokens = torch.tensor([[t for c in chunks for t in c.tokens]])
        positions = torch.cat([torch.arange(c.start, c.start + len(c.tokens)) for c in chunks])[None]
        x, rope = self.embed(tokens, positions)
        for layer, block in enumerate(self.layers):
            x = block._residual(x, lambda h: block.attention_chunks(h, rope, chunks, layer))
        last = torch.tensor(list(itertools.accumulate(len(c.tokens) for c in chunks))) - 1
        return self.head(x[:, last])[0]

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, layer_rows: Sequence["LayerRows | None"],
               pools: Sequence[tuple[torch.Tensor, torch.Tensor]],
               drafts: Sequence[torch.Tensor | None] | None = None) -> torch.Tensor:
        """One decode position for each of ``R`` rows; returns logits ``(R, vocab)``.

        tokens, positions: ``(R,)``, each row at its own position.
        layer_rows[l]: which rows run layer ``l`` and their slots in its pool
        ``pools[l] = (keys, values)``, each ``(K, pool_slots, hd)``; None when
        no row runs it. Rows that skip a layer carry their hidden state.
        drafts[r]: for a lossless request's draft, the extra token ids it scores
        (``draft_logits``); None for a row that needs every logit.
        """
        x, rope = self.embed(tokens[:, None], positions[:, None], lookup=True)  # (R, 1, dim)
        runs = [l for l, lr in enumerate(layer_rows) if lr is not None]
        layers = list(self.layers)  # one pass over the ModuleList, not an indexed lookup per layer
        every = dispatch.bucket(x.shape[0])  # the kernel forms of a layer that runs every row
        counts = self._stack_counts(layers, layer_rows, runs, x.shape[0])
        if counts is not None:  # each layer on all rows or a leading block of them: one kernel call
            x = self._stack.run(x, runs, counts, [pools[l][0] for l in runs], [pools[l][1] for l in runs],
                                [layer_rows[l].slots for l in runs], rope[0], rope[1])
            runs = []
        for l in runs:
            lr = layer_rows[l]
            block = layers[l]
            if lr.rows is None:  # every row
                x = block.decode(x, rope, *pools[l], lr.slots, every)
            elif isinstance(lr.rows, int):  # a leading block of rows (rows ordered by budget)
                n = lr.rows
                r = None if rope is None else (rope[0][:n], rope[1][:n])
                x = torch.cat([block.decode(x[:n], r, *pools[l], lr.slots), x[n:]])
            else:  # any subset
                idx = lr.rows
                r = None if rope is None else (rope[0].index_select(0, idx), rope[1].index_select(0, idx))
                x = x.index_copy(0, idx, block.decode(x.index_select(0, idx), r, *pools[l], lr.slots))
        rows = [r for r, d in enumerate(drafts or ()) if d is not None]
        if not rows or self.draft_head is None:
            return self.head(x)[:, 0]
        h = self.final_hidden(x)
        full = [r for r in range(x.shape[0]) if drafts[r] is None]
        out = torch.empty(x.shape[0], self.cfg.vocab_size)
        if full:
            out[full] = self.lm_head(h[full]).float()[:, 0]
        out[rows] = self.draft_logits(h[rows], [drafts[r] for r in rows])
        return out

    def _stack_counts(self, layers: list, layer_rows: Sequence["LayerRows | None"], runs: list[int],
                      R: int) -> list[int] | None:
        """Each run layer's row count when the step runs as one ``LayerStack`` call, else None: the
        stack exists and its layers are these, each run layer runs all ``R`` rows or a leading
        block of them, fuses at that row count and still has the kernels the stack was built
        from (a layer given other kernels, or unfused, runs on its own, as does a step with a
        layer on any other subset of rows)."""
        if self._stack is None or not runs or len(layers) != len(self._stack_layers):
            return None
        k, built, plan = self._stack_kernels, self._stack_layers, self._stack_plan
        counts = []
        for l in runs:
            n = layer_rows[l].rows
            n = R if n is None else n
            if (not isinstance(n, int) or layers[l] is not built[l] or not layers[l].fused_decode
                    or layers[l].kernels is not k):
                return None
            counts.append(n)
        if not all(plan[dispatch.bucket(n)] for n in set(counts)):
            return None
        return counts

    def native_greedy(self, rows: int) -> bool:
        """Whether ``greedy_steps`` can run ``rows`` rows: a Llama-family model whose layers are
        one ``LayerStack`` fused at that row count, with the final norm and LM head on the same
        compiled kernels, so the native loop makes the calls a Python step makes."""
        head, norm, k, L = self.lm_head, self.norm, self._stack_kernels, len(self.layers)
        every = [LayerRows(None, None)] * L  # every layer on every row: what _stack_counts fuses
        return (self._stack_counts(list(self.layers), every, list(range(L)), rows) is not None
                and hasattr(self._stack, "greedy") and self.cfg.pos == "rope"
                and self.project_in is None and self.project_out is None and self.pos_emb is None
                and self.tok_emb.weight.dtype == torch.float32
                and isinstance(norm, RMSNorm) and norm.kernels is k and norm.weight.dtype == torch.float32
                and isinstance(head, PackedLinear) and head.kernels is k
                and (head.uses_hand(rows) or self._greedy_head_picks(rows)))

    def _greedy_head_picks(self, rows: int) -> bool:
        """Whether greedy steps of ``rows`` rows take the head's picks from its copy's pass
        (``kernels.greedy_head``) though its full product runs on oneDNN there: where
        ``dispatch.greedy_head_plan`` measured the pass no slower than oneDNN's product."""
        head = self.lm_head
        return (self.greedy_approx and head.approx is not None and head.packed is not None
                and hasattr(head.kernels, "greedy_head") and head.greedy_plan[dispatch.bucket(rows)])

    def greedy_head_approx(self, rows: int) -> dict:
        """The head's pass a greedy step of ``rows`` rows picks from (``greedy_steps``' keyword
        arguments; empty: the full head). An fp32 head picks from its int8 (or bf16) copy and the
        few exact logits that leaves in doubt (the same picks, a quarter (a half) of the head's
        bytes), an int8 head from its int8-activation pass where its greedy_plan has it (the same
        picks, fewer instructions); kernels without those functions take the full head."""
        head, k = self.lm_head, self._stack_kernels
        if not (self.greedy_approx and getattr(head, "approx", None) is not None
                and head.greedy_plan[dispatch.bucket(rows)]):
            return {}
        if head.packed.dtype == torch.int8 and hasattr(k, "greedy_head_int8"):
            return {"head_approx": head.approx, "head_bound": head.approx_bound}
        if head.packed.dtype == torch.float32 and hasattr(k, "greedy_head"):
            approx = {"head_approx": head.approx, "head_bound": head.approx_bound, "head_rows": self._head_rows}
            if head.approx_scale is not None:  # the int8 copy
                approx["head_approx_scale"] = head.approx_scale
            return approx
        return {}

    @torch.inference_mode()
    def greedy_steps(self, tokens: Sequence[int], positions: Sequence[int], step_layers: Sequence[Sequence[int]],
                     pools: Sequence[tuple[torch.Tensor, torch.Tensor]], starts: torch.Tensor,
                     eos: Sequence[int] = ()) -> list[list[int]]:
        """Greedy decode steps in one native call (``native_greedy`` must hold): step ``s`` feeds
        each row its token at its position (the previous step's pick at the next position after
        the first), running the layers ``step_layers[s]`` on every row with row ``r``'s keys and
        values at ``pools[l]`` slots ``starts[l, r]`` on. The tokens ``decode`` and ``argmax``
        would pick, per step and row; it stops after a step in which a row picked one of ``eos``."""
        pos = torch.tensor(list(positions), dtype=torch.long)
        self._rope_lookup(pos + len(step_layers), torch.float32)  # grows the tables to the last position
        cos, sin = self._rope_tables[torch.float32][2:]
        head = self.lm_head
        approx = self.greedy_head_approx(len(tokens))
        out = self._stack.greedy(torch.tensor(list(tokens), dtype=torch.long), pos, [list(l) for l in step_layers],
                                 [p[0] for p in pools], [p[1] for p in pools], starts, self.tok_emb.weight.detach(),
                                 cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1),
                                 self.norm.weight.detach(), self.norm.eps, head.packed, head.bias,
                                 head.out_features, head.panel_scales, head.a8, list(eos), **approx)
        return out.tolist()

    def draft_logits(self, h: torch.Tensor, extra: Sequence[torch.Tensor]) -> torch.Tensor:
        """Logits ``(R, vocab)`` of lossless drafts from final hidden states ``(R, 1, dim)``:
        only the first ``draft_vocab`` token ids (BPE ids follow merge order, so
        roughly frequency) and each row's ``extra`` ids (its prompt's rarer
        tokens, e.g. a name to copy) are scored; every other logit is -inf.

        The LM head is a large share of a skipped pass (SmolLM2: 28M of the 63M
        weights a 3x draft reads), so a smaller draft head makes drafts cheaper.
        Verification still scores every token at full depth, so output is unchanged.
        """
        out = torch.full((h.shape[0], self.cfg.vocab_size), float("-inf"))
        out[:, :self.draft_vocab] = self.draft_head(h).float()[:, 0]
        for r, ids in enumerate(extra):
            if ids.numel():
                out[r, ids] = (self._head_rows[ids].to(h.dtype) @ h[r, 0]).float()
        return out

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor, lookup: bool = False
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Input hidden states ``(B, T, dim)`` and the RoPE tables (None for learned positions);
        ``lookup``: the tables from ``_rope_lookup`` (a decode step's few positions)."""
        x = self.tok_emb(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions + self.cfg.pos_offset)
        if self.cfg.pos != "rope":
            return x, None
        return x, (self._rope_lookup if lookup else self._rope)(positions, x.dtype)

    def final_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection (OPT): what the LM head reads."""
        if self.norm is not None:
            x = self.norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, output projection (OPT) and LM head: the layers that always run."""
        return self.lm_head(self.final_hidden(x)).float()  # bf16 activations: sampling and argmax see fp32 logits


def attention_mask(T: int, start: int, key_valid: torch.Tensor | None, device) -> torch.Tensor | None:
    """Boolean ``(B or 1, 1, T, start+T)`` mask: causal, padding keys hidden.

    A padding query still sees itself, so no softmax row is empty (its output
    is never used). A single unpadded decode step needs no mask at all.
    """
    S = start + T
    if T == 1 and key_valid is None:
        return None
    q_slot = torch.arange(start, S, device=device)[:, None]
    k_slot = torch.arange(S, device=device)[None, :]
    m = (k_slot <= q_slot)[None]  # (1, T, S)
    if key_valid is not None:
        m = (m & key_valid[:, None, :S]) | (k_slot == q_slot)[None]
    return m[:, None]
