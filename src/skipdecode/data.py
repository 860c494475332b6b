"""Task data for skip-aware fine-tuning and scoring: E2E, SciTLDR, generic JSONL.

Every loader returns a ``TaskData``: training ``Example``s (one per
prompt/target pair) and a validation split made **by group** (an E2E meaning
representation, a SciTLDR paper), never by row, so no prompt of the
validation set is ever seen in training. ``TaskData.eval_items`` keeps all
references of a group together for multi-reference scoring.

The data files are read, never copied or written. A malformed file raises
``DataError`` naming the file and the line.
"""

from __future__ import annotations

import csv
import json
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .errors import SkipDecodeError

E2E_INSTRUCTION = "Write one sentence describing this restaurant: "
SCITLDR_INSTRUCTION = "Write a one-sentence TL;DR of this paper abstract:\n"
E2E_VALIDATION_MRS = 60  # the held-out MRs of the feasibility check in SKIPDECODE.md


class DataError(SkipDecodeError):
    """A data file or example we cannot use, with the file and line at fault."""


@dataclass(frozen=True)
class Example:
    """One training pair. ``group`` is the unit of the train/validation split."""

    prompt: str
    target: str
    group: str


@dataclass(frozen=True)
class EvalItem:
    """One prompt with every reference of its group (multi-reference scoring)."""

    prompt: str
    references: tuple[str, ...]
    group: str


@dataclass
class TaskData:
    """Training examples, a validation split (``select`` on ``e2e-heldout``: every choice is
    made there) and, where the task has one, a ``report`` split scored but never chosen on."""

    name: str
    train: list[Example]
    validation: list[Example] = field(default_factory=list)
    report: list[Example] = field(default_factory=list)

    def eval_items(self, split: str = "validation") -> list[EvalItem]:
        """Group a split's examples by group, in first-seen order, keeping all references."""
        rows = {"train": self.train, "validation": self.validation, "select": self.validation,
                "report": self.report}.get(split)
        if rows is None or (split == "report" and not rows):
            raise DataError(f"split must be 'train', 'validation' (or 'select') or 'report' "
                            f"(e2e-heldout only), got {split!r}")
        items: dict[str, tuple[str, list[str]]] = {}
        for ex in rows:
            items.setdefault(ex.group, (ex.prompt, []))[1].append(ex.target)
        return [EvalItem(p, tuple(refs), g) for g, (p, refs) in items.items()]


# -- where the shared data lives ------------------------------------------------
def data_root() -> Path:
    """``$SKIPDECODE_DATA``, else ``../shared/data`` next to the project root (or the cwd)."""
    env = os.environ.get("SKIPDECODE_DATA")
    if env:
        return Path(env)
    candidates = [Path(__file__).resolve().parents[2].parent / "shared" / "data",
                  Path.cwd().parent / "shared" / "data", Path.cwd() / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    return candidates[0]


# -- splitting --------------------------------------------------------------------
def split_by_group(examples: Sequence[Example], val_groups: int | float, seed: int = 0
                   ) -> tuple[list[Example], list[Example]]:
    """Deterministic train/validation split by group (never by row).

    ``val_groups``: a number of groups (int) or a fraction of them (float < 1).
    The groups are shuffled with ``random.Random(seed)`` in first-seen order,
    so the split depends only on the data and the seed.
    """
    groups = list(dict.fromkeys(ex.group for ex in examples))
    if isinstance(val_groups, float) and 0 <= val_groups < 1:
        n_val = round(val_groups * len(groups))
    else:
        n_val = int(val_groups)
    if n_val < 0 or (n_val > 0 and n_val >= len(groups)):
        raise DataError(f"cannot hold out {val_groups} of {len(groups)} groups and still train")
    order = groups[:]
    random.Random(seed).shuffle(order)
    val = set(order[:n_val])
    return [e for e in examples if e.group not in val], [e for e in examples if e.group in val]


# -- E2E ------------------------------------------------------------------------------
_MR_ITEM = re.compile(r"\s*([^\[\],]+?)\s*\[([^\]]*)\]\s*(?:,|$)")


def parse_mr(mr: str) -> list[tuple[str, str]]:
    """``"name[The Eagle], food[Japanese]"`` -> ``[("name", "The Eagle"), ("food", "Japanese")]``."""
    items, pos = [], 0
    mr = mr.strip()
    while pos < len(mr):
        m = _MR_ITEM.match(mr, pos)
        if m is None:
            raise ValueError(f"cannot parse meaning representation {mr!r} near {mr[pos:pos + 30]!r}")
        items.append((m.group(1), m.group(2).strip()))
        pos = m.end()
    if not items:
        raise ValueError("empty meaning representation")
    return items


def e2e_prompt(mr: str) -> str:
    """The instruction a model sees for an MR: the attributes, listed."""
    return E2E_INSTRUCTION + ", ".join(f"{k}[{v}]" for k, v in parse_mr(mr)) + "."


def read_e2e(path: str | os.PathLike) -> list[Example]:
    """All (MR, reference) rows of an E2E CSV (columns ``mr,ref``), one example per row."""
    p = Path(path)
    out: list[Example] = []
    try:
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f, strict=True)
            header = next(reader, None)
            if header is None:
                raise DataError(f"{p}: the file is empty (expected a header 'mr,ref')")
            cols = [h.strip().lower() for h in header]
            if "mr" not in cols or "ref" not in cols:
                raise DataError(f"{p}:1: header must have columns 'mr' and 'ref', got {header}")
            i_mr, i_ref = cols.index("mr"), cols.index("ref")
            for row in reader:
                line = reader.line_num  # the last physical line of this record
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise DataError(f"{p}:{line}: expected {len(header)} fields (mr,ref), got {len(row)}")
                mr, ref = row[i_mr].strip(), row[i_ref].strip()
                if not mr:
                    raise DataError(f"{p}:{line}: empty 'mr' field")
                if not ref:
                    raise DataError(f"{p}:{line}: empty 'ref' (target) field")
                try:
                    items = parse_mr(mr)
                except ValueError as e:
                    raise DataError(f"{p}:{line}: {e}") from None
                group = ", ".join(f"{k}[{v}]" for k, v in sorted(items))
                out.append(Example(e2e_prompt(mr), ref, group))
    except FileNotFoundError:
        raise DataError(f"E2E file {p} does not exist") from None
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text ({e})") from None
    except csv.Error as e:
        raise DataError(f"{p}:{reader.line_num}: malformed CSV: {e}") from None
    if not out:
        raise DataError(f"{p}: no examples (only a header?)")
    return out


