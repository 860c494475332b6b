"""Executes a step plan on the model: prompt chunks, then one decode position
per row with each layer on its own rows. Mechanism only: what runs is decided
by the scheduler."""

from __future__ import annotations

from typing import Sequence

import torch

from ..model import LayerRows, PrefillChunk, Transformer
from .kv_cache import KVPool, RequestKV
from .request import RequestState
from .scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool):
        self.model, self.pool = model, pool
        self._pools = pool.pools()

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[tuple[RequestState, int, int]], verify: Sequence[RequestState] = ()
                ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        """Prompt tokens ``start..end-1`` of each request at full depth into its
        slots, and each lossless round to verify (its last verified token and its
        drafts, at their positions), all in one packed pass.

        Returns, per prompt chunk, the last position's logits ``(vocab,)`` when
        the chunk ends its prompt (else None), and per verified round the
        full-depth logits ``(drafts + 1, vocab)`` of every position in it. The
        verifying pass overwrites every layer's keys/values of those positions,
        so each position it accepts holds all layers; the slots of rejected
        drafts lie beyond the request's length and are rewritten before any read.
        """
        packed = [PrefillChunk(st.request.prompt_token_ids[start:end], start, RequestKV(self.pool, st.reservation))
                  for st, start, end in chunks]
        packed += [PrefillChunk([st.token_ids[-1], *st.drafts], st.prompt_len + len(st.token_ids) - 1,
                                RequestKV(self.pool, st.reservation), all_logits=True) for st in verify]
        logits = self.model.prefill(packed)
        lasts = [row if end == st.prompt_len else None for (st, _, end), row in zip(chunks, logits)]
        rounds, lo = [], len(chunks)
        for st in verify:
            n = len(st.drafts) + 1
            rounds.append(logits[lo:lo + n])
            lo += n
        return lasts, rounds

    @torch.inference_mode()
    def decode(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``(rows, vocab)``: each row feeds its last token at its own position."""
        rows = plan.decode
        # the token fed back: the last sampled one, or a lossless round's last draft
        tokens = torch.tensor([st.drafts[-1] if st.drafts else st.token_ids[-1] for st in rows])
        fed = [st.prompt_len + st.fed_index for st in rows]  # its position
        positions = torch.tensor(fed)
        # A row that runs layer l at this step ran it at every earlier step too
        # (budgets never increase; a lossless row's verified positions hold every
        # layer), so it holds prompt + steps-so-far + 1 slots there.
        lens = positions + 1
        starts = torch.tensor([st.reservation.starts for st in rows])  # (R, L)
        layer_rows: list[LayerRows | None] = []
        for l, (n, idx) in enumerate(plan.layers):
            if n == 0:
                layer_rows.append(None)
            elif idx is None:
                slots = torch.stack([starts[:n, l], lens[:n]], 1)
                layer_rows.append(LayerRows(None if n == len(rows) else n, slots))
            else:
                ix = torch.tensor(idx)
                layer_rows.append(LayerRows(ix, torch.stack([starts[ix, l], lens[ix]], 1)))
        drafts = [st.draft_extra if st.round_size else None for st in rows]
        return self.model.decode(tokens, positions, layer_rows, self._pools, drafts)
