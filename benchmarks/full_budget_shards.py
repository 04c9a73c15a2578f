"""``benchmarks/full_budget.py`` in N processes on one GPU: the units split into shards, run side by side, merged.

A paper-budget calibration of SmolLM2-MLA alone leaves the GPU idle much of the time: ~10 ms per optimizer step on
matrices of a few hundred rows (H200, 2026-12-04: ~180 of a calibration's ~210 s are its 30 x 600 steps), ~330
kernel launches a step with the device busy about two thirds of it (calib_profile_h200_s26.md), so the host's launches
and waits bound it. Processes do not share that bound: N of them on one GPU finish more units per second
while the GPU has room -- roughly 2.5-4x at N = 12, where the GPU is full ("Measured" below).

* :func:`assign` splits the units by *chain* -- the units of one (variant, format, method, seed): its calibration
  and the evaluations that read its transforms, which must run in one process and in that order; a variant's BF16
  units form a chain too -- longest chain first onto the least loaded shard (weighed with ``full_budget.DEFAULT_S``,
  the first guess of a unit's seconds per kind), deterministic, so every process computes the same split from the
  same arguments.
* ``full_budget.py --shard I/N`` runs shard I alone: its results file is ``full_budget_<tag>.shardIofN.json`` (and
  .md / .png), its work folder ``<work>/shardIofN``; ``--resume``, ``--budget-s``, ``--whole-units`` and the carry
  work per shard exactly as without shards.
* ``full_budget.py --merge-shards N`` (same other arguments) computes nothing: it unions the shards' units into
  ``full_budget_<tag>.json`` / .md / .png -- the table of one unsharded run -- and refuses shards of another setting.
* ``python benchmarks/full_budget_shards.py --shards N [--threads-per-shard T] -- <full_budget.py arguments>``
  does it all on one machine: the models built once first (not N times at once), N processes (each one's output in
  ``<results-dir>/full_budget_<tag>.shardIofN.log``), then the merge; exit status 0 when every shard finished.
  Where ``nvidia-smi`` is, the GPU's utilization is sampled every 5 s meanwhile (``full_budget_<tag>.shardsN.gpu.csv``,
  its median printed at the end): how much room N more processes would still find.

GPU recipe (one warm machine; the SmolLM2 kit first, ``benchmarks/device_smollm2_setup.sh``, in two calls with every
shipped file hidden; then ``device_tree.sh restore && device_tree.sh hide smollm2-mla-b-heal.safetensors``: variant
b's model is built from that heal delta), the results and the work folders kept on the machine between calls,
everything that comes back in one archive::

    source benchmarks/device_smollm2_setup.sh && QUANTMLA_COMMIT=<sha> timeout 560 python
      benchmarks/full_budget_shards.py --shards 6 --threads-per-shard 2 --mps -- --device cuda --budget-s 430
      --resume --tag paper_rot --rope-rounding rotated --methods rtn,quantmla-attnw
      --seed-methods quantmla-attnw --reuse benchmarks/results/full_budget_paper.json
      --results-dir /root/keep/fbr --work /root/keep/fbr_work 2>&1 | grep -v "it/s]" | tail -30;
      tar czf $OUT/fbr.tgz -C /root/keep fbr

(add ``--whole-units`` in a session's last call; with less device time than the whole table needs, run it in passes
that each finish -- ``--seeds 0`` first, 7 shards, then ``--seeds 0,1,2`` -- each adopting the last pass's merged table.
The BF16 and RTN units are reused from the nearest-rounding table where it was measured on the same device -- on
another they are computed, spread over the shards. ``--mps``:
NVIDIA's Multi-Process Service where the machine has it and it serves a probe, so the processes' small kernels
share the GPU at once instead of taking turns in time slices; otherwise the shards run without it, said so.)

Measured (H100, 2026-12-07, session 44, ``full_budget_paper_rot_s44_h100_partial.md``): 12 shards with MPS kept the
GPU 100% busy (median of nvidia-smi's samples), each retrieval unit ran 2.9-4.9x longer than alone and no calibration
finished in 635 s (alone ~210 s on the H200): the premise that a calibration leaves the GPU mostly idle does not hold
at 12 processes; the throughput is roughly 2.5-4x a single process's, but a chain then outlives a session's device
time and is lost with the machine. Hence 6 shards, two chains each, so chains finish call by call.

A machine lost between calls loses the shards' unfinished calibrations (``--whole-units`` starts none it cannot
finish by the longest one this shard has finished; the first is a guess); the finished units are in the archive:
copy its merged ``full_budget_<tag>.json`` back into ``--results-dir`` and ``--resume`` -- every shard adopts the
units of that table its split plans (:func:`adopt`), so the next run may use another shard count or more seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_shard(spec: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 0 <= I < N; a clear error otherwise."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--shard {spec!r}: expected I/N, e.g. 0/4 (shard I of N, counted from 0)") from None
    if not (n >= 1 and 0 <= i < n):
        raise SystemExit(f"--shard {spec!r}: need N >= 1 and 0 <= I < N")
    return i, n


def chain_of(unit: dict) -> str:
    """The chain a unit belongs to: ``a/c4r4/quantmla/s1`` for that calibration and its evaluations, ``a/bf16``."""
    return unit["key"].rsplit("/", 1)[0]


def assign(units: list[dict], n: int, guess_s: dict[str, float]) -> dict[str, int]:
    """{chain: shard}: chains by estimated seconds (``guess_s`` per unit kind), longest first (ties: the earlier in
    ``units``), each onto the shard with the least estimated work so far (ties: the lowest index)."""
    cost: dict[str, float] = {}
    for u in units:
        cost[chain_of(u)] = cost.get(chain_of(u), 0.0) + guess_s[u["kind"]]
    order = sorted(cost, key=lambda c: -cost[c])  # sorted() is stable: equal costs keep the units' order
    load = [0.0] * n
    out = {}
    for c in order:
        s = min(range(n), key=lambda k: (load[k], k))
        out[c] = s
        load[s] += cost[c]
    return out


def select(units: list[dict], i: int, n: int, guess_s: dict[str, float]) -> list[dict]:
    """Shard ``i``'s units, in their priority order."""
    where = assign(units, n, guess_s)
    return [u for u in units if where[chain_of(u)] == i]


