"""What one vLLM worker process holds for the QuantMLA cache beside vLLM's pages (no vLLM import here).

One :class:`WorkerCache` per engine configuration in a process: the geometry (format, widths, block size, policy),
one :class:`~quantmla.serve.core.ServeLayer` per MLA layer of this worker (in construction order, which is layer
order), and the per-request BF16 sink/local table (:class:`~quantmla.serve.request_state.RequestStateTable`,
``[layers, max_num_seqs, ...]``), allocated when the first layer's attention is built -- before vLLM measures
memory, so a GPU worker counts it as it counts the weights and sizes the KV cache from what is left.

Per step: the model runner hook (:mod:`quantmla.serve.vllm.adapter`) reports the batch rows' request ids
(:meth:`WorkerCache.set_rows`) and the finished ones (:meth:`WorkerCache.finish`); the metadata builder turns
the reported rows into the step's order (:meth:`WorkerCache.begin_step`, which arranges the table); each layer's
write leaves the BF16 rows its prefill queries need (``recent``) for that layer's attention call.
"""

from __future__ import annotations

import torch

from quantmla.kernels.paged import PagedLayout
from quantmla.quant.formats import get_format
from quantmla.quant.rounding import RopeRounding
from quantmla.serve.core import ServeLayer
from quantmla.serve.request_state import RequestStateTable
from quantmla.serve.slots import ServeGeometry


class WorkerCache:
    def __init__(self, geometry: ServeGeometry, max_num_seqs: int, device: torch.device | str, *,
                 impl: str = "auto", rope_rounding: dict[int, RopeRounding] | None = None,
                 first_layer: int = 0) -> None:  # fmt: skip
        """``rope_rounding``: {model layer: plan} (the checkpoint's ``quantmla_rope_rounding.st``); this worker's
        layers are the model's ``first_layer ..`` (pipeline parallelism)."""
        self.geometry, self.impl = geometry, impl
        self.first_layer = first_layer
        plans = dict(rope_rounding or {})
        if plans and get_format(geometry.fmt).rope is None:
            plans = {}  # a BF16 RoPE key (or a BF16 cache) is stored as it is: nothing to round
        self.rope_rounding = {i: p.to(device) for i, p in plans.items()}
        self.layout: PagedLayout = geometry.layout
        self.layers: list[ServeLayer] = []
        self.table: RequestStateTable | None = None
        g = geometry
        if g.quantized:
            width = g.kv_lora_rank + g.rope_dim
            self.table = RequestStateTable(g.num_layers, max_num_seqs, g.sink, g.local, width, device=device, grow=True)
        self.reported_rows: list[str] | None = None  # request ids of the runner's batch rows, this step
        self.hook_seen = False
        self.recent: dict[int, torch.Tensor | None] = {}  # layer -> BF16 rows its prefill may read (this step)

    @property
    def state_bytes(self) -> int:
        """Bytes of the BF16 sink/local table (0 for BF16)."""
        return 0 if self.table is None else self.table.nbytes

    def add_layer(self) -> ServeLayer:
        """The next MLA layer of this worker (layers are built in order)."""
        if len(self.layers) >= self.geometry.num_layers:
            raise RuntimeError(
                f"more MLA attention layers than the {self.geometry.num_layers} this worker was planned for "
                "(a draft/MTP model sharing the engine is not supported)"
            )
        plan = self.rope_rounding.get(self.first_layer + len(self.layers))
        layer = ServeLayer(self.layout, len(self.layers), impl=self.impl, rope_rounding=plan)
        self.layers.append(layer)
        return layer

    # -- per step -----------------------------------------------------------------------------------
    def set_rows(self, req_ids: list[str] | None) -> None:
        self.reported_rows = None if req_ids is None else list(req_ids)
        self.hook_seen = True

    def begin_step(self, num_reqs: int) -> list[str] | None:
        """The request ids of the step's ``num_reqs`` batch rows, with the state table arranged to them; None for
        a batch that is not real requests (vLLM's profiling and warm-up runs), which the backend then skips."""
        if not self.hook_seen:
            raise RuntimeError(
                "vLLM's model runner did not report its batch rows to the QuantMLA backend (a model runner other than "
                "the V1 GPUModelRunner/CPUModelRunner?): set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        rows = self.reported_rows
        if rows is None or len(rows) != num_reqs or any(r is None for r in rows):
            return None
        if self.table is not None:
            self.table.arrange(rows)
        self.recent.clear()
        return rows

    def finish(self, req_ids) -> None:
        """Forget finished (or reported-preempted) requests."""
        if self.table is not None and req_ids:
            self.table.finish(list(req_ids))


_WORKERS: dict[int, tuple[object, WorkerCache]] = {}


def worker_cache(key_owner: object) -> WorkerCache | None:
    """The :class:`WorkerCache` registered for ``key_owner`` (the engine's config object) in this process."""
    hit = _WORKERS.get(id(key_owner))
    return hit[1] if hit is not None and hit[0] is key_owner else None


def register_worker_cache(key_owner: object, cache: WorkerCache) -> WorkerCache:
    _WORKERS[id(key_owner)] = (key_owner, cache)
    return cache


def all_worker_caches() -> list[WorkerCache]:
    return [c for _, c in _WORKERS.values()]
