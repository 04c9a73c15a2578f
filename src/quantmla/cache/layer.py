"""One layer of the paged MLA cache as attention uses it: write, attend (absorbed form) and read (compatible path).

Implements :class:`quantmla.cache.protocol.MLACacheLayer` over layer ``idx`` of a
:class:`~quantmla.cache.store.PagedStore`. Every incoming token is quantized once, into its page, by the fused
writer on CUDA or the torch reference elsewhere (:meth:`PagedMLACache.write`); the first ``sink`` and the last
``local`` tokens are also kept in BF16. Which copy attention reads is the policy
(:meth:`~quantmla.quant.formats.CachePolicy.reads_full`), per query:

* a single new token per sequence (decode): :func:`quantmla.kernels.decode_attention` (``impl="auto"``: the
  fastest kernel for the device, the fp32 torch reference on a CPU);
* a chunk of new tokens (prefill): :func:`quantmla.kernels.prefill_attention` with the BF16 copies the chunk's
  own write pushed out of the local ring (``recent``, transient), so query ``t`` sees exactly what decoding token
  ``t`` alone would have seen;
* any other attention mask: the fp32 reference with that mask (correct, not fast).

``read()`` (the compatible path) returns the whole cache as the newest token sees it, dequantized into a tensor
that lives only as long as the caller keeps it: nothing dequantized is stored.

Batches of prompts of different lengths: left padding. On the first write ``attend`` learns each sequence's pad
positions from the attention mask (leading keys no query may see), stores only the real tokens (the sequence's
length in the cache excludes its padding, so the sink is its first real tokens) and maps the caller's key axis
onto them; each sequence then behaves as if it had been run alone. The compatible path cannot see the mask: it
stores padding like any token.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from quantmla.cache.store import PagedStore


def _shift(x: torch.Tensor, skip: list[int], dim: int, left: bool) -> torch.Tensor:
    """Per batch row ``b``, move the rows of ``dim`` by ``skip[b]`` (left: drop the first ``skip[b]`` and pad
    the end with zeros; right: the inverse)."""
    if not any(skip):
        return x
    out = torch.zeros_like(x)
    T = x.shape[dim]
    for b, s in enumerate(skip):
        src = x[b].narrow(dim - 1, s if left else 0, T - s)
        out[b].narrow(dim - 1, 0 if left else s, T - s).copy_(src)
    return out


def _profiled(name: str):
    """A ``torch.profiler`` range named ``name`` while a profiler records (``benchmarks/step_profile.py --prefill``
    attributes device time with them), else nothing: not even the range's own dispatch (~5 us) outside profiling."""
    on = getattr(torch.autograd, "_profiler_enabled", None)  # private in torch: absent -> never a range
    return torch.profiler.record_function(name) if on is not None and on() else contextlib.nullcontext()


def _mask_key(m: torch.Tensor, extra: tuple) -> tuple[torch.Tensor, tuple]:
    """The tensor whose identity and version say ``m``'s content is unchanged (its base: views share the base's
    version counter), and the rest of what a mask check's answer depends on."""
    base = m if m._base is None else m._base
    return base, (base._version, m.storage_offset(), tuple(m.shape), m.stride(), m.dtype, m.device, extra)