def shard_suffix(i: int, n: int) -> str:
    return f".shard{i}of{n}"


def shard_paths(stem: str, work: str | None, i: int, n: int) -> tuple[str, str]:
    """(results stem, work folder) of shard ``i`` of the run whose are (``stem``, ``work`` or the default)."""
    sfx = shard_suffix(i, n)
    return stem + sfx, os.path.join(work, sfx[1:]) if work else stem + sfx + ".work"


def adopt(results: dict, path: str, planned: list[str], rope_rounding: str) -> list[str]:
    """Take into ``results`` (a shard's) the finished units of the unsharded table ``path`` that this shard plans
    and has not: a merged table from a split of another shape -- another shard count, other seeds, an earlier
    machine's run copied back -- so nothing it holds is computed again. A calibration whose transforms are not in
    this shard's work folder is dropped again, with its finished evaluations, where an evaluation of it is still to
    run (``Runner``). Returns the
    adopted keys (none without the file); another RoPE rounding is a clear error."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        table = json.load(fh)
    from full_budget_report import check_rope_rounding

    check_rope_rounding(table, rope_rounding, path)
    keys = [k for k in planned if k in table.get("units", {}) and k not in results["units"]]
    results["units"].update({k: table["units"][k] for k in keys})
    if keys:
        print(f"adopted {len(keys)} finished unit(s) from {path}", flush=True)
    return keys


def merge(results: list[dict | None], planned: list[dict], rope_rounding: str) -> dict:
    """The shards' results (None: a shard with no results file yet) as one results dict of the unsharded run.
    Refuses a shard evaluated with another RoPE rounding or holding a unit the arguments do not plan (a shard of
    another setting); units a shard has not finished are simply absent, as in an unfinished run."""
    from full_budget_report import check_rope_rounding

    keys = {u["key"] for u in planned}
    units: dict = {}
    shards = []
    for i, r in enumerate(results):
        if r is None:
            shards.append({"shard": i, "units": 0})
            continue
        check_rope_rounding(r, rope_rounding, f"shard {i}")
        stray = sorted(set(r["units"]) - keys)
        if stray:
            raise SystemExit(f"shard {i} holds units these arguments do not plan ({', '.join(stray[:3])}...): "
                             "merge with the arguments the shards ran with")  # fmt: skip
        units.update(r["units"])
        shards.append({"shard": i, "units": len(r["units"]), "command": r.get("command"), "commit": r.get("commit"),
                       "seconds": round(sum(u.get("seconds", 0.0) for u in r["units"].values()), 1)})  # fmt: skip
    return {"units": {k: units[k] for k in (u["key"] for u in planned) if k in units}, "rope_rounding": rope_rounding,
            "shards": shards}  # fmt: skip


def merge_files(args, n: int, stem: str, work: str, planned: list[dict]) -> int:
    """``full_budget.py --merge-shards N``: read each shard's results (its results file or the mirror in its work
    folder, whichever holds more units), :func:`merge` them and write the unsharded run's table (``stem``)."""
    from full_budget_report import read_results, write

    found = [read_results(*shard_paths(stem, args.work, i, n)) for i in range(n)]
    if not any(found):
        raise SystemExit(f"no shard results under {stem}.shard*of{n}.json (--shard I/{n} runs write them)")
    results = merge(found, planned, args.rope_rounding)
    write(results, stem, args)
    left = len(planned) - len(results["units"])
    print(f"merged {n} shards: {len(results['units'])} units" + (f", {left} left" if left else "") + f": {stem}.md")
    return 0


