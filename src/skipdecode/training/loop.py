"""Skip-aware fine-tuning: teacher forcing through the same skipping forward pass as generation.

SkipDecode only works on adapted models (SKIPDECODE.md, "Training"): the model
must learn to predict from a state that skipped its lower layers. So training
runs exactly what generation runs.

Alignment (the off-by-one, worked out once). At generation, the last prompt
token runs at full depth and predicts target token 0; target token ``i``, fed
back as input, runs the layers of ``b(i)`` and predicts token ``i + 1``. In
training, a row with prompt ``p`` (length P) and target ``t`` (length n) is laid
out as::

    column      T0-P .. T0-1        T0    T0+1  ...  T0+n-2
    input       p_0  .. p_{P-1}     t_0   t_1   ...  t_{n-2}
    label       -    .. t_0         t_1   t_2   ...  t_{n-1}
    layers      full depth          b(0)  b(1)  ...  b(n-2)

Prompts are LEFT-padded so every row's last prompt token sits at column
``T0 - 1`` and input column ``T0 + j`` always holds target token ``j``; targets
are right-padded. Budgets never increase, so the positions that run layer
``l`` are all prompt columns plus a prefix of target columns::

    active_len[l] = T0 + #{j < n_max - 1 : l in layers(b(j))}

and ``Transformer.forward(tokens, positions, active_len, key_valid=...)``
computes each layer on that prefix only: training pays the same saving as
inference. The loss is the cross-entropy on target tokens, averaged over every
target token of the global batch (all ranks, all micro-batches).

One checkpoint for many speedups: with ``speedups=[1, 2, 3]`` the schedule of
each optimizer step is drawn (seeded by ``seed`` and the step) from that set.

Fault tolerance: every ``save_every`` steps the model, optimizer, LR scheduler
and RNG states go into ``checkpoints/step-NNNNNN`` (written aside, renamed into
place). The data order and schedule draws are pure functions of
``(seed, step)``, so ``resume=True`` continues where the last checkpoint left
off and reaches the same weights as an uninterrupted run.

Distributed: under ``torchrun`` (``WORLD_SIZE > 1``) a gloo process group is
created, the model is wrapped in DDP and each rank takes its contiguous share
of the global batch. The per-rank loss is divided by the *global* number of
target tokens and scaled by the world size (DDP averages gradients), so the
update equals a single process on the same global batch. With ``fsdp=True``
each layer is sharded across the ranks instead (FSDP2, gradients averaged the
same way); checkpoints and the exported model hold the gathered whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .. import atomic
from ..allocator import keep_freed_memory
from ..checkpoint import DEFAULT_MODEL, SHIPPED_MODELS, load_model, save_hf_model
from ..data import TaskData, load_task
from ..dispatch import cpu_features
from ..lora import apply_lora, merge_peft_model, save_adapter
from ..model import Transformer
from ..policies.importance import answer_influence, nested_order, removal_order
from ..pull import PULLABLE
from ..schedule import SkipSchedule
from ..tokenization import load_tokenizer
from . import qat
from .augment import NameAugmenter, name_attributes
from .batch import (
    _micro_batches,
    _tokenize,
    autocast,
    batch_loss_sum,
    batch_objective,
    global_batch_indices,
    make_batch,
    tokenizer_pad,
)
from .config import (
    TrainConfig,
    TrainError,
    TrainingRecord,
    TrainResult,
    _check_resume,
    build_schedules,
    draw_schedule,
    schedule_draws,
    schedule_for_speedup,
    schedule_label,
)
from .dist import DistEnv, _full, _rank_divergence, _say, init_distributed, shard_model, unsharded_copy
from .state import (
    CKPT_DIR,
    LAYER_ORDER_FILE,
    LOG_NAME,
    RUN_OUTPUTS,
    _fault,
    _finished,
    _truncate_log,
    checkpoint_dirs,
    load_checkpoint,
    load_state,
    remove_run,
    save_checkpoint,
)


def prepare_model(net: Transformer, cfg: TrainConfig) -> nn.Module:
    """Trainable parameters: all of them, or LoRA adapters on our fused linears (via peft)."""
    net.train()
    if not cfg.lora:
        if cfg.qat == "int4":
            qat.attach(net)
        return net.requires_grad_(True)
    return apply_lora(net, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.seed, norms=cfg.lora_norms)


def model_layer_order(path: Path, name: str) -> tuple[int, ...]:
    """The nested layer order a model was trained with (``--importance model``): the one its
    ``skipdecode.json`` schedules share, so that further training keeps its layer sets."""
    meta = path / "skipdecode.json"
    orders = set()
    if meta.is_file():
        for s in json.loads(meta.read_text()).get("schedules", {}).values():
            if s.get("layer_order"):
                orders.add(tuple(s["layer_order"]))
    if len(orders) != 1:
        raise TrainError(f"--importance model keeps the layer order of a model trained with nested layer sets; "
                         f"{name} records {'none' if not orders else 'several'} (measure one: --importance "
                         f"influence or removal)")
    return orders.pop()


def base_transformer(model: nn.Module) -> Transformer:
    m = model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model
    if hasattr(m, "get_base_model"):
        m = m.get_base_model()
    assert isinstance(m, Transformer)
    return m


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


@torch.no_grad()
def evaluate_loss(model: nn.Module, items: list, schedule: SkipSchedule, pad_id: int, batch_size: int = 8,
                  mixed_precision: str = "no", device: str = "cpu") -> float:
    """Mean cross-entropy per target token under one schedule (teacher forced)."""
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for k in range(0, len(items), batch_size):
        b = make_batch(items[k:k + batch_size], schedule, pad_id).to(device)
        with autocast(mixed_precision, device):
            total += batch_loss_sum(model, b).item()
        n += b.target_tokens
    model.train(was)
    return total / max(n, 1)


def measure_step_time(model: nn.Module, items: list, schedules: dict[str, SkipSchedule], pad_id: int = 0,
                      repeats: int = 3, warmup: int = 2, lr: float = 1e-6,
                      mixed_precision: str = "no") -> dict[str, Any]:
    """Seconds per training step on one batch, per schedule, and their ratio (first / second).

    A step is forward + backward + AdamW update; ``forward_backward`` leaves the
    update out (skipping cannot shorten it). Schedules alternate in every round
    after ``warmup`` untimed rounds (first steps pay for allocation), and the
    median round counts: timings on a shared machine are noisy. Also reports
    each schedule's layer-position work relative to full depth: prompt columns
    always run every layer, so a 3x decode schedule saves less in training.
    The weights change while measuring: use this on a model you do not keep.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    batches = {name: make_batch(items, s, pad_id) for name, s in schedules.items()}
    step_t: dict[str, list[float]] = {n: [] for n in schedules}
    fb_t: dict[str, list[float]] = {n: [] for n in schedules}
    names = list(schedules)
    for r in range(warmup + repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            b = batches[name]
            t = time.perf_counter()
            with autocast(mixed_precision):
                loss = batch_loss_sum(model, b) / b.target_tokens
            loss.backward()
            t_fb = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if r >= warmup:
                fb_t[name].append(t_fb - t)
                step_t[name].append(time.perf_counter() - t)
    out: dict[str, Any] = {
        "batch_size": len(items), "repeats": repeats,
        "prompt_tokens": sum(len(p) for p, _ in items), "target_tokens": sum(len(t) for _, t in items),
        "seconds": {n: statistics.median(v) for n, v in step_t.items()},
        "forward_backward_seconds": {n: statistics.median(v) for n, v in fb_t.items()},
        "work_fraction": {n: sum(b.active_len or [b.tokens.shape[1]] * schedules[n].num_layers)
                          / (b.tokens.shape[1] * schedules[n].num_layers) for n, b in batches.items()},
    }
    if len(names) == 2:
        a, b = names
        out["ratio"] = out["seconds"][a] / out["seconds"][b]
        out["forward_backward_ratio"] = out["forward_backward_seconds"][a] / out["forward_backward_seconds"][b]
    return out


def train(config: TrainConfig | None = None, **overrides: Any) -> TrainResult:
    """Fine-tune a model with its skip schedule(s); see the module docstring."""
    cfg = replace(config or TrainConfig(), **overrides).validate()
    keep_freed_memory()  # every step allocates activations of a new shape (allocator.py)
    if cfg.merge and not cfg.lora:
        raise TrainError("--merge merges a LoRA adapter: use it with --lora")
    if cfg.speedups:
        cfg.speedups = [float(s) for s in cfg.speedups]
    env = init_distributed()
    try:
        return _train(cfg, env)
    finally:
        if env.owns_group:
            torch.distributed.destroy_process_group()


def train_device(cfg: TrainConfig, env: DistEnv) -> torch.device:
    """The device the steps run on, or a clear error before any work. On a GPU
    fp32 stays fp32 (TF32 matmuls off): the run differs from a CPU run by the
    order of floating-point sums and, with LoRA dropout, by its masks (drawn
    from the GPU's generator)."""
    dev = torch.device(cfg.device)
    if dev.type == "cpu":
        return dev
    if env.world > 1:
        raise TrainError(f"--device {cfg.device} trains in one process; under torchrun train on the CPU "
                         "(gloo) or launch a single process")
    if not torch.cuda.is_available():
        raise TrainError(f"--device {cfg.device}: this torch ({torch.__version__}) sees no CUDA GPU; "
                         "train on the CPU (--device cpu) or install a CUDA build of torch")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TrainError(f"--device {cfg.device}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if dev.index is not None:  # checkpoints save the current device's RNG state (LoRA dropout)
        torch.cuda.set_device(dev.index)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return dev


def _train(cfg: TrainConfig, env: DistEnv) -> TrainResult:
    out = Path(cfg.output_dir)
    device = train_device(cfg, env)
    per_rank, rem = divmod(cfg.batch_size, env.world * cfg.grad_accum)
    if rem or per_rank < 1:
        raise TrainError(f"batch_size {cfg.batch_size} must be a multiple of world size x grad_accum "
                         f"= {env.world} x {cfg.grad_accum}")
    fsdp = cfg.fsdp and env.world > 1
    if cfg.fsdp and cfg.lora:
        raise TrainError("--fsdp shards full fine-tuning; LoRA adapters are small: train them with DDP "
                         "(drop --fsdp)")
    if cfg.fsdp and not fsdp:
        _say(env, "skipdecode train: --fsdp shards across processes (torchrun); one process trains unsharded")
    log_path = out / LOG_NAME
    if env.main:
        if out.exists() and not out.is_dir():
            raise TrainError(f"--output-dir {out} is a file: give a directory (new or holding a run)")
        if cfg.resume and cfg.overwrite:
            raise TrainError("--resume continues a run and --overwrite discards it: give one of them")
        if not cfg.resume and not cfg.overwrite and (log_path.exists() or checkpoint_dirs(out)
                                                     or any((out / f).exists() for f in RUN_OUTPUTS)):
            raise TrainError(f"{out} already holds a training run: pass --resume to continue it "
                             "or --overwrite to start again")
        out.mkdir(parents=True, exist_ok=True)
        if cfg.overwrite:  # the old run goes first: a crash later must not leave it looking complete
            remove_run(out)
        for stale in (out / CKPT_DIR).glob("*.tmp") if (out / CKPT_DIR).is_dir() else []:
            shutil.rmtree(stale, ignore_errors=True)  # a checkpoint cut short by a kill
    env.barrier()

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    net, path = load_model(cfg.model)
    path = path.resolve()
    tokenizer = load_tokenizer(path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    L = net.cfg.n_layers
    task: TaskData = load_task(cfg.data, val_groups=cfg.val_groups, seed=cfg.split_seed)
    max_len = min(cfg.max_length or net.cfg.max_position, net.cfg.max_position)
    train_rows: list = []
    train_items, dropped = _tokenize(tokenizer, task.train, cfg.chat, max_len, kept=train_rows)
    if dropped:
        _say(env, f"skipdecode train: dropped {dropped} example(s) longer than {max_len} tokens")
    if len(train_items) < cfg.batch_size:
        raise TrainError(f"{len(train_items)} training examples are fewer than one batch of {cfg.batch_size}")
    augmenter = None
    if cfg.augment_names > 0:
        if not any(key == "name" for ex in train_rows for key, _ in name_attributes(ex.prompt)):
            raise TrainError(f"--augment-names renames the name[...] attributes of E2E meaning representations; "
                             f"the data {cfg.data!r} has none (leave it at 0)")
        augmenter = NameAugmenter(train_rows, train_items, cfg.augment_names, cfg.seed, tokenizer, cfg.chat, max_len)
    val_rows = task.validation[: cfg.eval_examples] if cfg.eval_examples > 0 else []
    val_items, _ = _tokenize(tokenizer, val_rows, cfg.chat, max_len)

    expected = cfg.expected_new_tokens or int(statistics.median(len(t) for _, t in train_items))
    influence = removal_loss = order = None
    if cfg.mode == "nested" and not cfg.schedule_file:  # measured on the base model, before any update
        saved = out / LAYER_ORDER_FILE  # a resumed run keeps the order it started with, to the last tie
        if cfg.resume and saved.is_file():
            d = json.loads(saved.read_text())
            order, influence, removal_loss = tuple(d["layer_order"]), d.get("layer_influence"), d.get("removal_loss")
        elif cfg.importance == "model":
            order = model_layer_order(path, cfg.model)
        else:
            measured, t_measure = train_items[: cfg.importance_examples], time.perf_counter()
            if cfg.importance == "removal":
                _say(env, f"skipdecode train: measuring the layer order by greedy removal on {len(measured)} "
                          "examples ...")
                order, removal_loss = removal_order(net, measured)
            else:
                influence = answer_influence(net, measured)
                order = nested_order(influence)
            if env.main:
                atomic.write_text(saved, json.dumps({"layer_order": order, "layer_influence": influence,
                                                     "removal_loss": removal_loss,
                                                     "seconds": round(time.perf_counter() - t_measure, 1)}) + "\n")
        _say(env, f"skipdecode train: layers by measured {cfg.importance}: " + " ".join(map(str, order)))
    schedules = build_schedules(cfg, L, expected, order)
    labels = schedule_draws(cfg, schedules)
    total = cfg.steps or math.ceil(cfg.epochs * len(train_items) / cfg.batch_size)
    if total < 1:
        raise TrainError("nothing to train: steps/epochs give 0 optimizer steps")
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max(1, round(0.05 * total))

    model = prepare_model(net, cfg).to(device)
    if fsdp:
        model = shard_model(model)  # before the optimizer: it must see the sharded parameters
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.effective_lr(), weight_decay=cfg.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total, cfg.min_lr_ratio))

    start, elapsed0, tokens_seen = 0, 0.0, 0
    ckpts = checkpoint_dirs(out) if cfg.resume else []
    if cfg.resume and not ckpts:
        if _finished(out):
            raise TrainError(f"the run in {out} is already complete; pass --overwrite to train again")
        _say(env, f"skipdecode train: no checkpoint in {out / CKPT_DIR}; starting from step 0")
        if env.main:
            _truncate_log(log_path, 0)
    if ckpts:
        _check_resume(load_state(ckpts[-1])["config"], cfg)
        state = load_checkpoint(ckpts[-1], model, opt, lr_sched, env, fsdp)
        start, elapsed0, tokens_seen = state["step"], state["seconds"], state["tokens_seen"]
        if env.main:
            _truncate_log(log_path, start)
        _say(env, f"skipdecode train: resumed from {ckpts[-1]} at step {start}/{total}")
    env.barrier()

    runner: nn.Module = model
    if env.world > 1 and not fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        runner = DDP(model)

    record = TrainingRecord(
        base_model=str(path), data=cfg.data, num_layers=L, expected_new_tokens=expected, warmup_steps=warmup,
        total_steps=total, schedules={k: s.to_dict() for k, s in schedules.items()},
        decode_layer_speedup={k: s.decode_layer_speedup(expected) for k, s in schedules.items()},
        train_examples=len(train_items), world_size=env.world, lr=cfg.effective_lr(), config=asdict(cfg),
        layer_influence=influence, removal_loss=removal_loss)
    if env.main:
        _say(env, f"skipdecode train: {len(train_items)} examples, {total} steps of {cfg.batch_size}, "
                  f"{'LoRA' if cfg.lora else 'full'} fine-tuning of {L} layers, schedules "
                  + ", ".join(f"{k} (b {s.max_exit_layer}->{s.min_exit_layer}, "
                              f"{s.decode_layer_speedup(expected):.2f}x)" for k, s in schedules.items()))
        if cfg.mixed_precision == "bf16" and not cpu_features()["onednn_bf16"]:
            _say(env, "skipdecode train: note: this CPU has no native bf16 (AMX or AVX-512-BF16); "
                      "--mixed-precision bf16 will be emulated and likely slower than fp32")

    bar = None
    if env.main and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    losses: list[float] = []
    t_run = time.perf_counter()
    log_f = open(log_path, "a") if env.main else None
    try:
        for step in range(start, total):
            t_step = time.perf_counter()
            label = draw_schedule(labels, cfg.seed, step)
            sched = schedules[label]
            idx = global_batch_indices(len(train_items), cfg.batch_size, step, cfg.seed)
            global_items = ([train_items[i] for i in idx] if augmenter is None
                            else augmenter.batch(idx, step * cfg.batch_size))
            n_target = sum(len(t) for _, t in global_items)
            n_input = sum(len(p) + len(t) - 1 for p, t in global_items)
            local = global_items[env.rank * per_rank * cfg.grad_accum:(env.rank + 1) * per_rank * cfg.grad_accum]
            loss_sum, ce_sum = 0.0, 0.0
            for k, micro in enumerate(_micro_batches(local, cfg.grad_accum)):
                batch = make_batch(micro, sched, pad_id).to(device)
                sync = env.world == 1 or k == cfg.grad_accum - 1
                if fsdp:
                    runner.set_requires_gradient_sync(sync)
                with contextlib.nullcontext() if sync or fsdp else runner.no_sync():
                    with autocast(cfg.mixed_precision, cfg.device):
                        ls, ce = batch_objective(runner, batch, cfg.distill, cfg.distill_temperature)
                    (ls * (env.world / n_target)).backward()
                loss_sum += ls.item()
                ce_sum += ce.item()
            if env.world > 1:
                t = torch.tensor([loss_sum, ce_sum], dtype=torch.float64)
                torch.distributed.all_reduce(t)
                loss_sum, ce_sum = t.tolist()
            loss = loss_sum / n_target
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm) if cfg.max_grad_norm > 0 else None
            grad_norm = None if grad_norm is None else _full(grad_norm)
            lr_now = opt.param_groups[0]["lr"]
            opt.step()
            lr_sched.step()
            opt.zero_grad(set_to_none=True)
            tokens_seen += n_input
            losses.append(loss)
            dt = time.perf_counter() - t_step
            if log_f is not None:
                rec = {"step": step + 1, "loss": loss, "cross_entropy": ce_sum / n_target, "lr": lr_now,
                       "tokens": n_input, "target_tokens": n_target,
                       "seconds": dt, "schedule_target": label, "budget": [sched.max_exit_layer, sched.min_exit_layer],
                       "grad_norm": None if grad_norm is None else float(grad_norm),
                       "epoch": (step + 1) * cfg.batch_size / len(train_items)}
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
            if bar is not None:
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{n_input / dt:.0f}", x=label, refresh=False)
                bar.update(1)
            _fault("kill_after_step", step + 1)
            if cfg.save_every > 0 and (step + 1) % cfg.save_every == 0 and step + 1 < total:
                state = {"step": step + 1, "seconds": elapsed0 + time.perf_counter() - t_run,
                         "tokens_seen": tokens_seen, "config": asdict(cfg)}
                save_checkpoint(out, step + 1, model, opt, lr_sched, state, env, cfg.keep_checkpoints, fsdp)
    finally:
        if bar is not None:
            bar.close()
        if log_f is not None:
            log_f.close()

    if fsdp:  # one whole model on every rank, gathered from the shards
        model = unsharded_copy(model)
    elif env.world > 1:
        record.max_abs_diff_across_ranks = _rank_divergence(model)
    base = base_transformer(model)
    if cfg.qat == "int4":
        qat.detach(base)  # the rounded weights become the model's own: validated and written as int4 runs them
    val_loss = {}
    if env.main and val_items:
        for k, s in schedules.items():
            val_loss[k] = evaluate_loss(model, val_items, s, pad_id, max(1, per_rank), cfg.mixed_precision,
                                        cfg.device)
        _say(env, "skipdecode train: validation loss " + ", ".join(f"{k} {v:.3f}" for k, v in val_loss.items()))
    model = model.to("cpu")  # outputs are written, and the result returned, from the CPU
    record.steps_done, record.final_loss, record.validation_loss = total, losses[-1] if losses else None, val_loss
    record.seconds, record.tokens_seen = elapsed0 + time.perf_counter() - t_run, tokens_seen
    meta = record.to_json()
    merged = None
    if env.main:
        if cfg.lora:
            # a named base ("default", "default-e2e", a pullable model) stays portable; a local base is
            # recorded by its path
            named = cfg.model in (DEFAULT_MODEL, *SHIPPED_MODELS, *PULLABLE)
            save_adapter(model, cfg.model if named else path, out, meta, tokenizer)
            if cfg.merge:
                model = merge_peft_model(model)
                merged = save_hf_model(model, path, out / "merged", meta)
        else:
            save_hf_model(base, path, out, meta)
        shutil.rmtree(out / CKPT_DIR, ignore_errors=True)  # the run is complete; its output is exported
        _say(env, f"skipdecode train: wrote {out}" + (f" and {merged}" if merged else ""))
    env.barrier()
    return TrainResult(out, total, losses, val_loss, record.schedules, merged, model.eval())


