"""Per-request BF16 sink/local copies for a serving engine whose batch rows move between steps.

Where they live: one :class:`RequestStateTable` per engine worker holds, for every layer, ``sink [L, R, s, D]``
and ``local [L, R, w, D]`` BF16 tensors (``R`` = the most requests the engine runs at once, vLLM's
``max_num_seqs``; ``D = Dc + Dr``), allocated once when the attention backend is built, so that a serving
engine that measures its memory before sizing the KV cache counts them (see docs/serving.md).

Rows follow the engine's batch: before each step :meth:`arrange` is given the request ids in the order of the
step's batch rows and permutes the table so that row ``b`` holds the request in batch row ``b``; the kernels
then read ``sink[layer, :B]`` / ``local[layer, :B]`` as plain ``[B, ...]`` views (no gather per layer).
Requests not in this step keep their rows (after the batch); :meth:`finish` frees rows. vLLM does not tell its
workers about a preemption, so a preempted request keeps its row until it is recomputed (and restarts the row)
or finishes: with ``grow=True`` the table then grows past ``max_num_seqs`` rows (logged, outside vLLM's memory
plan) instead of failing mid-serve; without it that is an error. A request that
(re)starts at position 0 (new, or recomputed after a preemption) gets its row refilled with NaN by
:meth:`restart`, so a copy that was never written cannot be read silently. A request whose first write starts
past position 0 (a prefix-cache hit) has no BF16 copies of its earlier tokens: that is an error.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)
_NAN_BYTE = 0xFF  # bf16 0xFFFF is a NaN


class RequestStateTable:
    def __init__(
        self,
        num_layers: int,
        max_requests: int,
        sink: int,
        local: int,
        width: int,
        *,
        device: torch.device | str = "cpu",
        grow: bool = False,
    ) -> None:
        if num_layers <= 0 or max_requests <= 0:
            raise ValueError(f"num_layers and max_requests must be positive, got {num_layers}, {max_requests}")
        self.num_layers, self.max_requests, self.grow, self.planned_rows = num_layers, max_requests, grow, max_requests
        self.sink = torch.empty(num_layers, max_requests, sink, width, dtype=torch.bfloat16, device=device)
        self.local = torch.empty(num_layers, max_requests, local, width, dtype=torch.bfloat16, device=device)
        self.sink.view(torch.uint8).fill_(_NAN_BYTE)
        self.local.view(torch.uint8).fill_(_NAN_BYTE)
        self._row: dict[str, int] = {}  # live request id -> row
        self._batch: list[str] = []

    # -- bookkeeping --------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes of the whole table (what the engine's memory plan must count)."""
        return self.sink.numel() * 2 + self.local.numel() * 2

    def live(self) -> dict[str, int]:
        return dict(self._row)

    def arrange(self, req_ids: list[str]) -> None:
        """Make row ``b`` hold request ``req_ids[b]`` (new ids get a free row); other live requests keep theirs
        after the batch. Moves rows only when the order changed."""
        if len(set(req_ids)) != len(req_ids):
            raise ValueError(f"duplicate request ids in one batch: {req_ids}")
        new = [r for r in req_ids if r not in self._row]
        if len(self._row) + len(new) > self.max_requests and self.grow:
            self._grow(len(self._row) + len(new))
        if len(self._row) + len(new) > self.max_requests:
            raise RuntimeError(
                f"{len(self._row) + len(new)} live requests but the BF16 sink/local table has {self.max_requests} "
                "rows (max_num_seqs); finished requests must be released with finish()"
            )
        used = set(self._row.values())
        free = [r for r in range(self.max_requests) if r not in used]
        for rid in new:
            row = free.pop(0)
            self._row[rid] = row
            self._fill_nan(row)
        want = list(req_ids) + [r for r in self._row if r not in set(req_ids)]
        src = [self._row[r] for r in want]
        src += [r for r in range(self.max_requests) if r not in set(src)]
        if src != list(range(self.max_requests)):
            perm = torch.tensor(src, device=self.sink.device)
            self.sink.copy_(self.sink.index_select(1, perm))
            self.local.copy_(self.local.index_select(1, perm))
            self._row = {r: i for i, r in enumerate(want)}
        self._batch = list(req_ids)

    def _grow(self, need: int) -> None:
        rows = max(need, 2 * self.max_requests)
        extra = rows - self.max_requests
        shape = lambda t: (t.shape[0], extra, *t.shape[2:])  # noqa: E731
        pad = [torch.full(shape(t), float("nan"), dtype=t.dtype, device=t.device) for t in (self.sink, self.local)]
        self.sink, self.local = torch.cat([self.sink, pad[0]], 1), torch.cat([self.local, pad[1]], 1)
        log.warning(
            "quantmla: %d live requests (running or preempted and not yet recomputed) but the BF16 sink/local table "
            "was planned for %d (max_num_seqs); grew it to %d rows (%d B beyond vLLM's memory plan)",
            need, self.planned_rows, rows, (rows - self.planned_rows) * self.nbytes // rows,
        )
        self.max_requests = rows

    def restart(self, req_id: str, layer: int) -> None:
        """The request starts again at position 0 (new or recomputed): forget its copies in ``layer``."""
        self._fill_nan(self._row[req_id], layer)

    def finish(self, req_ids) -> None:
        """Release the rows of finished (or preempted) requests; unknown ids are ignored."""
        for rid in req_ids:
            row = self._row.pop(rid, None)
            if row is not None:
                self._fill_nan(row)
        self._batch = [r for r in self._batch if r in self._row]

    def row_of(self, req_id: str) -> int:
        return self._row[req_id]

    # -- views for the kernels ----------------------------------------------------------------------
    def batch_views(self, layer: int, batch: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``sink [batch, s, D]`` and ``local [batch, w, D]`` of ``layer`` for batch rows ``start .. start + batch``
        (the whole arranged batch, or the decode or prefill rows of it)."""
        if start < 0 or batch < 0 or start + batch > len(self._batch):
            raise RuntimeError(
                f"the batch has {len(self._batch)} arranged rows, not rows {start}..{start + batch - 1}; call "
                "arrange() first"
            )
        return self.sink[layer, start : start + batch], self.local[layer, start : start + batch]

    def _fill_nan(self, row: int, layer: int | None = None) -> None:
        layers = slice(None) if layer is None else slice(layer, layer + 1)
        self.sink[layers, row].view(torch.uint8).fill_(_NAN_BYTE)
        self.local[layers, row].view(torch.uint8).fill_(_NAN_BYTE)