def launcher_command(argl: list[str], n: int) -> str:
    """The launcher's command line that reproduces a merge run with full_budget.py arguments ``argl``."""
    rest = [a for k, a in enumerate(argl)
            if not (a.startswith("--merge-shards") or (k and argl[k - 1] == "--merge-shards"))]  # fmt: skip
    return f"python benchmarks/full_budget_shards.py --shards {n} -- " + " ".join(rest)


def _option(args: list[str], name: str, default: str | None = None) -> str | None:
    """The value of ``--name V`` or ``--name=V`` in a full_budget.py argument list (the last one wins)."""
    val = default
    for k, a in enumerate(args):
        if a == name and k + 1 < len(args):
            val = args[k + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


GPU_LOG_FIELDS = "timestamp,utilization.gpu,memory.used"  # what start_gpu_log samples, every 5 s


def start_gpu_log(path: str) -> subprocess.Popen | None:
    """Sample the GPU's utilization and memory into ``path`` (CSV) while the shards run; None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    with open(path, "w") as fh:
        return subprocess.Popen([exe, f"--query-gpu={GPU_LOG_FIELDS}", "--format=csv,noheader,nounits", "-l", "5"],
                                stdout=fh, stderr=subprocess.DEVNULL)  # fmt: skip


def gpu_log_summary(path: str) -> str | None:
    """"GPU busy 63% (median of 41 samples), 12.3 GiB peak" from a :func:`start_gpu_log` file (first GPU's rows);
    None when it has no sample."""
    util, mem = [], []
    with open(path) as fh:
        for line in fh:
            f = [x.strip() for x in line.split(",")]
            try:
                util.append(float(f[1]))
                mem.append(float(f[2]))
            except (IndexError, ValueError):
                continue
    if not util:
        return None
    med = sorted(util)[len(util) // 2]
    return f"GPU busy {med:.0f}% (median of {len(util)} samples, every 5 s), {max(mem) / 1024:.1f} GiB peak"


MPS_PROBE = "import torch; x = torch.ones(4, device='cuda'); print(float(x.sum()))"  # one CUDA tensor, via MPS
MPS_WHAT = "the shards' kernels run side by side instead of taking turns in time slices"


def start_mps(folder: str) -> dict | None:
    """Start NVIDIA's Multi-Process Service (``--mps``: the shards' kernels then run side by side) with its pipe and
    log folders under ``folder`` and check it with a one-tensor CUDA process; returns the environment the shards
    need, or None (no ``nvidia-cuda-mps-control``, its daemon did not start or did not serve the probe: then it is
    stopped again and the shards run without it, as without ``--mps``). The GPU's settings are left as they are."""
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        print("--mps: no nvidia-cuda-mps-control on PATH: the shards run without MPS", flush=True)
        return None
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"),
           "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}  # fmt: skip
    for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"):
        os.makedirs(env[k], exist_ok=True)
    why = None
    try:
        up = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=60)
        if up.returncode != 0:
            why = f"the daemon exited {up.returncode}: {(up.stderr or up.stdout).strip()[-300:]}"
        else:
            probe = subprocess.run([sys.executable, "-c", MPS_PROBE], env=env, capture_output=True, text=True,
                                   timeout=180)  # fmt: skip
            if probe.returncode != 0 or probe.stdout.strip() != "4.0":
                why = f"the probe exited {probe.returncode}: {(probe.stderr or probe.stdout).strip()[-300:]}"
    except subprocess.TimeoutExpired as e:
        why = f"{e.cmd[0]} timed out"
    if why is None:
        print(f"--mps: MPS serves CUDA here ({MPS_WHAT})", flush=True)
        return env
    stop_mps(env)
    print(f"--mps: MPS did not serve CUDA here ({why}): the shards run without it", flush=True)
    return None


