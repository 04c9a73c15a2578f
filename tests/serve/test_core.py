"""The vLLM-free serving core against independent references: a PagedMLACache built the ordinary way (one per
request, fed the same tokens) and its fp32 torch oracles. Hostile on purpose: shuffled blocks, NaN in every
unwritten byte, batch rows that move, requests that are skipped, preempted and recomputed, or finish and hand
their rows to new ones."""

from __future__ import annotations

import random

import pytest
import torch

from quantmla.kernels.paged import PagedLayout, PagedMLACache
from quantmla.kernels.reference import decode_attention_torch
from quantmla.quant.formats import CachePolicy, get_format
from quantmla.serve.core import ServeLayer
from quantmla.serve.request_state import RequestStateTable

DC, DR, P, H = 64, 32, 16, 3
POLICY = CachePolicy(sink=4, local=16, page_size=P)


def _layout(fmt):
    f = get_format(fmt)
    f = f.adapted(DC, DR) if hasattr(f, "adapted") else f
    return PagedLayout(f, DC, DR, P)


class Engine:
    """A toy engine with vLLM's bookkeeping: a block pool, per-request block lists, batch rows per step."""

    def __init__(self, fmt, num_blocks=64, max_requests=6, layers=2, seed=0):
        self.layout = _layout(fmt)
        self.kv = [torch.full((num_blocks, self.layout.page_bytes), 0xFF, dtype=torch.uint8) for _ in range(layers)]
        rng = random.Random(seed)
        self.free = list(range(1, num_blocks))  # block 0 = vLLM's null block
        rng.shuffle(self.free)
        self.blocks: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}  # computed tokens per request
        self.state = RequestStateTable(layers, max_requests, POLICY.sink, POLICY.local, DC + DR)
        self.layers = [ServeLayer(self.layout, i, impl="torch") for i in range(layers)]
        self.last_recent: list = [None] * layers  # what each layer's last write returned for the prefill

    def release(self, rid):
        self.free += self.blocks.pop(rid)
        self.done.pop(rid)
        self.state.finish([rid])

    def step(self, sched: dict[str, int], tokens: dict[str, tuple[torch.Tensor, torch.Tensor]]):
        """Write ``sched[rid]`` new tokens per request (rows in dict order); returns (block table, seq_lens)."""
        rids = list(sched)
        self.state.arrange(rids)
        for rid, n in sched.items():
            self.blocks.setdefault(rid, [])
            self.done.setdefault(rid, 0)
            while len(self.blocks[rid]) * P < self.done[rid] + n:
                self.blocks[rid].append(self.free.pop())
        width = max(len(self.blocks[r]) for r in rids)
        bt = torch.zeros(len(rids), width + 2, dtype=torch.int32)  # unused entries -> null block 0
        for b, r in enumerate(rids):
            bt[b, : len(self.blocks[r])] = torch.tensor(self.blocks[r])
        qsl = torch.tensor([0] + [sum(list(sched.values())[: i + 1]) for i in range(len(rids))])
        seq_lens = torch.tensor([self.done[r] + sched[r] for r in rids])
        slots = [self.blocks[r][p // P] * P + p % P for r in rids for p in range(self.done[r], self.done[r] + sched[r])]
        for li, layer in enumerate(self.layers):
            c = torch.cat([tokens[r][0][li, self.done[r] : self.done[r] + sched[r]] for r in rids])
            k = torch.cat([tokens[r][1][li, self.done[r] : self.done[r] + sched[r]] for r in rids])
            self.last_recent[li] = layer.write(self.kv[li], self.state, rids, c, k[:, None, :], qsl, seq_lens, bt,
                                               torch.tensor(slots))
        for r in rids:
            self.done[r] += sched[r]
        return bt, seq_lens


def _tokens(n, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(layers, n, DC, generator=g) * torch.linspace(0.2, 2.0, DC)
    return c.to(torch.bfloat16).float(), (torch.randn(layers, n, DR, generator=g) * 1.5).to(torch.bfloat16).float()


def _reference(fmt, c, k, n, chunks, plan=None):
    """Ordinary PagedMLACache (batch 1) with the same tokens written in the same chunks (RoPE rounding ``plan``)."""
    ref = PagedMLACache(fmt, 1, max(n, 1) + P, kv_lora_rank=DC, rope_dim=DR, policy=POLICY, shuffle=True, seed=3)
    ref.set_rope_rounding(plan)
    at = 0
    for m in chunks:
        ref.write_reference(c[None, at : at + m], k[None, at : at + m])
        at += m
    return ref


@pytest.mark.parametrize("fmt", ["bf16", "c8r8", "c4r4", "c2r4"])
def test_write_is_bit_identical_to_the_reference_writer(fmt):
    eng = Engine(fmt, layers=1)
    toks = {"a": _tokens(70, 1, 1), "b": _tokens(23, 1, 2), "c": _tokens(41, 1, 3)}
    plan = [{"a": 30, "b": 23, "c": 5}, {"c": 20, "a": 40}, {"a": 0, "c": 16}]  # rows move between steps
    chunks = {r: [] for r in toks}
    for sched in plan:
        sched = {r: n for r, n in sched.items() if n}
        eng.step(sched, toks)
        for r, n in sched.items():
            chunks[r].append(n)
    for r, (c, k) in toks.items():
        n = sum(chunks[r])
        ref = _reference(fmt, c[0], k[0], n, chunks[r])
        # the packed bytes of each page equal the reference's page for the same token range
        for i, blk in enumerate(eng.blocks[r]):
            want = ref.pool[ref.table.pages(0)[i]]
            got = eng.kv[0][blk]
            used = min(P, n - i * P)
            if used == P:
                assert torch.equal(got, want), f"{fmt} request {r} page {i}"
        # what attention reads (BF16 sink/local + dequantized packed) is identical, NaN-free
        bt = torch.tensor([eng.blocks[r]], dtype=torch.int32)
        eng.state.arrange([r])
        c_got, k_got = eng.layers[0].gather(eng.kv[0], eng.state, torch.tensor([n]), bt)
        want = ref.read_tokens(0)
        assert torch.equal(torch.cat([c_got, k_got], -1), want)
        assert not torch.isnan(want).any()


def test_slot_mapping_mismatch_is_an_error():
    eng = Engine("c4r4", layers=1)
    eng.state.arrange(["a"])
    c, k = _tokens(5, 1)
    eng.blocks["a"], eng.done["a"] = [7], 0
    bt = torch.tensor([[7]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="slot mapping"):
        eng.layers[0].write(eng.kv[0], eng.state, ["a"], c[0], k[0], torch.tensor([0, 5]), torch.tensor([5]), bt,
                            torch.tensor([8 * P + i for i in range(5)]))


def test_prefix_cache_hit_without_state_is_an_error():
    eng = Engine("c4r4", layers=1)
    eng.state.arrange(["a"])
    c, k = _tokens(5, 1)
    bt = torch.tensor([[7]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="prefix caching off"):
        eng.layers[0].write(eng.kv[0], eng.state, ["a"], c[0], k[0], torch.tensor([0, 5]), torch.tensor([10]), bt)


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4", "bf16"])
def test_state_survives_row_moves_preemption_recompute_and_finish(fmt):
    """A schedule with every lifecycle event; after every step each scheduled request's decode output equals
    an ordinary batch-1 cache fed the same tokens (bit for bit: same fp32 oracle, same data)."""
    eng = Engine(fmt, num_blocks=40, max_requests=4)
    toks = {r: _tokens(90, 2, i + 10) for i, r in enumerate("abcde")}
    plan = [
        {"a": 20, "b": 7},
        {"b": 30, "a": 1, "c": 40},  # rows swap, c joins
        {"c": 1, "b": 1},  # a not scheduled this step (keeps its state out of the batch)
        {"a": 1, "c": 1, "b": 1},
        ("preempt", "b"),  # blocks freed, computed tokens thrown away
        {"d": 50, "a": 1},  # d takes b's rows/blocks
        {"b": 39, "d": 1, "c": 1},  # b recomputed from position 0 in one chunk
        ("finish", "a"),
        {"e": 33, "b": 1, "d": 1},  # e takes a's row
        {"d": 1, "e": 1, "b": 1, "c": 1},
    ]
    written = {r: [] for r in toks}
    scale = 0.125
    g = torch.Generator().manual_seed(5)
    for item in plan:
        if isinstance(item, tuple):
            eng.release(item[1])
            written[item[1]] = []
            continue
        bt, seq_lens = eng.step(item, toks)
        for r, n in item.items():
            written[r].append(n)
        q_lat, q_pe = torch.randn(len(item), H, DC, generator=g), torch.randn(len(item), H, DR, generator=g)
        for li, layer in enumerate(eng.layers):
            o, lse = layer.decode(eng.kv[li], eng.state, q_lat, q_pe, seq_lens, bt, scale)
            for b, r in enumerate(item):
                ref = _reference(fmt, toks[r][0][li], toks[r][1][li], sum(written[r]), written[r])
                o_ref, lse_ref = decode_attention_torch(q_lat[b : b + 1], q_pe[b : b + 1], ref, scale, return_lse=True)
                assert torch.equal(o[b : b + 1], o_ref), f"{fmt} layer {li} request {r} after {item}"
                assert torch.equal(lse[b : b + 1], lse_ref)
                assert torch.isfinite(o[b]).all()


@pytest.mark.parametrize("fmt", ["c4r4", "bf16"])
def test_prefill_sees_what_token_by_token_decoding_sees(fmt):
    """Chunked prefill on flat vLLM rows (one request starting, one continuing past the local window): query ``t``
    of a chunk gives the output of decoding alone at its position over a batch-1 cache holding tokens 0..p."""
    eng = Engine(fmt, layers=1)
    toks = {"a": _tokens(60, 1, 1), "b": _tokens(30, 1, 2)}
    eng.step({"a": 25}, toks)
    qsl = torch.tensor([0, 30, 65])
    bt, seq_lens = eng.step({"b": 30, "a": 35}, toks)
    recent = eng.last_recent[0]
    g = torch.Generator().manual_seed(1)
    q_lat, q_pe = torch.randn(65, H, DC, generator=g), torch.randn(65, H, DR, generator=g)
    out = eng.layers[0].prefill(eng.kv[0], eng.state, q_lat, q_pe, qsl, seq_lens, bt, 0.1, recent=recent)
    for r, s, e, start in (("b", 0, 30, 0), ("a", 30, 65, 25)):
        for t in range(e - s):
            p = start + t
            ref = _reference(fmt, toks[r][0][0], toks[r][1][0], p + 1, [p + 1])
            want = decode_attention_torch(q_lat[None, s + t], q_pe[None, s + t], ref, 0.1)
            torch.testing.assert_close(out[None, s + t], want, rtol=1e-5, atol=1e-6, msg=f"{fmt} {r} position {p}")
    if fmt != "bf16":  # the window rows the chunk pushed out of the ring are needed, and asked for
        with pytest.raises(ValueError, match="recent="):
            eng.layers[0].prefill(eng.kv[0], eng.state, q_lat, q_pe, qsl, seq_lens, bt, 0.1)


def test_small_block_in_vllm_tensor_is_a_clear_error():
    layer = ServeLayer(_layout("c4r4"), 0)
    with pytest.raises(ValueError, match="page size"):
        layer.pool(torch.zeros(4, 10, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt,rounding", [("c8r8", False), ("c4r4", False), ("c2r4", False), ("bf16", False),
                                          ("c4r4", True), ("c2r4", True)])  # fmt: skip
def test_gpu_triton_write_and_decode_match_the_torch_core(fmt, rounding):
    """On the GPU: the fused writer gives the same bytes as the CPU torch writer (also with a query-aware RoPE
    rounding plan), and Triton decode matches the fp32 oracle within the kernel tolerances of docs/kernels.md, on
    vLLM-shaped tensors (DeepSeek widths)."""
    from quantmla.quant.rounding import fit_rope_rounding

    layout = PagedLayout(get_format(fmt), 512, 64, 64)
    g = torch.Generator().manual_seed(0)
    plan = None
    if rounding:
        a = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
        plan = fit_rope_rounding(a @ a.T)
    lens = [1, 97, 300, 64]
    nb = 40
    state_cpu = RequestStateTable(1, 4, 4, 128, 576)
    state_gpu = RequestStateTable(1, 4, 4, 128, 576, device="cuda")
    rids = list("abcd")
    kv_cpu = torch.full((nb, layout.page_bytes), 0xFF, dtype=torch.uint8)
    kv_gpu = kv_cpu.cuda()
    perm = torch.randperm(nb - 1, generator=g) + 1
    pages = [-(-n // 64) for n in lens]
    bt = torch.zeros(4, max(pages), dtype=torch.int32)
    at = 0
    for b, p in enumerate(pages):
        bt[b, :p] = perm[at : at + p]
        at += p
    c = torch.randn(sum(lens), 512, generator=g)
    k = torch.randn(sum(lens), 64, generator=g)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    for st, kv, impl, dev in ((state_cpu, kv_cpu, "torch", "cpu"), (state_gpu, kv_gpu, "triton", "cuda")):
        st.arrange(rids)
        ServeLayer(layout, 0, impl=impl, rope_rounding=plan).write(kv, st, rids, c.to(dev), k.to(dev), qsl,
                                                                   torch.tensor(lens), bt.to(dev))  # fmt: skip
    assert torch.equal(kv_gpu.cpu(), kv_cpu)
    assert torch.equal(state_gpu.sink.cpu().view(torch.int16), state_cpu.sink.view(torch.int16))
    assert torch.equal(state_gpu.local.cpu().view(torch.int16), state_cpu.local.view(torch.int16))
    q_lat, q_pe = torch.randn(4, 16, 512, generator=g) * 0.05, torch.randn(4, 16, 64, generator=g) * 0.05
    o_ref, _ = ServeLayer(layout, 0, impl="torch").decode(kv_cpu, state_cpu, q_lat, q_pe, torch.tensor(lens), bt, 0.07)
    o, _ = ServeLayer(layout, 0, impl="triton").decode(kv_gpu, state_gpu, q_lat.cuda(), q_pe.cuda(),
                                                       torch.tensor(lens), bt.cuda(), 0.07)
    err = (o.cpu().double() - o_ref.double()).abs()
    assert (err <= 3e-2 + 3e-2 * o_ref.double().abs()).all()


def _plan(seed=0):
    from quantmla.quant.rounding import fit_rope_rounding

    a = torch.randn(DR, DR, generator=torch.Generator().manual_seed(seed))
    return fit_rope_rounding(a @ a.T)


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4"])
def test_a_layer_with_a_rounding_plan_writes_what_the_cache_with_that_plan_writes(fmt):
    """The serving layer's query-aware RoPE rounding: its pages equal a PagedMLACache's given the same plan, and
    differ from rounding to nearest (the plan reaches the writes)."""
    plan = _plan()
    eng = Engine(fmt, layers=1)
    eng.layers = [ServeLayer(eng.layout, 0, impl="torch", rope_rounding=plan)]
    c, k = _tokens(48, 1, 5)
    eng.step({"a": 20}, {"a": (c, k)})
    eng.step({"a": 28}, {"a": (c, k)})
    ref = _reference(fmt, c[0], k[0], 48, [20, 28], plan)
    nearest = _reference(fmt, c[0], k[0], 48, [20, 28])
    pages = ref.table.pages(0)
    for i, blk in enumerate(eng.blocks["a"]):
        assert torch.equal(eng.kv[0][blk], ref.pool[pages[i]]), f"page {i}"
    assert any(not torch.equal(eng.kv[0][b], nearest.pool[nearest.table.pages(0)[i]])
               for i, b in enumerate(eng.blocks["a"]))  # fmt: skip
    with pytest.raises(ValueError, match="nothing to round"):
        ServeLayer(_layout("bf16"), 0, rope_rounding=plan)


def test_worker_layers_take_their_model_layers_plans():
    """A worker holding model layers 2.. (pipeline parallelism) gives its k-th layer model layer 2 + k's plan; a
    format whose RoPE key is BF16 takes none."""
    from quantmla.serve.slots import ServeGeometry
    from quantmla.serve.vllm.worker import WorkerCache

    plans = {i: _plan(i) for i in range(5)}
    geo = ServeGeometry("c4r4", num_layers=3, block_size=P, kv_lora_rank=DC, rope_dim=DR, sink=4, local=16)
    w = WorkerCache(geo, 2, "cpu", rope_rounding=plans, first_layer=2)
    got = [w.add_layer().rope_rounding for _ in range(3)]
    for k, plan in enumerate(got):
        assert torch.equal(plan.feedback, plans[2 + k].feedback) and torch.equal(plan.order.long(), plans[2 + k].order)
    bf = WorkerCache(ServeGeometry("c4r16", num_layers=1, block_size=P, kv_lora_rank=DC, rope_dim=DR), 2, "cpu",
                     rope_rounding=plans)  # fmt: skip
    assert bf.add_layer().rope_rounding is None


def _attention64(q_lat, q_pe, c, k, scale):
    """fp64 absorbed attention of a query ``[H, Dc]``, ``[H, Dr]`` over ``c [n, Dc]``, ``k [n, Dr]``: ``[H, Dc]``."""
    s = (q_lat.double() @ c.double().T + q_pe.double() @ k.double().T) * scale
    return torch.softmax(s, -1) @ c.double()


@pytest.mark.parametrize("fmt", ["c4r4", "c2r4"])
def test_a_layer_with_a_rotated_plan_serves_the_models_attention(fmt):
    """A plan with a post-RoPE rotation ``U`` (what `quantmla calibrate` ships): the pages equal a PagedMLACache's
    with the same plan, the gather gives the RoPE keys back in the model's coordinates, and decode and prefill --
    given the model's own, unrotated queries -- equal fp64 attention over those keys (q U . k U = q . k)."""
    from quantmla.calibrate.query_moments import hadamard_rotation
    from quantmla.quant.rounding import fit_rope_rounding

    a = torch.randn(DR, DR, generator=torch.Generator().manual_seed(4))
    plan = fit_rope_rounding(a @ a.T, rotation=hadamard_rotation(DR, seed=0))
    eng = Engine(fmt, layers=1)
    eng.layers = [ServeLayer(eng.layout, 0, impl="torch", rope_rounding=plan)]
    c, k = _tokens(48, 1, 6)
    k[:, :, 5] += 12.0  # an outlier channel: stored rotated, it must come back
    eng.step({"a": 20}, {"a": (c, k)})
    bt, seq_lens = eng.step({"a": 28}, {"a": (c, k)})
    ref = _reference(fmt, c[0], k[0], 48, [20, 28], plan)
    for i, blk in enumerate(eng.blocks["a"]):
        assert torch.equal(eng.kv[0][blk], ref.pool[ref.table.pages(0)[i]]), f"page {i}"
    layer = eng.layers[0]
    c_got, k_got = layer.gather(eng.kv[0], eng.state, seq_lens, bt)
    stored = ref.read_tokens(0)
    assert torch.equal(c_got, stored[:, :DC])
    torch.testing.assert_close(k_got.double(), stored[:, DC:].double() @ plan.rotation.double().T, rtol=0, atol=1e-5)
    sink_local = torch.cat([torch.arange(POLICY.sink), torch.arange(48 - POLICY.local, 48)])
    torch.testing.assert_close(k_got[sink_local], k[0, sink_local], rtol=0, atol=0.05)  # BF16 copies, turned back
    g = torch.Generator().manual_seed(2)
    q_lat, q_pe = torch.randn(1, H, DC, generator=g), torch.randn(1, H, DR, generator=g) * 2
    o, _ = layer.decode(eng.kv[0], eng.state, q_lat, q_pe, seq_lens, bt, 0.1)
    want = _attention64(q_lat[0], q_pe[0], c_got, k_got, 0.1)
    torch.testing.assert_close(o[0].double(), want, rtol=1e-4, atol=1e-5)
    # prefill of a second request: each query against fp64 attention over what its own position reads
    toks = (c[:, :30].clone(), k[:, :30].clone())
    bt, seq_lens = eng.step({"b": 30}, {"b": toks})
    ql, qp = torch.randn(30, H, DC, generator=g), torch.randn(30, H, DR, generator=g) * 2
    out = layer.prefill(eng.kv[0], eng.state, ql, qp, torch.tensor([0, 30]), seq_lens, bt, 0.1,
                        recent=eng.last_recent[0])  # fmt: skip
    for p in (0, 7, 18, 29):
        one = _reference(fmt, toks[0][0], toks[1][0], p + 1, [p + 1], plan)
        seen = one.read_tokens(0)
        want = _attention64(ql[p], qp[p], seen[:, :DC], one.rope_key_out(seen[:, DC:]), 0.1)
        torch.testing.assert_close(out[p].double(), want, rtol=1e-4, atol=1e-5, msg=f"{fmt} position {p}")
