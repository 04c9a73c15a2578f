"""Block-by-block banks (quantmla.calibrate.blocks): the hidden states entering block 0, each block's outputs and its
attention inputs, gathered on the CPU batch by batch, against a reference written here from transformers' own
forward pass with output_hidden_states and forward hooks."""

from __future__ import annotations

import pytest
import torch

from quantmla.calibrate.blocks import HostBank, attention_by_block, decoder_blocks, first_block_inputs, run_block
from quantmla.mla.tiny import tiny_model


def _reference(model, tokens):
    """Hidden states entering every block and every attention module's inputs, from one full forward pass."""
    _, blocks = decoder_blocks(model)
    attns = attention_by_block(model, blocks)
    seen: dict[int, torch.Tensor] = {}
    hooks = [a.register_forward_pre_hook(lambda m, a_, kw, b=b: seen.__setitem__(b, kw["hidden_states"].clone()),
                                         with_kwargs=True) for b, (a,) in enumerate(attns)]  # fmt: skip
    try:
        with torch.no_grad():
            hs = model(tokens, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        for h in hooks:
            h.remove()
    return hs, seen


def _banks(model, tokens, batch, device):
    _, blocks = decoder_blocks(model)
    attns = attention_by_block(model, blocks)
    h, kw = first_block_inputs(model, tokens, batch, device)
    first, outs, ins = h, [], []
    for b, block in enumerate(blocks):
        block.to(device)
        h, (x,), _ = run_block(block, attns[b], h, kw, batch, device)
        block.to("cpu")
        outs.append(h)
        ins.append(x)
    return first, outs, ins


def test_banks_match_the_full_forward_pass_batch_by_batch():
    """Batches of 2 over 5 sequences (a ragged last batch): block 0's inputs, every block's attention inputs and
    every block's outputs but the last (the final norm follows it) equal the one-pass forward's to fp32 rounding."""
    model = tiny_model("deepseek_v2")
    tokens = torch.randint(3, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    hs, seen = _reference(model, tokens)
    first, outs, ins = _banks(model, tokens, 2, torch.device("cpu"))
    torch.testing.assert_close(first, hs[0], rtol=0, atol=0)
    for b in range(len(outs)):
        torch.testing.assert_close(ins[b], seen[b], rtol=1e-5, atol=1e-6)
        if b + 1 < len(outs):
            torch.testing.assert_close(outs[b], hs[b + 1], rtol=1e-5, atol=1e-6)


def test_host_bank_keeps_rows_in_order_and_refuses_what_does_not_fit():
    bank = HostBank(5)
    parts = [torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64),
             torch.randn(1, 3, 4, dtype=torch.float64)]  # fmt: skip
    for p in parts:
        bank.append(p)
    out = bank.result()
    assert out.dtype == torch.float64 and torch.equal(out, torch.cat(parts))
    with pytest.raises(ValueError, match="does not fit"):
        bank.append(torch.randn(1, 3, 4, dtype=torch.float64))
    short = HostBank(3)
    short.append(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="3 rows got 2"):
        short.result()
    wrong = HostBank(3)
    wrong.append(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="does not fit"):
        wrong.append(torch.randn(1, 3, 5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_banks_from_the_gpu_land_in_page_locked_memory_bit_for_bit():
    """device="cuda": the banks are page-locked CPU tensors (copied without a host wait) and equal, bit for bit,
    the same batches run on the GPU and copied back one by one with ``.cpu()``."""
    model = tiny_model("deepseek_v2")
    tokens = torch.randint(3, 128, (5, 24), generator=torch.Generator().manual_seed(0))
    dev = torch.device("cuda")
    first, outs, ins = _banks(model, tokens, 2, dev)
    assert first.is_pinned() and all(t.is_pinned() for t in outs + ins)
    _, blocks = decoder_blocks(model)
    attns = attention_by_block(model, blocks)
    _, kw = first_block_inputs(model, tokens, 2, dev)
    kw = {k: (tuple(x.to(dev) for x in v) if isinstance(v, tuple) else v) for k, v in kw.items()}
    h = first
    for b, block in enumerate(blocks):
        block.to(dev)
        got: list[torch.Tensor] = []
        hook = attns[b][0].register_forward_pre_hook(lambda m, a_, k, got=got: got.append(k["hidden_states"].cpu()),
                                                     with_kwargs=True)  # fmt: skip
        ref = []
        with torch.no_grad():
            for i in range(0, 5, 2):
                out = block(h[i : i + 2].to(dev), **kw)
                ref.append((out[0] if isinstance(out, tuple) else out).cpu())
        hook.remove()
        block.to("cpu")
        ref = torch.cat(ref)
        assert torch.equal(outs[b], ref) and torch.equal(ins[b], torch.cat(got))
        h = ref