def measure_cli(cfg: TrainConfig, speedup: float = 3.0, repeats: int = 3) -> dict[str, Any]:
    """Step time at full depth vs ``speedup`` on the first ``batch_size`` training examples."""
    r_malloc = keep_freed_memory()
    net, path = load_model(cfg.model)
    tok = load_tokenizer(path)
    task = load_task(cfg.data, val_groups=cfg.val_groups, seed=cfg.split_seed)
    items, _ = _tokenize(tok, task.train[: cfg.batch_size], cfg.chat, net.cfg.max_position)
    expected = cfg.expected_new_tokens or int(statistics.median(len(t) for _, t in items))
    L = net.cfg.n_layers
    sched = {"1x": SkipSchedule.full_depth(L),
             schedule_label(speedup): schedule_for_speedup(speedup, expected, L, cfg)}
    model = prepare_model(net, cfg)
    r = measure_step_time(model, items, sched, tokenizer_pad(tok), repeats, mixed_precision=cfg.mixed_precision)
    r["note"] = "step = forward + backward + AdamW update; prompt columns run every layer in both"
    r["model"], r["lora"], r["expected_new_tokens"] = str(path), cfg.lora, expected
    r["mixed_precision"] = cfg.mixed_precision
    r["malloc_keeps_freed_memory"] = r_malloc
    r["schedule"] = sched[schedule_label(speedup)].to_dict()
    r["threads"] = torch.get_num_threads()
    return r