class PagedCacheLayer:
    """Layer ``idx`` of ``store`` (see the module docstring)."""

    def __init__(self, store: PagedStore, idx: int):
        self.store, self.idx = store, idx
        self._staged: tuple[torch.Tensor, torch.Tensor] | None = None  # written, not yet stored (see attend)
        self.last_mask_causal: bool | None = None  # what the last attend found its mask to be (None: no call yet)
        self.trust_causal_mask = False  # set by quantmla.cache.graph while capturing: see _pads_and_causal

    @property
    def fmt(self):
        return self.store.layouts[self.idx].fmt

    @property
    def policy(self):
        return self.store.policy

    @property
    def view(self):
        """The kernels' view of this layer (a :class:`~quantmla.kernels.paged.PagedMLACache`)."""
        return self.store.layer(self.idx)

    @property
    def batch(self) -> int | None:
        return self.store.batch if self.store.started else None

    def _stored_length(self) -> int:
        """Length of the caller's key axis already stored (padding included; equal for every sequence)."""
        if not self.store.started or not self.store.batch:
            return 0
        lens = self.view.lengths()
        return lens[0] + self.store.pads[0] if any(lens) else 0  # the layers of a store fill one after another

    def get_seq_length(self) -> int:
        return self._stored_length() + (0 if self._staged is None else self._staged[0].shape[1])

    @property
    def length(self) -> int:
        return self.get_seq_length()

    # -- writing ----------------------------------------------------------------------------------
    def _check(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        if not (isinstance(c_kv, torch.Tensor) and isinstance(k_pe, torch.Tensor)):
            raise TypeError(f"c_kv and k_pe must be tensors, got {type(c_kv).__name__} and {type(k_pe).__name__}")
        if c_kv.dim() != 3 or k_pe.dim() != 3:
            raise ValueError(
                f"write expects c_kv [B, T, Dc] and k_pe [B, T, Dr], got shapes {tuple(c_kv.shape)} and "
                f"{tuple(k_pe.shape)}"
            )
        if c_kv.shape[:2] != k_pe.shape[:2]:
            raise ValueError(f"c_kv {tuple(c_kv.shape)} and k_pe {tuple(k_pe.shape)} disagree on [B, T]")
        if not (torch.is_floating_point(c_kv) and torch.is_floating_point(k_pe)):
            raise TypeError(f"c_kv and k_pe must be floating point, got {c_kv.dtype} and {k_pe.dtype}")
        if c_kv.dtype != k_pe.dtype:
            raise TypeError(f"c_kv ({c_kv.dtype}) and k_pe ({k_pe.dtype}) must share a dtype")
        if c_kv.device != k_pe.device:
            raise ValueError(f"c_kv is on {c_kv.device} but k_pe on {k_pe.device}")
        L = self.store.layouts[self.idx]
        if (c_kv.shape[-1], k_pe.shape[-1]) != (L.kv_lora_rank, L.rope_dim):
            raise ValueError(
                f"cache holds widths (content {L.kv_lora_rank}, rope {L.rope_dim}) but got "
                f"({c_kv.shape[-1]}, {k_pe.shape[-1]})"
            )
        st = self.store
        if st.dtype is not None and c_kv.dtype != st.dtype:
            raise TypeError(f"cache holds {st.dtype} but got {c_kv.dtype}")
        if st.started:
            if c_kv.shape[0] != st.batch:
                raise ValueError(f"cache holds batch {st.batch} but got a write of batch {c_kv.shape[0]}")
            if c_kv.device != st.device:
                raise ValueError(f"cache lives on {st.device} but got tensors on {c_kv.device}")

    def write(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Append T tokens: ``c_kv`` [B, T, Dc] and ``k_pe`` [B, T, Dr] (after RoPE). Stored at once unless the
        next call is :meth:`attend` (which first learns the batch's padding from its mask)."""
        self._check(c_kv, k_pe)
        self.flush()
        self._staged = (c_kv, k_pe)

    def flush(self) -> None:
        """Store a pending write (no padding)."""
        if self._staged is not None:
            staged, self._staged = self._staged, None
            self._store(*staged, skip=None)

    def _store(self, c_kv: torch.Tensor, k_pe: torch.Tensor, skip: list[int] | None, want_recent: bool = False):
        """Store the last ``T - skip[b]`` rows of sequence ``b``; returns (n_new, recent window if wanted)."""
        B, T = c_kv.shape[:2]
        st = self.store
        skip = skip or [0] * B
        if T == 0:
            return [0] * B, None
        if not st.started:
            st.start(B, c_kv.device, T)
            st.pads = list(skip)
        elif any(skip) and (any(self.view.lengths()) or st.pads != skip):
            raise ValueError(
                f"padding {skip} in a later write or differing between layers (first write: {st.pads}); only "
                "left padding of the first chunk is supported"
            )
        st.dtype = c_kv.dtype
        n_new = [T - s for s in skip]
        c_kv, k_pe = _shift(c_kv, skip, 1, left=True), _shift(k_pe, skip, 1, left=True)
        old = self.view.lengths()
        st.prepare([o + k for o, k in zip(old, n_new)])
        view = self.view
        recent = None
        if want_recent and self.fmt.is_quantized and view.n_local and max(n_new) > 1:
            recent = view.recent_window(c_kv, k_pe, old, n_new)
        view.write(c_kv, k_pe, n_new)
        return n_new, recent

    # -- attention ------------------------------------------------------------------------------
    def _pads_and_causal(self, mask, B: int, T: int, S: int, first: bool) -> tuple[list[int], bool]:
        """Leading pad positions per sequence (first write only) and whether ``mask`` is plain causal attention
        over each sequence's real tokens (so the kernels' fast paths apply).

        The check reads the mask on the host, which a CUDA graph capture forbids: while
        :class:`~quantmla.cache.graph.CapturedDecode` captures its step it sets ``trust_causal_mask``, after the
        eager warm-up step of the same shapes found the mask plain causal in this layer (``last_mask_causal``);
        a first write (which learns the padding) is checked always."""
        if mask is None:
            self.last_mask_causal = True
            return [0] * B, True
        m = mask.to(torch.bool)
        if m.dim() != 4 or m.shape[-2:] != (T, S) or m.shape[0] not in (1, B):
            raise ValueError(f"attention mask must be bool [B, 1 or H, T={T}, S={S}], got {tuple(mask.shape)}")
        if self.trust_causal_mask and not first:
            return [0] * B, True
        # transformers hands every layer of a forward the same mask (views of one tensor): check it once, reuse the
        # answer while that very tensor (a weak reference: never a new one at the same address) is unchanged
        base, key = _mask_key(m, (B, T, S, first, None if first else tuple(self.store.pads)))
        memo = self.store.mask_memo
        if memo is not None and memo[0]() is base and memo[1] == key:
            skip, causal = memo[2]
            self.last_mask_causal = causal
            return list(skip), causal
        skip, causal = self._check_mask(m, B, T, S, first)
        self.store.mask_memo = (weakref.ref(base), key, (tuple(skip), causal))
        return skip, causal

    def _check_mask(self, m: torch.Tensor, B: int, T: int, S: int, first: bool) -> tuple[list[int], bool]:
        """The check itself: elementwise over ``[B, T, S]``, read on the host."""
        self.store.mask_checks += 1
        m = m.expand(B, m.shape[1], T, S)
        skip = [0] * B
        if first:
            unseen = (~m.any(dim=(1, 2))).int().cpu()  # [B, S] keys no query may see
            skip = [int(u) for u in unseen.cumprod(1).sum(1)]  # leading run of them
            for b, s in enumerate(skip):
                if s >= T:
                    raise ValueError(f"sequence {b} of the batch has no token any query may attend to")
        pads = torch.tensor(skip if first else self.store.pads, device=m.device)[:, None, None]  # [B, 1, 1]
        qpos = torch.arange(S - T, S, device=m.device)[None, :, None]  # [1, T, 1]
        j = torch.arange(S, device=m.device)[None, None, :]
        want = (j >= pads) & (j <= qpos)  # [B, T, S]
        real = qpos >= pads  # [B, T, 1] queries of real tokens
        causal = not bool(((m != want[:, None]) & real[:, None]).any())
        self.last_mask_causal = causal
        return skip, causal

    attends_per_head = True  # attend(..., heads=...) is understood (quantmla.mla.attention asks)

    def attend(
        self,
        q_lat: torch.Tensor,
        q_pe: torch.Tensor,
        scale: float,
        mask: torch.Tensor | None = None,
        *,
        heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Absorbed attention of the T newest tokens' queries over the cache, per-query policy.

        q_lat [B, H, T, Dc], q_pe [B, H, T, Dr]; mask None (causal) or bool broadcastable to [B, H, T, S] over the
        caller's key axis. Returns o_lat [B, H, T, Dc] fp32 (0 for padding queries). With ``heads = (q_nope [B, H,
        T, Dn], W_UK [H, Dn, Dc], W_UV [H, Dv, Dc])`` it returns the per-head outputs ``W_UV o_lat`` [B, H, T, Dv]
        instead, and a causal chunk of several tokens runs per head
        (:func:`quantmla.kernels.dispatch.prefill_attention_heads`, ~3.4x fewer multiply-adds on the GPU)."""
        from quantmla.kernels.dispatch import decode_attention, prefill_attention, prefill_attention_heads
        from quantmla.kernels.reference import prefill_attention_torch

        if q_lat.dim() != 4 or q_pe.dim() != 4 or q_pe.shape[:3] != q_lat.shape[:3]:
            raise ValueError(f"q_lat {tuple(q_lat.shape)} and q_pe {tuple(q_pe.shape)} must be [B, H, T, D] alike")
        B, H, T, _ = q_lat.shape
        staged, self._staged = self._staged, None
        if staged is not None and staged[0].shape[1] != T:
            self._store(*staged, skip=None)
            raise ValueError(f"{T} queries but the last write held {staged[0].shape[1]} tokens")
        S0 = self._stored_length()
        S = S0 + (T if staged is not None else 0)
        if T > S:
            raise ValueError(f"{T} queries but only {S} cached tokens: write the new tokens before attending")
        if self.store.started and B != self.store.batch or staged is not None and staged[0].shape[0] != B:
            raise ValueError(f"{B} query sequences for a cache of batch {self.batch or staged[0].shape[0]}")
        with _profiled("quantmla.mask"):
            skip, causal = self._pads_and_causal(mask, B, T, S, first=S0 == 0 and staged is not None)
        with _profiled("quantmla.store"):
            n_new, recent = self._store(*staged, skip=skip, want_recent=True) if staged is not None else ([T] * B, None)
        view = self.view
        ql, qp = _shift(q_lat, skip, 2, left=True), _shift(q_pe, skip, 2, left=True)
        if causal and T == 1:
            o = decode_attention(ql[:, :, 0], qp[:, :, 0], view, scale)[:, :, None]  # [B, H, 1, Dc]
            if not all(n_new):  # a sequence without a new token (padding only) gets 0
                o = o * torch.tensor([k > 0 for k in n_new], device=o.device)[:, None, None, None]
        elif causal and heads is not None:
            q_nope, w_uk, w_uv = heads
            qn = _shift(q_nope, skip, 2, left=True)
            with _profiled("quantmla.prefill_attention"):
                o = prefill_attention_heads(qn, qp, view, w_uk, w_uv, scale, n_new, recent=recent)  # [B, H, T, Dv]
            return _shift(o, skip, 2, left=False)
        else:
            with _profiled("quantmla.prefill_attention"):
                if causal:
                    o = prefill_attention(ql, qp, view, scale, n_new, recent=recent)
                else:
                    o = prefill_attention_torch(ql, qp, view, scale, n_new, recent=recent,
                                                mask=self._cache_mask(mask, skip))  # fmt: skip
        if heads is not None:
            o = torch.einsum("bhtc,hvc->bhtv", o, heads[2].to(o.dtype))  # [B, H, T, Dv]
        return _shift(o, skip, 2, left=False)

    def _cache_mask(self, mask: torch.Tensor, skip: list[int]) -> torch.Tensor:
        """The caller's mask [B, h, T, S] over cache positions: key ``j`` -> ``j - pads[b]``; query rows as shifted."""
        m = mask.to(torch.bool)
        B = len(skip)
        m = m.expand(B, *m.shape[1:])
        pads = self.store.pads
        out = torch.zeros_like(m)
        for b in range(B):
            S = m.shape[-1]
            out[b, :, :, : S - pads[b]] = m[b, :, :, pads[b] :]
        return _shift(out, skip, 2, left=True)

    # -- compatible path --------------------------------------------------------------------------
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache as the newest token sees it: [B, S, Dc], [B, S, Dr] in the written dtype (padding rows 0).

        A fresh tensor each call (the transient workspace of the compatible path), dequantized from the pages."""
        self.flush()
        st = self.store
        L = st.layouts[self.idx]
        if not st.started:
            raise RuntimeError("the cache is empty: write before reading")
        view, S = self.view, self._stored_length()
        out = torch.zeros(st.batch, S, L.kv_lora_rank + L.rope_dim, dtype=torch.float32, device=st.device)
        for b, n in enumerate(view.lengths()):
            out[b, st.pads[b] : st.pads[b] + n] = view.read_tokens(b, n)
        k_pe = view.rope_key_out(out[..., L.kv_lora_rank :])  # (a post-RoPE rotation undone: the model's queries)
        return out[..., : L.kv_lora_rank].to(st.dtype), k_pe.to(st.dtype)
