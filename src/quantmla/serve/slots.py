"""Cache sizing for a serving engine: page bytes per vLLM block, per-request BF16 state bytes, usable slots.

vLLM sizes its KV cache as ``num_blocks = budget // (page bytes per block x layers)``; every block holds
``block_size`` tokens ("slots") and block 0 is vLLM's null block, so requests can use ``(num_blocks - 1) x
block_size`` slots (the paper's Table 10 counts them so: 657,856 BF16 slots = 10,280 blocks of 64).
For a QuantMLA format a block is one page of :class:`PagedLayout` (the
packed store: codes + fp16 meta, 16-byte aligned regions); the BF16 sink/local copies live outside the pages,
per request and layer (:mod:`quantmla.serve.request_state`), so they come off the budget first for the
``max_num_seqs`` requests vLLM may run at once. BF16 has no such state: a block is ``block_size x 1152`` bytes.

No vLLM import here: the plugin and ``benchmarks/serve_table10.py`` both use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantmla.kernels.paged import PagedLayout
from quantmla.quant.formats import CachePolicy, get_format

#: vLLM ``--kv-cache-dtype`` names of our formats -> quantmla format names.
CACHE_DTYPES: dict[str, str] = {
    "quantmla_c8r8": "c8r8", "quantmla_c4r4": "c4r4", "quantmla_c2r4": "c2r4",
    "quantmla_c4r4t": "c4r4t", "quantmla_c2r4t": "c2r4t",  # one content scale per token (Hopper kernel)
}  # fmt: skip


def format_of_cache_dtype(cache_dtype: str) -> str:
    """quantmla format name of a vLLM cache dtype (``quantmla_c4r4`` -> ``c4r4``); clear error otherwise."""
    try:
        return CACHE_DTYPES[cache_dtype]
    except KeyError:
        raise ValueError(
            f"{cache_dtype!r} is not a QuantMLA cache dtype; use one of {sorted(CACHE_DTYPES)}"
        ) from None


@dataclass(frozen=True)
class ServeGeometry:
    """What the cache needs to know about a model and an engine configuration."""

    fmt: str  # quantmla format name ("bf16", "c4r4", ...)
    num_layers: int
    block_size: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    sink: int = 4
    local: int = 128

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.block_size <= 0:
            raise ValueError(f"num_layers and block_size must be positive, got {self.num_layers}, {self.block_size}")

    @property
    def layout(self) -> PagedLayout:
        fmt = get_format(self.fmt)
        fmt = fmt.adapted(self.kv_lora_rank, self.rope_dim) if hasattr(fmt, "adapted") else fmt
        return PagedLayout(fmt, self.kv_lora_rank, self.rope_dim, self.block_size)

    @property
    def quantized(self) -> bool:
        return get_format(self.fmt).is_quantized

    @property
    def policy(self) -> CachePolicy:
        return CachePolicy(sink=self.sink, local=self.local, page_size=self.block_size)

    def block_bytes(self) -> int:
        """Bytes of one block (page) of one layer, as vLLM's KV cache spec must report them."""
        return self.layout.page_bytes

    def state_bytes_per_request(self) -> int:
        """BF16 sink + local copies of one request, all layers (0 for BF16)."""
        if not self.quantized:
            return 0
        return (self.sink + self.local) * self.layout.bf16_slot_bytes * self.num_layers

    def num_blocks(self, budget_bytes: int, max_num_seqs: int) -> int:
        """Blocks vLLM can allocate from ``budget_bytes`` once the per-request state for ``max_num_seqs``
        requests is set aside."""
        free = budget_bytes - max_num_seqs * self.state_bytes_per_request()
        if free <= 0:
            raise ValueError(
                f"the BF16 sink/local state of {max_num_seqs} requests ({max_num_seqs * self.state_bytes_per_request()}"
                f" B) does not fit in {budget_bytes} B; lower max_num_seqs"
            )
        return free // (self.block_bytes() * self.num_layers)

    def usable_slots(self, budget_bytes: int, max_num_seqs: int) -> int:
        """Token slots requests can use: vLLM keeps block 0 as its null block."""
        return (self.num_blocks(budget_bytes, max_num_seqs) - 1) * self.block_size