def stop_mps(env: dict | None) -> None:
    """Stop the MPS daemon :func:`start_mps` started and remove its folder (nothing when None)."""
    exe = shutil.which("nvidia-cuda-mps-control", path=(env or {}).get("PATH"))
    if env is None or exe is None:
        return
    try:
        subprocess.run([exe], input="quit\n", env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        print("--mps: the MPS daemon did not answer 'quit' within 60 s", flush=True)
    shutil.rmtree(os.path.dirname(env["CUDA_MPS_PIPE_DIRECTORY"]), ignore_errors=True)


def prepare_models(variants: list[str]) -> None:
    """Build the variants' model folders once, before N processes would each build them (safe, but N x the work)."""
    from full_budget_report import variant_dir

    for v in variants:
        variant_dir(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="%(prog)s --shards N [--threads-per-shard T] [--mps] -- FULL_BUDGET_ARGS...")
    ap.add_argument("--shards", type=int, required=True, help="processes side by side on this machine")
    ap.add_argument("--threads-per-shard", type=int, default=None,
                    help="CPU threads of each process (default: this machine's cores / N, at least 1)")
    ap.add_argument("--mps", action="store_true", help=f"start NVIDIA's Multi-Process Service for the shards "
                    f"({MPS_WHAT}); without it on this machine they run as without --mps")
    ap.add_argument("rest", nargs=argparse.REMAINDER, help="full_budget.py's arguments, after --")
    a = ap.parse_args(argv)
    rest = a.rest[1:] if a.rest[:1] == ["--"] else a.rest
    if a.shards < 1:
        ap.error("--shards must be >= 1")
    for own in ("--shard", "--merge-shards", "--threads"):
        if _option(rest, own) is not None or own in rest:
            ap.error(f"{own} is this launcher's to set: leave it out of the full_budget.py arguments")
    threads = a.threads_per_shard or max(1, (os.cpu_count() or 1) // a.shards)
    results_dir = _option(rest, "--results-dir", os.path.join(HERE, "results"))
    tag = _option(rest, "--tag", "paper")
    variants = [v.strip() for v in (_option(rest, "--variants", "a,b") or "").split(",") if v.strip()]
    os.makedirs(results_dir, exist_ok=True)
    t0 = time.time()
    prepare_models(variants)
    print(f"models ready in {time.time() - t0:.0f} s; {a.shards} shards, {threads} threads each", flush=True)
    script = os.path.join(HERE, "full_budget.py")
    gpu_log = os.path.join(results_dir, f"full_budget_{tag}.shards{a.shards}.gpu.csv")
    sampler = start_gpu_log(gpu_log)  # how busy the shards keep the GPU: what N more processes could still gain
    mps = start_mps(tempfile.mkdtemp(prefix="qmla_mps_")) if a.mps else None  # (a socket path: short, outside results)
    procs = []
    for i in range(a.shards):
        log = os.path.join(results_dir, f"full_budget_{tag}{shard_suffix(i, a.shards)}.log")
        with open(log, "w") as fh:
            procs.append((i, log, subprocess.Popen(
                [sys.executable, script, *rest, "--shard", f"{i}/{a.shards}", "--threads", str(threads)],
                stdout=fh, stderr=subprocess.STDOUT, env=mps)))  # fmt: skip

    def stop(signum, _frame):  # a `timeout` or Ctrl-C stops the shards too, not only this launcher (each shard
        for _, _, p in procs:  # keeps its finished units and, in a calibration, its finished blocks); no wait()
            if p.returncode is None:  # here: the interrupted wait() below holds the Popen's lock (a deadlock)
                p.send_signal(signal.SIGTERM)
        if sampler is not None:
            sampler.terminate()
        stop_mps(mps)  # (the shards it served are stopping: a client's exit does not need the daemon)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = []
    for i, log, p in procs:
        rc = p.wait()
        with open(log) as fh:
            last = [ln for ln in fh.read().splitlines() if ln.strip()][-1:] or ["(no output)"]
        print(f"shard {i}/{a.shards}: exit {rc}, {time.time() - t0:.0f} s: {last[0]}", flush=True)
        if rc != 0 or "all units done" not in last[0]:
            failed.append(i)
    stop_mps(mps)
    if sampler is not None:
        sampler.terminate()
        sampler.wait()
        print(f"{gpu_log}: {gpu_log_summary(gpu_log) or 'no sample'}", flush=True)
    merged = subprocess.run([sys.executable, script, *rest, "--merge-shards", str(a.shards)])
    if failed:
        print(f"shards {failed} did not finish (their logs say why): rerun the same command with --resume")
    return 1 if failed or merged.returncode else 0


if __name__ == "__main__":
    raise SystemExit(main())
