"""A decode step over a ``QuantMLACache`` captured once in a CUDA graph and replayed for every new token.

An eager decode step of a transformers MLA model is thousands of small launches (~106-125 top-level operators per
layer, ``benchmarks/step_profile.py``): on the H200 the DeepSeek-V2-Lite-shaped model takes 63-69 ms a step for
every cache format, while its attention kernels take 6-9 ms of it. Replaying a captured step removes the launch
overhead, so the cache's speed shows in the time per token.

What makes the step capturable (nothing in it may read device values on the host, or change shape):

* the batch, every sequence at the same length, no padding: one ``cache_position`` for all, which lives in a
  device tensor advanced after every replay; the attention mask the model builds for a one-token query (none, or
  the plain causal one, depending on the transformers version) is checked on the host by the eager warm-up step
  and trusted while capturing (:meth:`quantmla.cache.layer.PagedCacheLayer._pads_and_causal`);
* every page a sequence can reach is reserved before the capture (the block table never changes) and the decode
  kernels plan their splits for the capacity (:attr:`~quantmla.kernels.paged.PagedMLACache.planned_length`),
  not for today's length: one captured launch serves every later length, the splits past the end do nothing;
* the writer's start positions come from the device lengths (it already does so for a decode step), which the
  captured step advances itself; after each replay only the host mirror of the lengths is advanced.

Capturing needs one eager step first (kernel builds, workspaces): it writes a token at the current position
(overwritten by the first real step) and into one slot of each layer's BF16 local ring, which this module saves
before and restores after, then rolls the lengths back. CUDA only; the eager path stays the reference (a GPU test
compares the two token by token).
"""

from __future__ import annotations

import torch

from quantmla.compat import with_cache