def split_by_name(examples: Sequence[Example], min_val_mrs: int = E2E_VALIDATION_MRS, seed: int = 0
                  ) -> tuple[list[Example], list[Example]]:
    """E2E split that holds out whole restaurant names: names are shuffled with
    ``random.Random(seed)`` and held out one by one until at least
    ``min_val_mrs`` MRs have a held-out ``name[...]``. No training example
    mentions a held-out name, so validation looks like unseen traffic."""
    name_of = {ex.group: dict(parse_mr(ex.group)).get("name") for ex in examples}
    names = sorted({n for n in name_of.values() if n})
    random.Random(seed).shuffle(names)
    held: set[str] = set()
    for n in names:
        if sum(1 for g in set(name_of) if name_of[g] in held) >= min_val_mrs:
            break
        held.add(n)
    if len(held) == len(names):
        raise DataError(f"cannot hold out {min_val_mrs} MRs by restaurant name and still train")
    train = [e for e in examples if name_of[e.group] not in held and not any(h in e.group for h in held)]
    val = [e for e in examples if name_of[e.group] in held]
    return train, val


def split_heldout(examples: Sequence[Example], min_select_mrs: int = E2E_VALIDATION_MRS, seed: int = 0
                  ) -> tuple[list[Example], list[Example], list[Example]]:
    """``(train, select, report)``, all three disjoint by restaurant name.

    ``select`` is the name-disjoint validation split of ``split_by_name`` (the names
    earlier choices were made on); ``report`` holds out further whole names, by the
    same seeded rule, until it has at least as many MRs as ``select``. Every choice
    (schedule, horizon, threshold, checkpoint) is made on ``select``; ``report`` is
    only scored, so its figures say what unseen traffic gets. No training example
    mentions a name of either part."""
    rest, select = split_by_name(examples, min_select_mrs, seed)
    n_select = len({e.group for e in select})
    train, report = split_by_name(rest, n_select, seed)
    return train, select, report


def load_e2e(path: str | os.PathLike | None = None, *, val_groups: int | float = E2E_VALIDATION_MRS,
             seed: int = 0, by: str = "mr") -> TaskData:
    """E2E NLG: prompt = the MR's attributes, target = a human reference; split
    by MR (``by="mr"``), by restaurant name (``by="name"``: whole names held out) or
    into train/select/report by name (``by="heldout"``)."""
    p = Path(path) if path is not None else data_root() / "e2e" / "devset.csv"
    if by == "heldout":
        train, select, report = split_heldout(read_e2e(p), int(val_groups) if val_groups >= 1 else E2E_VALIDATION_MRS,
                                              seed)
        return TaskData("e2e-heldout", train, select, report)
    if by == "name":
        train, val = split_by_name(read_e2e(p), int(val_groups) if val_groups >= 1 else E2E_VALIDATION_MRS, seed)
        return TaskData("e2e-names", train, val)
    if by != "mr":
        raise DataError(f"E2E splits by 'mr', 'name' or 'heldout', got {by!r}")
    train, val = split_by_group(read_e2e(p), val_groups, seed)
    return TaskData("e2e", train, val)


