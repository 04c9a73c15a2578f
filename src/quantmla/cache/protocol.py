"""The interface between MLA attention in absorbed form and a cache that stores the latent.

An attention module in absorbed form computes, per layer, the query in latent space
``q_lat = q_nope @ W_UK`` [B, H, T, Dc] and the rotated query RoPE part ``q_pe`` [B, H, T, Dr], writes
the new tokens' latent ``c_kv`` [B, T, Dc] and rotated RoPE key ``k_pe`` [B, T, Dr] into the cache, and
asks the cache for the latent-space attention output ``o_lat`` [B, H, T, Dc] (one softmax over every
valid cached token, the T new ones included). The cache decides how the tokens are stored (packed
low-bit copies, BF16 sink/local buffers) and how attention reads them (torch reference or kernel).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class MLACacheLayer(Protocol):
    def write(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append T tokens: ``c_kv`` [B, T, Dc], ``k_pe`` [B, T, Dr] (after RoPE)."""

    def attend(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        scale: float,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Latent-space attention output ``o_lat`` [B, H, T, Dc] (fp32) for queries of the T newest tokens.

        ``mask``: None means causal (query t sees cached tokens ``0 .. S - T + t``), else a bool tensor
        broadcastable to [B, H, T, S], True where attention is allowed.
        """

    def get_seq_length(self) -> int:
        """Number of tokens stored."""


def get_mla_layer(cache: Any, layer_idx: int) -> MLACacheLayer | None:
    """The cache's absorbed-form layer ``layer_idx``, or None for caches that only speak ``update``."""
    fn = getattr(cache, "mla_layer", None)
    return None if fn is None else fn(layer_idx)
