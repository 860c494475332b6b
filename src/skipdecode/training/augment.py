"""Name augmentation: train the model to copy the names its input gives, not the few it saw.

E2E's training part names only a dozen restaurants, so a model can learn to write
those names from memory instead of copying them from the meaning representation;
a skipped pass then garbles names it has never seen ("Blue Spice" -> "Blue Spale").
With probability ``p`` a drawn example gets fresh synthetic names in its ``name[...]``
and ``near[...]`` attributes, replaced the same way in the reference, so copying
is the only way to get those tokens right. The draw is a pure function of
``(seed, epoch, example)``: resume and every rank see the same augmented batch.
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from ..data import Example, encode_example

NAME_KEYS = ("name", "near")  # the attributes that hold proper names in an E2E meaning representation
_ONSETS = ("b", "br", "c", "ch", "d", "dr", "f", "g", "gr", "h", "k", "l", "m", "n", "p", "pr", "r", "s",
           "sh", "st", "t", "th", "tr", "v", "w", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")
_CODAS = ("", "", "n", "r", "l", "s", "m", "ck", "nd", "rt", "th", "x")


def name_words(tokenizer: Any) -> list[str]:
    """Whole English-looking words of the tokenizer's vocabulary (``Ġgarden`` -> ``Garden``),
    sorted, so that synthetic names mix real words with invented ones as real names do."""
    words = set()
    for piece in tokenizer.get_vocab():
        w = piece.lstrip("Ġ▁")
        if len(w) < len(piece) and 4 <= len(w) <= 9 and w.isascii() and w.isalpha() and w.islower():
            words.add(w.capitalize())
    return sorted(words)


def pseudo_word(rng: random.Random) -> str:
    """A pronounceable invented word of two or three syllables (``Brolandex``)."""
    word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.choice((2, 2, 3))))
    return (word + rng.choice(_CODAS)).capitalize()


def synthetic_name(rng: random.Random, words: Sequence[str]) -> str:
    """One to three words, real or invented, sometimes after "The"."""
    parts = [rng.choice(words) if words and rng.random() < 0.5 else pseudo_word(rng)
             for _ in range(rng.choice((1, 1, 2, 2, 3)))]
    return ("The " if rng.random() < 0.3 else "") + " ".join(parts)


def name_attributes(prompt: str) -> list[tuple[str, str]]:
    """The ``(key, name)`` pairs of a prompt's name attributes (``[("name", "The Eagle")]``)."""
    found = ((key, re.search(rf"\b{key}\[([^\]]+)\]", prompt)) for key in NAME_KEYS)
    return [(key, m.group(1)) for key, m in found if m]


def augment_example(ex: Example, rng: random.Random, words: Sequence[str]) -> Example | None:
    """``ex`` with each name attribute that its reference spells verbatim renamed, or None
    when there is none (the reference paraphrases the name, or the prompt has no names)."""
    olds = [(key, name) for key, name in name_attributes(ex.prompt) if name in ex.target]
    if not olds:
        return None
    fresh = {old: synthetic_name(rng, words) for _, old in olds}
    # placeholders first, longest name first: one name inside another ("The Mill" in "The Mill Pub") stays intact
    olds.sort(key=lambda kv: -len(kv[1]))
    new_prompt, new_target = ex.prompt, ex.target
    for k, (key, old) in enumerate(olds):
        new_prompt = new_prompt.replace(f"{key}[{old}]", f"{key}[\0{k}\0]")
        new_target = new_target.replace(old, f"\0{k}\0")
    for k, (_, old) in enumerate(olds):
        new_prompt = new_prompt.replace(f"\0{k}\0", fresh[old])
        new_target = new_target.replace(f"\0{k}\0", fresh[old])
    return Example(new_prompt, new_target, ex.group)


class NameAugmenter:
    """The training item of example ``i`` in ``epoch``: renamed with probability ``p``
    (tokenized on the fly), else the pre-tokenized original."""

    def __init__(self, rows: Sequence[Example], items: Sequence[tuple[list[int], list[int]]], p: float,
                 seed: int, tokenizer: Any, chat: bool | None, max_length: int):
        if len(rows) != len(items):
            raise ValueError("one tokenized item per example")
        self.rows, self.items, self.p, self.seed = rows, items, p, seed
        self.tokenizer, self.chat, self.max_length = tokenizer, chat, max_length
        self.words = name_words(tokenizer)

    def item(self, i: int, epoch: int) -> tuple[list[int], list[int]]:
        rng = random.Random(f"skipdecode-names:{self.seed}:{epoch}:{i}")
        if rng.random() >= self.p:
            return self.items[i]
        ex = augment_example(self.rows[i], rng, self.words)
        if ex is None:
            return self.items[i]
        p, t = encode_example(self.tokenizer, ex.prompt, ex.target, self.chat)
        return (p, t) if len(p) + len(t) - 1 <= self.max_length else self.items[i]

    def batch(self, indices: Sequence[int], first_slot: int) -> list[tuple[list[int], list[int]]]:
        """Items of a global batch whose first example is the ``first_slot``-th drawn in the run."""
        n = len(self.items)
        return [self.item(i, (first_slot + k) // n) for k, i in enumerate(indices)]
