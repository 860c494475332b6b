"""``skipdecode bench --llamacpp``: decode speed against llama.cpp, the engine people run small
models on a CPU with, in one run on this machine.

llama.cpp lives in its own virtualenv (``make llamacpp-venv``: built from the llama-cpp-python
sdist with this machine's native ISA) and runs in its own process (``llamacpp_offline.py``).
Its GGUFs are made from the same Hugging Face directory skipdecode decodes, with llama.cpp's own
converter (F32) and quantizer (Q8_0, Q4_0). Both engines get the same prompt token ids, the same
thread count, greedy decoding and a fixed number of new tokens (EOS ignored); decode time is
the ``N - 1`` steps after the one that prefills every prompt and samples its first token, timed
directly in each engine (so prefill noise, which at batch 32 is several decode steps, stays out),
best of interleaved rounds (each round times every skipdecode row, then runs llama.cpp once per
GGUF).

The machine's read bandwidth is measured in every round: the fastest of a torch sum and max and
the kernels' own streaming read (``kernels.stream_read_gbs``, lines asked for 0-4 KB ahead) over
1 GiB on 2 MB pages (as the packed weights are) with the bench's threads; the best is kept,
and every batch-1 full-depth step is reported as a fraction of it: bytes of weights one step
reads (every linear and the LM head; the KV cache of a ~100-token context adds under 1%) over
the step's time. Likewise the machine's fp32 multiply-add rate (``kernels.fma_peak_gflops``),
the roof of a step with many rows when its dot products are fp32 FMAs: every full-depth step is
reported as the FLOPs of its weights (2 x multiply-adds x rows) over its time, and for those
engines (FP32_FMA) as a fraction of that rate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from ..checkpoint import cache_dir, hf_architecture
from ..config import WEIGHT_DTYPES
from ..errors import SkipDecodeError
from ..generate import generate_tokens
from ..llm import LLM
from ..model import BLOCK_LINEARS
from .decode import ENGINE_NAMES, PROMPTS, _best_time, _Ours, llc_text, machine_info, round_median, write_report

# skipdecode dtype -> the llama.cpp type of the same size class it is compared with (Q8_0 and Q4_0
# also quantize activations to 8 bits in blocks of 32 for their dot products, as w8a8 and w4a8 do;
# w8a16 and w4a16 keep 15 bits)
PEER_TYPE = {"float32": "f32", "int8": "q8_0", "w8a8": "q8_0", "w8a16": "q8_0",
             "int4": "q4_0", "w4a8": "q4_0", "w4a16": "q4_0"}
# The dtypes that match their peer in activations too: llama.cpp's CPU dot products take Q8_0
# activations for Q8_0 and Q4_0 weights (ggml-cpu's vec_dot_type) and fp32 ones for F32.
SAME_ACTIVATIONS = ("float32", "w8a8", "w4a8")
# The dtypes whose dot products are fp32 multiply-adds (each weight widened to fp32, fp32
# activations): the fp32 FMA rate is their roof; the integer dot products of w8a8, w4a8, w8a16,
# w4a16, Q8_0 and Q4_0 have other roofs. FP32_FMA: the engines that run them here.
FP32_FMA_DTYPES = ("float32", "bfloat16", "int8", "int4")
FP32_FMA = frozenset(ENGINE_NAMES[d] for d in FP32_FMA_DTYPES) | {"llama.cpp-f32"}
LLAMACPP_VENV = ".venv-llamacpp"
GGUF_CACHE = "llamacpp"  # the GGUFs this bench makes live in $SKIPDECODE_CACHE/llamacpp/<model>


class LlamaCppMissing(SkipDecodeError):
    """The llama.cpp virtualenv is not built."""


# build folder -> the make target that makes it; build-noamx: native AVX-512 without llama.cpp's AMX
# path, which died with SIGILL on a virtual machine whose CPU reports AMX
BUILDS = {"build": "llamacpp-venv", "build-avx2": "llamacpp-avx2", "build-noamx": "llamacpp-noamx"}


def auto_build() -> str:
    """The build ``--llamacpp`` times by default: ``build-noamx`` on a CPU that reports AMX (the
    native build's AMX path died there), else the native ``build``."""
    from ..dispatch import cpu_features

    return "build-noamx" if "amx_tile" in cpu_features()["isa"] else "build"


def llamacpp_paths(venv: str | os.PathLike = LLAMACPP_VENV, build: str = "build") -> dict[str, Path]:
    """The pieces ``make llamacpp-venv`` builds, or a clear error naming the make target.
    ``build``: ``build`` (the machine's native ISA), ``build-avx2`` (AVX2/FMA only, ``make
    llamacpp-avx2``: what llama.cpp runs on a CPU without AVX-512), ``build-noamx`` (``make
    llamacpp-noamx``) or ``auto`` (``auto_build``)."""
    if build == "auto":
        build = auto_build()
    if build not in BUILDS:
        raise SkipDecodeError(f"unknown llama.cpp build {build!r}: one of {', '.join(BUILDS)}")
    v = Path(venv).resolve()
    b = v / build / "bin"
    paths = {"python": v / "bin" / "python", "lib": b, "src": v / "src" / "vendor" / "llama.cpp",
             "quantize": b / "llama-quantize", "server": b / "llama-server"}
    missing = [str(p) for k, p in paths.items() if not p.exists()]
    if missing or not (v / ".installed").is_file():
        targets = "`make llamacpp-venv`" + (f" then `make {BUILDS[build]}`" if build != "build" else "")
        raise LlamaCppMissing(f"llama.cpp is not built in {v} (missing: {', '.join(missing) or '.installed'}); "
                              f"run {targets} (about 12 minutes each on 2 cores)")
    return paths


def _staged_hf_dir(model_dir: Path, tmp: Path) -> Path:
    """``model_dir`` with ``architectures`` in its config.json (links to every other file)."""
    tmp.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "config.json":
            (tmp / f.name).unlink(missing_ok=True)
            (tmp / f.name).symlink_to(f.resolve())
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["architectures"] = [hf_architecture(cfg)]
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return tmp


def make_ggufs(model_dir: Path, types: list[str], venv: str | os.PathLike = LLAMACPP_VENV,
               cache: Path | None = None) -> dict[str, Path]:
    """GGUFs of ``model_dir`` in each llama.cpp type, made once with llama.cpp's own converter and
    quantizer and cached beside the model's other conversions."""
    p = llamacpp_paths(venv)
    out = Path(cache or cache_dir()) / GGUF_CACHE / Path(model_dir).resolve().name
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "f32.gguf"
    if not f32.is_file():
        staged = _staged_hf_dir(Path(model_dir), out / "hf")
        tmp = out / "f32.gguf.tmp"
        env = dict(os.environ, PYTHONPATH=str(p["src"] / "gguf-py"), HF_HUB_OFFLINE="1")
        r = subprocess.run([str(p["python"]), str(p["src"] / "convert_hf_to_gguf.py"), str(staged), "--outtype", "f32",
                            "--outfile", str(tmp)], capture_output=True, text=True, env=env)
        if r.returncode != 0:
            raise SkipDecodeError(f"llama.cpp's converter failed on {model_dir}: {r.stderr.strip()[-800:]}")
        os.replace(tmp, f32)
    got = {"f32": f32}
    for t in types:
        if t == "f32":
            continue
        dst = out / f"{t}.gguf"
        if not dst.is_file():
            tmp = out / f"{t}.gguf.tmp"
            r = subprocess.run([str(p["quantize"]), str(f32), str(tmp), t.upper()], capture_output=True, text=True,
                               env=dict(os.environ, LD_LIBRARY_PATH=str(p["lib"])))
            if r.returncode != 0:
                raise SkipDecodeError(f"llama-quantize {t.upper()} failed: {r.stderr.strip()[-800:]}")
            os.replace(tmp, dst)
        got[t] = dst
    return got


def gguf_step_bytes(path: Path) -> int:
    """Bytes of the tensors one batch-1 decode step reads: every tensor, but the token embedding only
    when it is also the output head (tied); otherwise one row of it, which is negligible."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    return sum(int(t.n_bytes) for t in r.tensors if not (t.name == "token_embd.weight" and "output.weight" in names))


def step_linears(llm: LLM) -> list:
    """The linears one full-depth decode position runs: every block's, then the LM head."""
    net = llm.model
    return [getattr(blk, n) for blk in net.layers for n in BLOCK_LINEARS] + [net.lm_head]


def step_bytes(llm: LLM) -> int:
    """Bytes of weights one batch-1 decode step of ``llm`` reads at full depth: every block linear and
    the LM head, in their stored dtype (int8: plus one bf16 scale per output channel; int4: half a
    byte per weight plus one bf16 scale per output channel and 32 inputs). A greedy step reads an
    fp32 head's int8 or bf16 copy instead (``kernels.greedy_head``; the exact rows of the few ids it
    leaves in doubt, a few KB, are left out)."""
    return sum(linear_bytes(m, llm.model.greedy_approx) for m in step_linears(llm))


def linear_bytes(m, greedy_approx: bool = False) -> int:
    """Bytes of weights a batch-1 step reads from one linear (``step_bytes``'s rule; with
    ``greedy_approx``, an fp32 head with an int8 or bf16 copy reads the copy)."""
    w, n, k = getattr(m, "weights", "float32"), m.out_features, m.in_features
    if getattr(m, "approx", None) is not None and greedy_approx and w == "float32":
        if m.approx.dtype == torch.bfloat16:
            w = "bfloat16"
        else:  # the int8 copy and its fp32 row scales
            return n * k + 4 * n
    # (an int8 head's copy for int8 activations is the same bytes as the head)
    return {"float32": 4 * n * k, "bfloat16": 2 * n * k, "int8": n * k + 2 * n,
            "int4": n * k // 2 + 2 * n * (k // 32)}[w]


def step_macs(llm: LLM) -> int:
    """Multiply-adds of the weights in one decode position at full depth: every block linear and
    the LM head (attention over the KV cache, norms and activations are left out)."""
    return sum(m.out_features * m.in_features for m in step_linears(llm))


def read_probe(gib: float = 1.0) -> torch.Tensor:
    """A float32 tensor of ``gib`` GiB, far larger than the caches, on the 2 MB pages the packed
    weights get (``kernels.huge_page_arena``): on 4 KB pages every reader is slower (a TLB miss per
    page, prefetchers stopping at each page), so the probe would understate what a step can read."""
    from .. import kernels

    return kernels.huge_page_arena([torch.ones(int(gib * 2**30) // 4)])[0]


def read_rates_gbs(probe: torch.Tensor, module=None, repeats: int = 3) -> dict[str, float]:
    """GB/s of each reader of ``probe`` with the bench's threads, best of ``repeats``: ``torch``, a
    sum and a max (each streams it once); with the compiled kernels (``module``) also their own
    streaming read at each prefetch distance (``stream-<bytes>``, ``kernels.stream_read_gbs``)."""
    from .. import kernels

    t = min(_best_time(lambda: probe.sum(), repeats), _best_time(lambda: probe.amax(), repeats))
    rates = {"torch": probe.numel() * 4 / t / 1e9}
    if module is not None:
        rates.update({f"stream-{pf}": v for pf, v in kernels.stream_read_gbs(module, probe, repeats).items()})
    return rates


def read_bandwidth_gbs(repeats: int = 5, gib: float = 1.0, probe: torch.Tensor | None = None, module=None) -> float:
    """The machine's read bandwidth with the bench's threads: the fastest reader of ``read_rates_gbs``
    over a tensor far larger than the caches (``probe``, else a new ``read_probe(gib)``)."""
    return max(read_rates_gbs(probe if probe is not None else read_probe(gib), module, repeats).values())


def run_llamacpp(paths: dict[str, Path], gguf: Path, ids: list[list[int]], batch_sizes: list[int], new_tokens: int,
                 repeats: int, threads: int) -> dict:
    script = Path(__file__).with_name("llamacpp_offline.py")
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(paths["lib"]))
    r = subprocess.run([str(paths["python"]), str(script), str(gguf), str(new_tokens), str(repeats), str(threads),
                        ",".join(map(str, batch_sizes))], input=json.dumps(ids), capture_output=True, text=True,
                       env=env, timeout=3600)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        raise SkipDecodeError(f"llama.cpp failed on {gguf.name} (exit {r.returncode}): {r.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def run_llamacpp_bench(model: str = "default-e2e", quick: bool = False, out_dir: str | os.PathLike = "benchmarks/results",
                       batch_sizes: list[int] | None = None, speedups: list[float] | None = None,
                       new_tokens: int | None = None, repeats: int | None = None, dtypes: list[str] | None = None,
                       venv: str | os.PathLike = LLAMACPP_VENV, build: str = "auto", kv_dtype: str | None = None
                       ) -> dict:
    """Writes ``llamacpp.{json,md}``, or ``llamacpp-avx2.*`` where skipdecode's kernels run their
    AVX2 form (an AVX2-only CPU, or ``SKIPDECODE_ISA=avx2``; pair it with ``build="build-avx2"``
    to time llama.cpp's AVX2 code as well). ``kv_dtype``: skipdecode's KV cache (``LLM.load``;
    default float32); llama.cpp keeps its default cache type (F16), which the report records."""
    build = auto_build() if build == "auto" else build
    paths = llamacpp_paths(venv, build)
    batch_sizes = batch_sizes or ([1, 8] if quick else [1, 8, 32])
    speedups = speedups or [1.0, 2.0, 3.0]
    if 1.0 not in speedups:
        speedups = [1.0] + list(speedups)
    dtypes = dtypes or [d for d in WEIGHT_DTYPES if d in PEER_TYPE]
    types = list(dict.fromkeys(PEER_TYPE[d] for d in dtypes if d in PEER_TYPE))  # GGUFs to make, in order
    N = new_tokens or (16 if quick else 64)
    R = repeats or (1 if quick else 5)
    threads = torch.get_num_threads()
    log = lambda m: print(m, flush=True)  # noqa: E731
    llms = {dt: LLM.load(model, dtype=dt, kv_dtype=kv_dtype) for dt in dtypes}
    base = next(iter(llms.values()))
    L = base.num_layers
    log(f"llama.cpp GGUFs ({', '.join(types)}) from {base.path} ...")
    ggufs = make_ggufs(base.path, types, venv)
    schedules = {sp: base.make_schedule(speedup=sp, expected_new_tokens=N) for sp in speedups}
    encoded = [base.encode(p) for p in PROMPTS]
    ids_all = [encoded[i % len(encoded)] for i in range(max(batch_sizes))]
    probe = read_probe()  # 1 GiB: each reader's rate is measured in every round, the best kept
    from .. import kernels

    k = base.model.kernels
    readers: dict[str, float] = {}
    round_bw: list[float] = []  # each round's fastest reader, for the fractions paired with that round's steps
    fma = 0.0  # GFLOP/s, measured in every round too (not reported without the compiled kernels)
    t_dec: dict[tuple, list[float]] = {}  # (engine, batch, speedup) -> seconds of the N - 1 decode steps, per round
    ours = {B: {dt: _Ours(x, ids_all[:B]) for dt, x in llms.items()} for B in batch_sizes}
    for B in batch_sizes:  # warm-up
        for o in ours[B].values():
            for s in schedules.values():
                o.run(s, 4)
    peer_tokens: dict[str, list[int]] = {}
    version = system_info = peer_kv = None
    from tqdm import tqdm

    for _ in tqdm(range(R), desc="skipdecode bench --llamacpp", unit="round", file=sys.stderr, disable=None,
                  leave=False):
        for B in batch_sizes:
            for dt, o in ours[B].items():
                for sp, s in schedules.items():
                    t_dec.setdefault((ENGINE_NAMES.get(dt, f"skipdecode-{dt}"), B, sp), []).append(
                        o.run(s, N)["decode_seconds"])
        rates = read_rates_gbs(probe, k)
        round_bw.append(max(rates.values()))
        for name, rate in rates.items():
            readers[name] = max(readers.get(name, 0.0), rate)
        if k is not None:
            fma = max(fma, kernels.fma_peak_gflops(k, repeats=3))
        for t, path in ggufs.items():
            got = run_llamacpp(paths, path, ids_all, batch_sizes, N, 1, threads)
            version, system_info, peer_kv = got["version"], got.get("system_info"), got.get("kv_types")
            peer_tokens[t] = got["tokens"]
            for B, tt in got["batches"].items():
                t_dec.setdefault((f"llama.cpp-{t}", int(B), 1.0), []).extend(tt["t_decode"])
    bytes_ours = {ENGINE_NAMES.get(dt, f"skipdecode-{dt}"): step_bytes(x) for dt, x in llms.items()}
    bytes_peer = {f"llama.cpp-{t}": gguf_step_bytes(p) for t, p in ggufs.items()}
    macs = step_macs(base)
    bw = max(readers.values())
    results = []
    for (engine, B, sp), td in t_dec.items():
        dec = min(td)
        ms = dec / (N - 1) * 1000
        r = {"engine": engine, "batch_size": B, "speedup_target": sp,
             "decode_layer_speedup": round(schedules[sp].decode_layer_speedup(N), 4) if engine.startswith("skip")
             else 1.0, "ms_per_step": round(ms, 3), "decode_tokens_per_s": round(B * (N - 1) / dec, 2),
             "ms_per_step_rounds": [round(t / (N - 1) * 1000, 3) for t in td]}  # every round's, in order
        nbytes = (bytes_ours | bytes_peer).get(engine)
        if B == 1 and sp == 1.0 and nbytes:
            r["weight_bytes_per_step"] = nbytes
            r["read_gbs"] = round(nbytes / (ms / 1000) / 1e9, 2)
            r["fraction_of_bandwidth"] = round(r["read_gbs"] / bw, 3)
            paired = round_median([nbytes * (N - 1) / t / 1e9 for t in td], round_bw)
            if paired is not None:  # each round's step over that round's fastest reader
                r["fraction_of_bandwidth_round_median"] = round(paired, 3)
        if sp == 1.0:
            r["weight_gflops"] = round(2 * macs * B / (ms / 1000) / 1e9, 1)
            if fma and engine in FP32_FMA:
                r["fraction_of_fma_peak"] = round(r["weight_gflops"] / fma, 3)
        results.append(r)
    peer_of = {ENGINE_NAMES.get(d, f"skipdecode-{d}"): f"llama.cpp-{t}" for d, t in PEER_TYPE.items()}
    for r in results:
        peer = next((x for x in results if x["engine"] == peer_of.get(r["engine"]) and x["batch_size"] == r["batch_size"]),
                    None)
        if peer:
            r["vs_llamacpp"] = peer["engine"]
            r["tokens_per_s_vs_llamacpp"] = round(r["decode_tokens_per_s"] / peer["decode_tokens_per_s"], 3)
            paired = round_median(t_dec[(peer["engine"], peer["batch_size"], 1.0)],
                                  t_dec[(r["engine"], r["batch_size"], r["speedup_target"])])
            if paired is not None:  # llama.cpp's decode time over ours, each from the same round
                r["tokens_per_s_vs_llamacpp_round_median"] = round(paired, 3)
    results.sort(key=lambda r: (r["batch_size"], r["engine"], r["speedup_target"]))
    ours_tokens = generate_tokens(llms[dtypes[0]].model, [encoded[0]], schedules[1.0], N, eos_token_ids=())[0][0].token_ids
    agree = {}
    for t, toks in peer_tokens.items():
        k = next((i for i, (a, b) in enumerate(zip(toks, ours_tokens)) if a != b), min(len(toks), len(ours_tokens)))
        agree[t] = k
    kernels_isa = kernels.isa() if base.model.kernels is not None else None
    settings = {"model": model, "model_path": str(base.path), "num_layers": L, "new_tokens": N, "repeats": R,
                "kernels_isa": kernels_isa, "a8_form": kernels.a8_form() if kernels_isa else None,
                "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
                "llamacpp_build": build, "llamacpp_system_info": system_info,
                "kv_dtype": kv_dtype or "float32",
                "llamacpp_kv_types": [{0: "F32", 1: "F16"}.get(t, f"ggml type {t}") for t in peer_kv] if peer_kv else None,
                "quick": quick, "threads": threads, "dtypes": dtypes, "llamacpp_types": types, "greedy": True,
                "eos_ignored": True, "prompt_tokens": [len(x) for x in encoded], "llama_cpp_python": version,
                "ggufs": {t: {"file": str(p), "bytes": p.stat().st_size} for t, p in ggufs.items()},
                "read_bandwidth_gbs": round(bw, 2), "read_rates_gbs": {n: round(v, 2) for n, v in readers.items()},
                "read_probe_pages": "2 MB" if read_probe_huge(probe) else "4 KB",
                "fma_peak_gflops": round(fma, 1) if fma else None,
                "weight_macs_per_position": macs,
                "greedy_tokens_agreeing_with_skipdecode": {"reference": dtypes[0], "of": N, **agree},
                "schedules": {str(k): v.to_dict() for k, v in schedules.items()}}
    report = {"machine": machine_info(), "settings": settings, "results": results}
    name = "llamacpp" + ("-avx2" if kernels_isa == "avx2" else "") + ("-quick" if quick else "")
    write_report(out_dir, name, report, render_markdown)
    for r in results:
        log(f"B={r['batch_size']:<3} {r['engine']:<17} {r['speedup_target']:g}x {r['ms_per_step']:8.2f} ms/step "
            f"{r['decode_tokens_per_s']:8.1f} tok/s" + (f"  {r['tokens_per_s_vs_llamacpp']:.2f}x {r['vs_llamacpp']}"
                                                         if "vs_llamacpp" in r else ""))
    return report


def read_probe_huge(probe: torch.Tensor) -> bool:
    """Whether ``probe`` lies in a mapping Linux backs with 2 MB pages (``AnonHugePages`` of its
    entry in /proc/self/smaps); False where that cannot be read."""
    addr = probe.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return False
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) > 0
    return False


def read_text(s: dict) -> str:
    """How the read bandwidth was measured, with every reader's rate (older reports: torch's only)."""
    rates = s.get("read_rates_gbs")
    if not rates:
        return f"torch sum and max over 1 GiB, {s['threads']} threads, best of every round"
    stream = {int(n.split("-")[1]): v for n, v in rates.items() if n.startswith("stream-")}
    text = (f"the fastest reader of a 1 GiB tensor on {s.get('read_probe_pages', '4 KB')} pages, {s['threads']} "
            f"threads, best of every round: torch sum and max {rates['torch']:.1f} GB/s")
    if stream:
        text += ("; the kernels' streaming read with lines asked for "
                 + " / ".join(f"{pf}" for pf in stream) + " bytes ahead "
                 + " / ".join(f"{v:.1f}" for v in stream.values()) + " GB/s")
    return text


def render_markdown(report: dict) -> str:
    m, s = report["machine"], report["settings"]
    feats = m.get("cpu_features", {})
    agree = {k: v for k, v in s["greedy_tokens_agreeing_with_skipdecode"].items() if k not in ("reference", "of")}
    build = s.get("llamacpp_build", "build")
    avx2 = s.get("kernels_isa") == "avx2"
    command = ("make bench-llamacpp-avx2" if avx2 and build == "build-avx2" else
               f"skipdecode bench --llamacpp{' --quick' if s['quick'] else ''}"
               + (f" --llamacpp-build {build}" if build != "build" else "")
               + (f" --kv-dtype {s['kv_dtype']}" if s.get("kv_dtype", "float32") != "float32" else ""))
    llama_isa = {"build-avx2": "with AVX2/FMA only (`make llamacpp-avx2`)",
                 "build-noamx": "with AVX-512 but without its AMX path (`make llamacpp-noamx`)"}.get(
        build, "with its native ISA (`make llamacpp-venv`)")
    lines = [
        "# Decode speed: skipdecode against llama.cpp" + (", AVX2 forms" if avx2 else ""),
        "",
        f"Produced by `{command}` on {m['date']}.",
        "",
        f"- Machine: {m['cpu']}, {m['cores']} cores{llc_text(m)}, {s['threads']} threads for both engines, "
        f"{m['platform']}",
        f"- ISA: {', '.join(feats.get('isa', [])) or 'unknown'} (oneDNN bf16 {'yes' if feats.get('onednn_bf16') else 'no'});"
        f" skipdecode's kernels in their {s.get('kernels_isa') or 'no'} form"
        + (f" (int8 activations: {s['a8_form']})" if s.get("a8_form") else "")
        + (f", oneDNN capped at {s['onednn_max_cpu_isa']}" if s.get("onednn_max_cpu_isa") else "")
        + f"; llama.cpp built here {llama_isa}"
        + (f"; llama.cpp reports `{s['llamacpp_system_info']}`" if s.get("llamacpp_system_info") else ""),
        f"- Versions: torch {m['torch']}, skipdecode {m['skipdecode']}, llama-cpp-python {s['llama_cpp_python']}",
        f"- Model: `{s['model']}` ({s['num_layers']} layers); GGUFs made from the same Hugging Face directory by "
        "llama.cpp's converter (F32) and `llama-quantize` (Q8_0, Q4_0, llama.cpp's default tensor choices): "
        + ", ".join(f"{t} {g['bytes'] / 1e6:.0f} MB" for t, g in s["ggufs"].items()),
        f"- Greedy, {s['new_tokens']} new tokens (EOS ignored), row i of a batch gets E2E prompt i mod "
        f"{len(s['prompt_tokens'])} ({s['prompt_tokens']} tokens with the chat template); llama.cpp decodes "
        "the batch as one `llama_batch` per step, one sequence id per row",
        f"- KV cache: skipdecode {s.get('kv_dtype', 'float32')}"
        + (f", llama.cpp {' / '.join(s['llamacpp_kv_types'])} (keys / values, its default)"
           if s.get("llamacpp_kv_types") else ""),
        f"- Decode time: the N-1 steps after prefill and the first token, timed directly in each engine, best of "
        f"{s['repeats']} interleaved rounds.",
        f"- Greedy tokens of prompt 0 at batch 1 equal to skipdecode {s['greedy_tokens_agreeing_with_skipdecode']['reference']}"
        f" 1x before the first difference (of {s['greedy_tokens_agreeing_with_skipdecode']['of']}): "
        + ", ".join(f"{k} {v}" for k, v in agree.items()),
        f"- Read bandwidth measured here: {s['read_bandwidth_gbs']:.1f} GB/s: {read_text(s)}; batch-1 full-depth "
        "rows give the weight bytes a step reads over its time (a fraction above 100% means the engine streams "
        "weights faster than those readers do, as it can where the last-level cache holds some of them).",
        "- Paired (where given): the same ratio within each round, this engine's decode against llama.cpp's or "
        "against the round's fastest reader, the median of the rounds. The bests above can come from different "
        "spells of a shared host for each side of a ratio; a slow spell that spans a round hits both sides of "
        "its paired ratio.",
    ]
    if s.get("fma_peak_gflops"):
        lines.append(
            f"- fp32 multiply-add rate measured here: {s['fma_peak_gflops']:.0f} GFLOP/s (12 FMA chains a thread in "
            f"registers, the kernels' {s.get('kernels_isa')} form, {s['threads']} threads, best of every round); "
            f"full-depth rows give the FLOPs of their weights (2 x {s['weight_macs_per_position'] / 1e6:.0f}M "
            "multiply-adds x rows a step) over the step's time, and that as a fraction of the rate for the engines "
            "whose dot products are fp32 FMAs (float32, bfloat16, int8 and int4 widen each weight to fp32; "
            "llama.cpp F32); the integer dot products of w8a8, w4a8, w8a16, w4a16, Q8_0 and Q4_0 have other roofs.")
    lines += [
        "",
        "| batch | engine | target | decode-layer speedup | ms/step | decode tok/s | vs llama.cpp (same size class) "
        "| weight MB/step | GB/s read | of bandwidth | weight GFLOP/s | of FMA peak |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        vs = f"{r['tokens_per_s_vs_llamacpp']:.2f}x {r['vs_llamacpp']}" if "vs_llamacpp" in r else ""
        if "tokens_per_s_vs_llamacpp_round_median" in r:
            vs += f" (paired {r['tokens_per_s_vs_llamacpp_round_median']:.2f}x)"
        bw = (f"{r['weight_bytes_per_step'] / 1e6:.0f} | {r['read_gbs']:.1f} | {100 * r['fraction_of_bandwidth']:.0f}%"
              if "read_gbs" in r else " | | ")
        if "fraction_of_bandwidth_round_median" in r:
            bw += f" (paired {100 * r['fraction_of_bandwidth_round_median']:.0f}%)"
        fl = (f"{r['weight_gflops']:.0f} | " if "weight_gflops" in r else " | ") + (
            f"{100 * r['fraction_of_fma_peak']:.0f}%" if "fraction_of_fma_peak" in r else "")
        lines.append(f"| {r['batch_size']} | {r['engine']} | {r['speedup_target']:g}x | {r['decode_layer_speedup']:.2f} "
                     f"| {r['ms_per_step']:.2f} | {r['decode_tokens_per_s']:.1f} | {vs} | {bw} | {fl} |")
    lines += same_precision_lines(report["results"])
    lines += ["", "Schedules (solved for the new-token count above):", ""]
    for sp, d in s["schedules"].items():
        lines.append(f"- {float(sp):g}x: budget {d['max_exit_layer']} -> {d['min_exit_layer']} over "
                     f"{d['horizon']} positions, {d['warmup_layers']} warm-up layer(s), mode {d['mode']}")
    return "\n".join(lines) + "\n"


def same_precision_lines(results: list[dict]) -> list[str]:
    """The full-depth rows against the llama.cpp type of the same weight *and* activation precision
    (SAME_ACTIVATIONS), one line per batch size: int8 / int4 keep fp32 activations where Q8_0 and
    Q4_0 round theirs to 8 bits, so only w8a8 / w4a8 compute what those do."""
    engines = {ENGINE_NAMES[d]: d for d in SAME_ACTIVATIONS}
    rows = [r for r in results if r["engine"] in engines and r["speedup_target"] == 1 and "vs_llamacpp" in r]
    if not rows:
        return []
    dts = [d for d in SAME_ACTIVATIONS if any(engines[r["engine"]] == d for r in rows)]
    out = ["", "Full depth at the same weight and activation precision (llama.cpp's Q8_0 and Q4_0 dot products "
           "round activations to 8 bits in blocks of 32, as w8a8 and w4a8 do; F32 and float32 keep fp32; "
           "int8 and int4 keep fp32 activations, w8a16 and w4a16 15 bits), skipdecode's decode tok/s over llama.cpp's:",
           "", "| batch | " + " | ".join(f"{d} / {PEER_TYPE[d]}" for d in dts) + " |",
           "|---|" + "---|" * len(dts)]
    for b in sorted({r["batch_size"] for r in rows}):
        cell = {engines[r["engine"]]: r["tokens_per_s_vs_llamacpp"] for r in rows if r["batch_size"] == b}
        out.append(f"| {b} | " + " | ".join(f"{cell[d]:.2f}x" if d in cell else "" for d in dts) + " |")
    return out
