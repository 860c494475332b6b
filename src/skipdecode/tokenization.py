"""Text in and out: the chat encoder, and incremental detokenization with stop strings.

One place for both, shared by ``LLM``, the engine and the server. Streaming
uses ``tokenizers``' ``DecodeStream``: each token costs one incremental step
instead of re-decoding the whole row, and a multi-byte character split across
tokens is emitted only once it is complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .errors import SkipDecodeError


class TokenizationError(SkipDecodeError):
    """A prompt or tokenizer we cannot use as given."""


def check_text(what: str, text: str) -> str:
    """Text must be valid Unicode that UTF-8 can carry: command-line bytes that are not UTF-8
    arrive as lone surrogates (and JSON can spell them), which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizationError(f"{what} is not valid UTF-8 text (character {e.start} is {text[e.start]!r}); "
                                "pass it as UTF-8") from None
    return text


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def load_tokenizer(path: Path):
    """The Hugging Face tokenizer of a model directory; a clear error when it has none."""
    if not has_tokenizer(path):
        raise TokenizationError(f"{path} has no tokenizer files (tokenizer.json / tokenizer_config.json); "
                                "text in or out needs one")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def encode_prompt(tokenizer, prompt: str, chat: bool | None = None, system: str | None = None) -> list[int]:
    """Token ids of a prompt; with the chat template (the default where the
    tokenizer has one) as one user turn after an optional system message."""
    if tokenizer is None:
        raise TokenizationError("this model has no tokenizer; pass token ids instead")
    if not isinstance(prompt, str) or not prompt.strip():
        raise TokenizationError("prompt is empty: give some text")
    check_text("prompt", prompt)
    if system is not None:
        check_text("system message", system)
    use_chat = tokenizer.chat_template is not None if chat is None else chat
    if use_chat:
        if tokenizer.chat_template is None:
            raise TokenizationError("this model's tokenizer has no chat template; generate without chat")
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def encode_messages(tokenizer, messages: Sequence[dict]) -> list[int]:
    """Token ids of a whole chat (OpenAI-style ``{"role", "content"}`` messages)."""
    if tokenizer is None or tokenizer.chat_template is None:
        raise TokenizationError("this model's tokenizer has no chat template")
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            check_text(f"message {i}", m["content"])
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class Detokenizer:
    """One request's text, token by token.

    ``add`` returns the newly printable text. With stop strings it never shows
    a stop string, nor a tail that may still grow into one; ``stopped`` turns
    true once one appears, and the text ends right before it. ``finish``
    returns whatever was held back, so the deltas always add up to ``text``.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        from tokenizers.decoders import DecodeStream

        self._hf = tokenizer
        self._tok = getattr(tokenizer, "_tokenizer", tokenizer)  # the Rust tokenizer under a transformers one
        self._stream = DecodeStream(skip_special_tokens=True)
        self.ids: list[int] = []
        self.stops = ([stops] if stops else []) if isinstance(stops, str) else [s for s in stops if s]  # "ab": one stop
        self.raw = ""
        self.sent = 0
        self.stopped = False
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        piece = self._stream.step(self._tok, token_id)
        if piece:
            self.raw += piece
        stable = self._visible()
        if not self.stopped and self.stops:
            hold = max((k for s in self.stops for k in range(1, len(s)) if stable.endswith(s[:k])), default=0)
            stable = stable[:len(stable) - hold]
        delta = stable[self.sent:]
        self.sent = max(self.sent, len(stable))
        return delta

    def _visible(self) -> str:
        hits = [self.raw.find(s) for s in self.stops if s in self.raw]
        if hits:
            self.stopped = True
            return self.raw[:min(hits)]
        return self.raw

    def finish(self) -> str:
        # The stream holds back an unfinished UTF-8 character forever; the
        # final text is the whole decode (which shows it as U+FFFD), as
        # ``tokenizer.decode`` gives it.
        full = self._hf.decode(self.ids, skip_special_tokens=True)
        if full.startswith(self.raw):
            self.raw = full
        self.text = self._visible()
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
