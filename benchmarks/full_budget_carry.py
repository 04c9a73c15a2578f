"""``benchmarks/full_budget.py`` across machines: what one device call hands to the next.

A device call runs on a fresh machine that is given back when the call ends; only files written under ``$OUT`` come
back (at most 8 files, 16 MiB each, 64 MiB in all, two folders deep), and the next call carries at most 64 MiB in,
the ~31 MB working tree included. So each call ends with :func:`carry_out` into ``$OUT/fb`` and the next one starts
with :func:`carry_in` from the carried copy of that folder:

* ``full_budget_<tag>.json``: every finished unit (what ``--resume`` skips) and the transforms already shipped;
* ``<variant>-<format>-<method>-s<seed>.transforms.safetensors`` (~8 MB each for SmolLM2-MLA): finished
  calibrations whose evaluation units (``ppl``, ``niah``) or shipping are still to come -- units run calibration
  first, then its evaluations, so that is rarely more than one;
* ``<...>.progress.safetensors``: a calibration stopped by the budget after a finished block, packed by
  :mod:`quantmla.calibrate.stream_handover` (its transforms so far; the next call recomputes the hidden states and
  continues with the next block: the learned transforms equal an uninterrupted run's);
* the transforms shipped by this call (``smollm2-mla*-quantmla-*.safetensors``: copy them into
  ``src/quantmla/models/data/`` and commit), then the markdown table and plot when there is room.

The state (json, transforms, progress) comes first; a state file over the 16 MiB a call returns per file (variant b's
transforms: 17 MiB) travels as byte parts ``<name>.part1of2`` ... that :func:`carry_in` joins back, bit for bit; a
call whose state would not fit the limits at all says so loudly.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

MIB = 1 << 20
MAX_FILES, MAX_FILE, MAX_TOTAL = 8, 16 * MIB, 64 * MIB  # what comes back from one device call
OURS = (".safetensors", ".json", ".md", ".png")  # what carry_out writes (and replaces) in its folder
PART = re.compile(r"^(?P<name>.+)\.part(?P<k>[0-9]+)of(?P<n>[0-9]+)$")  # a state file over MAX_FILE, split in bytes
CARRY_STATE = 32 * MIB  # the state the next call carries in, beside the ~31 MB working tree (64 MiB per call)


def carry_in(src: str, results_stem: str, work: str) -> list[str]:
    """Bring the state of an earlier call (folder ``src``) into this machine's results and work folders."""
    from quantmla.calibrate.stream_handover import progress_of, unpack_progress

    done, shown = [], src
    os.makedirs(work, exist_ok=True)
    src = _join_parts(src, os.path.join(work, ".carry_join"))
    name = os.path.basename(results_stem) + ".json"
    carried = os.path.join(src, name)
    if os.path.exists(carried):
        here = results_stem + ".json"
        n_carried = len(_load(carried)["units"])
        n_here = len(_load(here)["units"]) if os.path.exists(here) else -1
        if n_carried >= n_here:
            os.makedirs(os.path.dirname(here), exist_ok=True)
            shutil.copyfile(carried, here + ".tmp")
            os.replace(here + ".tmp", here)
            done.append(f"{name} ({n_carried} units)")
    for path in sorted(glob.glob(os.path.join(src, "*.transforms.safetensors"))):
        dst = os.path.join(work, os.path.basename(path))
        if not os.path.exists(dst):
            shutil.copyfile(path, dst + ".tmp")
            os.replace(dst + ".tmp", dst)
            done.append(os.path.basename(path))
    for path in sorted(glob.glob(os.path.join(src, "*.progress.safetensors"))):
        stem = os.path.basename(path)[: -len(".progress.safetensors")]
        dst = os.path.join(work, stem + ".work")
        blocks = progress_of(path)["blocks_done"]
        if os.path.exists(os.path.join(dst, "progress.json")) and _load(os.path.join(dst, "progress.json"))[
            "blocks_done"
        ] >= blocks:
            continue  # this machine is further along already
        unpack_progress(path, dst, force=True)
        done.append(f"{os.path.basename(path)} ({blocks} blocks)")
    print(f"carried in from {shown}: {', '.join(done) or 'nothing'}", flush=True)
    return done


def _join_parts(src: str, joined: str) -> str:
    """``src`` itself when it holds no split files; else a folder (``joined``, rebuilt) with links to ``src``'s whole
    files and every split file joined back from its parts. A missing part is an error, not a shorter file."""
    parts: dict[str, dict[int, tuple[int, str]]] = {}
    for name in os.listdir(src):
        m = PART.match(name)
        if m:
            parts.setdefault(m["name"], {})[int(m["k"])] = (int(m["n"]), os.path.join(src, name))
    if not parts:
        return src
    shutil.rmtree(joined, ignore_errors=True)
    os.makedirs(joined)
    for name in os.listdir(src):
        if not PART.match(name) and os.path.isfile(os.path.join(src, name)):
            os.symlink(os.path.abspath(os.path.join(src, name)), os.path.join(joined, name))
    for name, got in parts.items():
        n = next(iter(got.values()))[0]
        if sorted(got) != list(range(1, n + 1)) or any(m != n for m, _ in got.values()):
            raise RuntimeError(f"{src}: the parts of {name} are incomplete ({sorted(got)} of 1..{n}); copy every "
                               f"{name}.part*of{n} of the last call into it")  # fmt: skip
        with open(os.path.join(joined, name + ".tmp"), "wb") as out:
            for k in range(1, n + 1):
                with open(got[k][1], "rb") as f:
                    shutil.copyfileobj(f, out)
        os.replace(os.path.join(joined, name + ".tmp"), os.path.join(joined, name))
    return joined