def decode_step(model, cache, ids: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """One decode forward of ``ids [B, 1]`` at ``position`` (a one-element device tensor: every sequence's cache
    position) -> the logits ``[B, V]``: what :class:`CapturedDecode` captures, and its eager reference."""
    pos_ids = position[None].expand(ids.shape[0], 1)
    out = model(input_ids=ids, cache_position=position, position_ids=pos_ids, use_cache=True, logits_to_keep=1,
                **with_cache(cache))  # fmt: skip
    return out.logits[:, -1]


def _check_kernels(views) -> None:
    """Refuse layers whose decode or write would run the torch reference: it loops over the host's lengths, which a
    captured step would freeze at capture time (a silent wrong result on every later step)."""
    from quantmla.kernels.dispatch import resolve_impl

    for i, v in enumerate(views):
        x = v.sink if v.sink.numel() else v.pool
        for kernel in ("decode", "write"):
            impl = resolve_impl("auto", x, v.fmt, kernel=kernel, layout=v.layout, cache=v)
            if impl == "torch":
                raise ValueError(
                    f"layer {i} ({v.fmt.name}, latent {v.layout.kv_lora_rank}, RoPE {v.layout.rope_dim}, pages of "
                    f"{v.layout.page_size}) has no GPU {kernel} kernel here (the torch reference would run, which a "
                    "captured step cannot replay): decode it eagerly"
                )


class CapturedDecode:
    """One decode step of ``model`` (absorbed attention enabled) over ``cache`` captured in a CUDA graph.

    ``cache`` must already hold every sequence's prompt (same length, no padding); ``max_length`` (default: the
    cache's own ``max_length``) is the longest the sequences may grow, reserved now. :meth:`step` takes the next
    token ids ``[B, 1]`` and returns the last position's logits ``[B, V]`` (fp32, a fresh tensor)."""

    def __init__(self, model, cache, *, max_length: int | None = None):
        store = cache.store
        if not store.started:
            raise ValueError("the cache is empty: run the prompt through the model with this cache first")
        if store.device is None or store.device.type != "cuda":
            raise ValueError(f"a captured decode step needs the cache on a CUDA device, got {store.device}")
        if any(store.pads):
            raise ValueError(f"a captured decode step needs a batch without padding (left pads {store.pads})")
        lens = store.layer(0).lengths()
        if len(set(lens)) != 1 or any(store.layer(i).lengths() != lens for i in range(len(store.layouts))):
            raise ValueError(f"a captured decode step needs every sequence at the same length, got {lens}")
        cap = max_length if max_length is not None else store.max_length
        if cap is None:
            raise ValueError("give max_length (the longest the sequences may grow) or create the cache with one")
        if cap <= lens[0]:
            raise ValueError(f"max_length={cap} leaves no room past the {lens[0]} cached tokens")
        store.prepare([cap] * store.batch)  # widen / grow so that every reachable page exists (may rebind views)
        store.table.reserve([cap] * store.batch, store.policy.page_size)
        views = [store.layer(i) for i in range(len(store.layouts))]
        _check_kernels(views)
        for v in views:
            v.planned_length = cap
        self.model, self.cache, self.views, self.capacity = model, cache, views, cap
        dev = store.device
        self.ids = torch.zeros(store.batch, 1, dtype=torch.long, device=dev)
        self.position = torch.full((1,), lens[0], dtype=torch.long, device=dev)  # cache_position
        self.graph = torch.cuda.CUDAGraph()
        self._capture()

    @property
    def length(self) -> int:
        """Tokens every sequence holds (the host mirror of the cache's lengths)."""
        return self.views[0].lengths()[0]

    def _forward(self) -> torch.Tensor:
        return decode_step(self.model, self.cache, self.ids, self.position)

    def _capture(self) -> None:
        slot = [self.length % v.n_local if v.n_local else None for v in self.views]
        saved = [None if s is None else v.local[:, s].clone() for v, s in zip(self.views, slot)]
        side = torch.cuda.Stream(device=self.position.device)
        side.wait_stream(torch.cuda.current_stream())
        layers = [layer.mla for layer in self.cache.layers]
        for layer in layers:
            layer.last_mask_causal = None
        with torch.no_grad(), torch.cuda.stream(side):
            self._forward()  # eager: builds, workspaces; writes one token (undone below)
        torch.cuda.current_stream().wait_stream(side)
        self._rollback(device=True)
        odd = [i for i, layer in enumerate(layers) if layer.last_mask_causal is not True]
        if odd:
            self._restore_ring(slot, saved)
            raise ValueError(f"layers {odd} saw an attention mask other than plain causal attention in a decode step "
                             "(or were not called): such a step cannot be captured; decode it eagerly")  # fmt: skip
        try:
            for layer in layers:
                layer.trust_causal_mask = True  # the mask of every replay is the warm-up's, checked just now
            with torch.no_grad(), torch.cuda.graph(self.graph):
                self.logits = self._forward()  # recorded, not run: only the host mirrors moved
        finally:
            for layer in layers:
                layer.trust_causal_mask = False
        self._rollback(device=False)
        self._restore_ring(slot, saved)
        torch.cuda.current_stream().synchronize()

    def _restore_ring(self, slot, saved) -> None:
        """Put back the local-ring slot of each layer that the warm-up step wrote."""
        for v, s, x in zip(self.views, slot, saved):
            if s is not None:
                v.local[:, s].copy_(x)

    def _rollback(self, device: bool) -> None:
        """Undo one step's length bookkeeping (host mirrors; with ``device`` the device lengths too)."""
        for v in self.views:
            v.advance_host(-1)
            if device:
                v.seq_lens.sub_(1)

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Write the tokens ``input_ids [B, 1]`` and return the next-token logits ``[B, V]`` (fp32)."""
        if tuple(input_ids.shape) != tuple(self.ids.shape):
            raise ValueError(f"input_ids must be {tuple(self.ids.shape)}, got {tuple(input_ids.shape)}")
        if self.length >= self.capacity:
            raise ValueError(f"the sequences reached max_length={self.capacity}: capture again with a larger one")
        self.ids.copy_(input_ids)
        self.graph.replay()
        self.position.add_(1)
        for v in self.views:
            v.advance_host(1)
        return self.logits.float().clone()


def greedy_generate(model, input_ids: torch.Tensor, cache, max_new_tokens: int, eos_token_id=None) -> torch.Tensor:
    """Greedy generation with a captured decode step: the prompt in one eager forward, then one replay per token.

    ``input_ids`` [B, T] (no padding), ``cache`` an empty ``QuantMLACache`` on the model's CUDA device. Returns
    ``[B, T + n]`` like ``model.generate``; stops early once every sequence produced ``eos_token_id``."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
    with torch.no_grad():
        logits = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **with_cache(cache)).logits[:, -1]
    tok = logits.argmax(-1, keepdim=True)
    out = [input_ids, tok]
    done = _finished(tok, eos_token_id)
    if max_new_tokens > 1 and not done:
        step = CapturedDecode(model, cache, max_length=input_ids.shape[1] + max_new_tokens)
        for _ in range(max_new_tokens - 1):
            tok = step.step(tok).argmax(-1, keepdim=True)
            out.append(tok)
            if _finished(tok, eos_token_id):
                break
    return torch.cat(out, dim=1)


def _finished(tok: torch.Tensor, eos_token_id) -> bool:
    if eos_token_id is None:
        return False
    eos = torch.as_tensor(eos_token_id, device=tok.device).reshape(-1)
    return bool(torch.isin(tok, eos).all())
