"""Executes a step plan on the model: prompt chunks, then one decode position
per row with each layer on its own rows. Mechanism only: what runs is decided
by the scheduler."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch

from .. import dispatch
from ..model import LayerRows, PrefillChunk, Transformer
from .kv_cache import KVPool, RequestKV
from .request import RequestState
from .scheduler import StepPlan


class ModelRunner:
    def __init__(self, model: Transformer, pool: KVPool):
        self.model, self.pool = model, pool
        self._pools = pool.pools()
        # The step's slot table (L, R, 2), kept while the rows' reservations stay the same (a
        # batch keeps its requests for many steps): only the lengths change, in one op a step.
        self._slot_key: tuple = ()
        self._slots = self._per_layer = None

    @torch.inference_mode()
    def prefill(self, chunks: Sequence[tuple[RequestState, int, int]]) -> list[torch.Tensor | None]:
        """Prompt tokens ``start..end-1`` of each request at full depth into its
        slots, every chunk of the step in one packed pass; per chunk, the last
        position's logits ``(vocab,)`` when the chunk ends its prompt, else None."""
        logits = self.model.prefill([PrefillChunk(st.request.prompt_token_ids[start:end], start,
                                                  RequestKV(self.pool, st.reservation))
                                     for st, start, end in chunks])
        return [row if end == st.prompt_len else None for (st, _, end), row in zip(chunks, logits)]

    @torch.inference_mode()
    def decode(self, plan: StepPlan) -> torch.Tensor:
        """Logits ``(rows, vocab)``: first the positions of every lossless round
        to verify (its last verified token and its drafts, at full depth), then
        one row per decoding request, each feeding its last token at its own position.

        A round's positions are consecutive rows of one request: every row's
        key/value is written before any row attends, so each attends causally
        to the ones before it, as a prompt chunk would. The verifying rows
        overwrite every layer's keys/values of those positions, so each accepted
        position holds all layers; the slots of rejected drafts lie past the
        request's length and are rewritten before any read. They run in the
        kernel forms of a one-row step (``dispatch.single_row_forms``), so each
        gets 1x's logits up to fp32 summation order.
        """
        rows: list[tuple[RequestState, int, int]] = []  # (request, token fed, its position)
        for st in plan.verify:
            p0 = st.prompt_len + len(st.token_ids) - 1
            rows += [(st, t, p0 + j) for j, t in enumerate([st.token_ids[-1], *st.drafts])]
        for st in plan.decode:  # the last sampled token, or a lossless round's last draft
            rows.append((st, st.drafts[-1] if st.drafts else st.token_ids[-1], st.prompt_len + st.fed_index))
        tokens, positions = torch.tensor([[t for _, t, _ in rows], [p for _, _, p in rows]])
        # A row that runs layer l at this step ran it at every earlier step too
        # (budgets never increase; a lossless row's verified positions hold every
        # layer), so it holds prompt + steps-so-far + 1 slots there.
        # slots[l, r] = (row r's first slot in layer l's pool, its length there): each layer's
        # rows are a view of it, not a stack of their own
        per_layer = self._slot_table([st.reservation for st, _, _ in rows], positions)
        layer_rows: list[LayerRows | None] = []
        for l, (n, idx) in enumerate(plan.layers):
            if n == 0:
                layer_rows.append(None)
            elif idx is None:
                layer_rows.append(LayerRows(None, per_layer[l]) if n == len(rows) else
                                  LayerRows(n, per_layer[l][:n]))
            else:
                ix = torch.tensor(idx)
                layer_rows.append(LayerRows(ix, per_layer[l].index_select(0, ix)))
        drafts = [None] * (len(rows) - len(plan.decode)) + [st.draft_extra if st.round_size else None
                                                            for st in plan.decode]
        with dispatch.single_row_forms() if plan.verify else nullcontext():
            return self.model.decode(tokens, positions, layer_rows, self._pools, drafts)

    @torch.inference_mode()
    def greedy_burst(self, rows: Sequence[RequestState], layers: Sequence[Sequence[int]],
                     eos: Sequence[int]) -> list[list[int]]:
        """Greedy decode steps of these rows in the model's native loop (``Transformer.greedy_steps``):
        step ``s`` runs ``layers[s]`` on every row, each row feeding its last token at its next
        position, then the token picked the step before. The picks per step and row; it stops
        after a step in which a row picked one of ``eos``."""
        starts = torch.tensor([st.reservation.starts for st in rows], dtype=torch.long).T
        return self.model.greedy_steps([st.token_ids[-1] for st in rows], [st.prompt_len + st.fed_index for st in rows],
                                       layers, self._pools, starts, eos)

    def _slot_table(self, reservations: list, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every layer's ``(R, 2)`` view of the slot table for rows with these reservations at
        these positions. The starts are rebuilt only when the rows' reservations change (the
        key holds the reservations themselves, so a freed one's address is never mistaken for
        a new one's); the lengths are written in place each step. The views are read by the
        step's kernels before the next step rewrites them."""
        key = tuple(reservations)
        if key != self._slot_key or self._slots is None:
            starts = torch.tensor([r.starts for r in reservations]).T  # (L, R)
            self._slots = torch.stack([starts, starts], 2)
            self._per_layer = self._slots.unbind(0)  # every layer's view in one call
            self._slot_key = key
        self._slots[:, :, 1] = positions + 1
        return self._per_layer