def _split(path: str, tmp: str) -> list[str]:
    """``path`` as byte parts of at most MAX_FILE each (``<name>.part1ofN`` ...) in ``tmp``."""
    size, name = os.path.getsize(path), os.path.basename(path)
    n = -(-size // MAX_FILE)
    out = []
    with open(path, "rb") as f:
        for k in range(1, n + 1):
            dst = os.path.join(tmp, f"{name}.part{k}of{n}")
            with open(dst, "wb") as o:
                o.write(f.read(MAX_FILE))
            out.append(dst)
    return out


def _load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def state_files(runner, planned: list[dict], tmp: str) -> list[str]:
    """The files the next call needs: results JSON, needed transforms, packed in-flight calibrations (in ``tmp``)."""
    from quantmla.calibrate.stream_handover import pack_progress

    units = runner.results["units"]
    out = [runner.stem + ".json"] if os.path.exists(runner.stem + ".json") else []
    pending = {u["key"] for u in planned if u["key"] not in units}
    for key, u in sorted(units.items()):
        if u["kind"] != "calib":
            continue
        stem = key.rsplit("/", 1)[0]
        tf = runner.transforms_path(u)
        if os.path.exists(tf) and ({f"{stem}/ppl", f"{stem}/niah"} & pending or runner.to_ship(u)):
            out.append(tf)
    for u in planned:
        if u["kind"] != "calib" or u["key"] in units:
            continue
        tf = runner.transforms_path(u)
        work = tf[: -len(".transforms.safetensors")] + ".work"
        if os.path.exists(os.path.join(work, "progress.json")) and _load(os.path.join(work, "progress.json"))[
            "blocks_done"
        ]:
            stem = os.path.basename(tf)[: -len(".transforms.safetensors")]
            out.append(str(pack_progress(work, os.path.join(tmp, stem + ".progress.safetensors"), force=True)))
    return out


def carry_out(runner, planned: list[dict], dest: str, shipped_files: list[str], quiet: bool = False) -> list[str]:
    """Copy what the next call needs (and this call's shipped transforms, table, plot) into ``dest`` within the
    limits of what a device call returns; returns the files written. The state never silently drops out: a state
    file over the limits is an error printed in capitals (the next call then redoes that work)."""
    os.makedirs(dest, exist_ok=True)
    tmp = os.path.join(runner.work, ".carry_pack")
    os.makedirs(tmp, exist_ok=True)
    state = []
    for path in state_files(runner, planned, tmp):  # a state file over one call's per-file limit goes in parts
        state += _split(path, tmp) if os.path.getsize(path) > MAX_FILE else [path]
    # this call's table and plot only: a results folder may hold older ones (the working tree's committed copies)
    # that do not describe the state handed over (2026-12-02: a chunk that finished no unit carried them out)
    fresh = [runner.stem + e for e in (".md", ".png") if os.path.exists(runner.stem + e)]
    extra = list(shipped_files) + [p for p in fresh if os.path.getmtime(p) >= runner.t0]
    written, total, state_bytes = [], 0, 0
    for path in state + extra:
        size = os.path.getsize(path)
        is_state = path in state
        fits = len(written) < MAX_FILES and size <= MAX_FILE and total + size <= MAX_TOTAL
        if is_state and fits and state_bytes + size > CARRY_STATE:
            print(f"CARRY WARNING: the state passes {CARRY_STATE // MIB} MiB with {os.path.basename(path)}; the next "
                  "call may not carry it beside the working tree", flush=True)  # fmt: skip
        if not fits:
            what = "CARRY ERROR" if is_state else "not carried"
            print(f"{what}: {os.path.basename(path)} ({size / MIB:.1f} MiB) does not fit what one call returns "
                  f"({MAX_FILES} files, 16 MiB each, 64 MiB)", flush=True)  # fmt: skip
            continue
        dst = os.path.join(dest, os.path.basename(path))
        shutil.copyfile(path, dst + ".tmp")
        os.replace(dst + ".tmp", dst)
        written.append(dst)
        total += size
        state_bytes += size if is_state else 0
    for old in os.listdir(dest):  # an earlier carry-out of this call: keep only what is current
        path = os.path.join(dest, old)
        if path not in written and (old.endswith(OURS) or PART.match(old)) and os.path.isfile(path):
            os.remove(path)
    names = ", ".join(f"{os.path.basename(p)} ({os.path.getsize(p) / MIB:.1f} MiB)" for p in written)
    if not quiet:
        print(f"carried out to {dest}: {names}; state {state_bytes / MIB:.1f} MiB", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    return written