# -- JSON lines -------------------------------------------------------------------------
def jsonl_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line; a clear error names the line at fault."""
    try:
        f = path.open(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"data file {path} does not exist") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    with f:
        try:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(obj, dict):
                    raise DataError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
                yield n, obj
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e})") from None


def _text(path: Path, n: int, obj: dict, key: str) -> str:
    if key not in obj:
        raise DataError(f"{path}:{n}: missing field {key!r}")
    v = obj[key]
    if not isinstance(v, str):
        raise DataError(f"{path}:{n}: field {key!r} must be a string, got {type(v).__name__}")
    if not v.strip():
        raise DataError(f"{path}:{n}: field {key!r} is empty")
    return v


def _texts(path: Path, n: int, obj: dict, key: str, allow_empty_items: bool = False) -> list[str]:
    """A string or a non-empty list of non-empty strings (empty items dropped if allowed)."""
    if key not in obj:
        raise DataError(f"{path}:{n}: missing field {key!r}")
    v = obj[key]
    if isinstance(v, str) and not v.strip():
        raise DataError(f"{path}:{n}: field {key!r} is empty")
    vals = [v] if isinstance(v, str) else v
    if not isinstance(vals, list) or not vals:
        raise DataError(f"{path}:{n}: field {key!r} must be a string or a non-empty list of strings")
    for s in vals:
        if not isinstance(s, str):
            raise DataError(f"{path}:{n}: field {key!r} holds a {type(s).__name__}, expected strings")
        if not s.strip() and not allow_empty_items:
            raise DataError(f"{path}:{n}: field {key!r} holds an empty string")
    out = [s.strip() for s in vals if s.strip()]
    if not out:
        raise DataError(f"{path}:{n}: field {key!r} is empty")
    return out


def read_jsonl(path: str | os.PathLike) -> list[Example]:
    """Generic ``{"prompt": ..., "target": ...}`` lines; ``target`` may be a list of references.

    Examples sharing a prompt form one group (one validation item).
    """
    p = Path(path)
    out = []
    for n, obj in jsonl_objects(p):
        prompt = _text(p, n, obj, "prompt")
        for t in _texts(p, n, obj, "target"):
            out.append(Example(prompt, t, prompt))
    if not out:
        raise DataError(f"{p}: no examples")
    return out


def load_jsonl(path: str | os.PathLike, *, val_groups: int | float = 0, seed: int = 0,
               validation: str | os.PathLike | None = None) -> TaskData:
    """A generic JSONL task; validation from a second file or held out by prompt."""
    ex = read_jsonl(path)
    if validation is not None:
        return TaskData(Path(path).stem, ex, read_jsonl(validation))
    train, val = split_by_group(ex, val_groups, seed)
    return TaskData(Path(path).stem, train, val)


def read_scitldr(path: str | os.PathLike) -> list[Example]:
    """SciTLDR lines: ``source`` (abstract sentences) -> each of ``target`` (TL;DRs)."""
    p = Path(path)
    out = []
    for n, obj in jsonl_objects(p):
        source = _texts(p, n, obj, "source", allow_empty_items=True)  # one real abstract has a blank sentence
        targets = _texts(p, n, obj, "target")
        group = str(obj.get("paper_id") or f"{p.name}:{n}")
        prompt = SCITLDR_INSTRUCTION + " ".join(source)
        out.extend(Example(prompt, t, group) for t in targets)
    if not out:
        raise DataError(f"{p}: no examples")
    return out


def load_scitldr(directory: str | os.PathLike | None = None) -> TaskData:
    """SciTLDR-A: ``train.jsonl`` for training, ``dev.jsonl`` for validation (split by paper)."""
    d = Path(directory) if directory is not None else data_root() / "scitldr"
    return TaskData("scitldr", read_scitldr(d / "train.jsonl"), read_scitldr(d / "dev.jsonl"))


def load_task(spec: str, *, val_groups: int | float | None = None, seed: int = 0) -> TaskData:
    """``e2e`` (split by MR), ``e2e-names`` (whole restaurant names held out),
    ``e2e-heldout`` (train / select / report, disjoint by name), ``scitldr``,
    an E2E-style ``.csv`` or a ``.jsonl`` file of prompt/target pairs."""
    if spec in ("e2e", "e2e-names", "e2e-heldout"):
        return load_e2e(val_groups=E2E_VALIDATION_MRS if val_groups is None else val_groups, seed=seed,
                        by={"e2e": "mr", "e2e-names": "name", "e2e-heldout": "heldout"}[spec])
    if spec == "scitldr":
        return load_scitldr()
    p = Path(spec)
    if p.suffix == ".csv":
        return load_e2e(p, val_groups=E2E_VALIDATION_MRS if val_groups is None else val_groups, seed=seed)
    if p.suffix in (".jsonl", ".json"):
        return load_jsonl(p, val_groups=0 if val_groups is None else val_groups, seed=seed)
    if p.is_dir() and (p / "train.jsonl").is_file():
        return load_scitldr(p)
    raise DataError(f"data {spec!r}: give 'e2e', 'e2e-names', 'e2e-heldout', 'scitldr', a .jsonl file of prompt/target pairs or an E2E .csv")


# -- tokenization ---------------------------------------------------------------------------
def uses_chat(tokenizer: Any, chat: bool | None = None) -> bool:
    """Instruct models (a tokenizer with a chat template) get the template unless told otherwise."""
    has = getattr(tokenizer, "chat_template", None) is not None
    if chat and not has:
        raise DataError("the tokenizer has no chat template; train without --chat")
    return has if chat is None else chat


def encode_prompt(tokenizer: Any, prompt: str, chat: bool | None = None) -> list[int]:
    """Prompt ids exactly as ``LLM.encode`` builds them at generation (user message + generation prompt)."""
    if uses_chat(tokenizer, chat):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


IGNORE = -100  # a label no loss reads (torch's cross_entropy default ignore_index)


@dataclass
class LeftPadded:
    """``(prompt_ids, target_ids)`` pairs in one teacher-forced layout: prompts left-padded to end
    at column ``t0 - 1``, target tokens 0..n-2 fed back from column ``t0`` on, so column
    ``t0 - 1 + i`` predicts target token ``i`` (its label); every row keeps its own positions."""
    tokens: torch.Tensor  # (B, W) int64, W = t0 + longest target - 1
    positions: torch.Tensor  # (B, W) per-row positions (0 at the first real prompt token)
    labels: torch.Tensor  # (B, W) target token i at column t0 - 1 + i, IGNORE elsewhere
    key_valid: torch.Tensor  # (B, W) False on left padding
    t0: int


def left_pad(items: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0) -> LeftPadded:
    """The layout of :class:`LeftPadded`, shared by training batches and layer-importance
    measurements so that both score the same columns."""
    B = len(items)
    t0 = max(len(p) for p, _ in items)
    W = t0 + max(len(t) for _, t in items) - 1
    tokens = torch.full((B, W), pad_id, dtype=torch.long)
    labels = torch.full((B, W), IGNORE, dtype=torch.long)
    pad = torch.empty(B, dtype=torch.long)
    for r, (p, t) in enumerate(items):
        pad[r] = t0 - len(p)
        tokens[r, t0 - len(p): t0] = torch.as_tensor(list(p), dtype=torch.long)
        if len(t) > 1:
            tokens[r, t0: t0 + len(t) - 1] = torch.as_tensor(list(t[:-1]), dtype=torch.long)
        labels[r, t0 - 1: t0 - 1 + len(t)] = torch.as_tensor(list(t), dtype=torch.long)
    cols = torch.arange(W)[None, :]
    return LeftPadded(tokens, (cols - pad[:, None]).clamp(min=0), labels, cols >= pad[:, None], t0)


def encode_example(tokenizer: Any, prompt: str, target: str, chat: bool | None = None
                   ) -> tuple[list[int], list[int]]:
    """``(prompt_ids, target_ids)``; the target ends with EOS so the model learns to stop.

    Without a chat template the target continues the prompt after one space
    (tokenized jointly, so BPE merges match what the model will produce).
    """
    prompt_ids = encode_prompt(tokenizer, prompt, chat)
    if uses_chat(tokenizer, chat):
        target_ids = list(tokenizer(target, add_special_tokens=False)["input_ids"])
    else:
        joint = list(tokenizer(prompt + " " + target)["input_ids"])
        if joint[: len(prompt_ids)] == prompt_ids and len(joint) > len(prompt_ids):
            target_ids = joint[len(prompt_ids):]
        else:
            target_ids = list(tokenizer(" " + target, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not target_ids or target_ids[-1] != eos):
        target_ids.append(int(eos))
    if not target_ids:
        raise DataError(f"target {target!r} encodes to no tokens")
    return prompt_ids, target_ids
