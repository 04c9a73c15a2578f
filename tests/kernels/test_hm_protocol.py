"""The hm kernel's pipeline protocol (csrc/decode_mla_sm90_hm.cu): one producer and two consumers over two tile
buffers, ten full[group][buffer] mbarriers, two empty[buffer] ones, one P buffer and two named barriers, in its
consumer orders (the default: both output products, then both buffers released; ``QMLA_HM_EARLY``: products ordered
by tile, each buffer released after its own; with ``QMLA_HM_PRE``, each consumer's next own tile's first score group
issued before it waits for the other's P, and held until its next wgmma wait). The roles are the kernel's steps as
generators (a yield = another role may run), interleaved at random, with the parities the kernel waits on. A model
of the protocol, not of the SASS: it checks that the order written in the kernel cannot race or deadlock, and (the
mutations) that it would notice."""

from __future__ import annotations

import random
import subprocess

import pytest
from kernels_testutil import Mbarrier

from quantmla.kernels.cuda_build import CSRC, find_nvcc


def _full_parity(k):  # consumer c's wait for tile 2k + c on full[group][c] (mla_hm.cuh's full_parity)
    return k & 1


def _empty_parity(it):  # the producer's wait for buffer it & 1 before tile it >= 2 (mla_hm.cuh's empty_parity)
    return ((it >> 1) - 1) & 1


class _NamedBarrier:
    """bar.arrive by one consumer, bar.sync by the other, 256 threads: a second arrival before the other side's sync
    would complete the barrier with the wrong pair of warpgroups."""

    def __init__(self):
        self.arrived = self.synced = 0

    def arrive(self):
        self.arrived += 1
        assert self.arrived - self.synced <= 1, "named barrier arrived twice before its sync"

    def ready(self):
        return self.arrived > self.synced


class _Pipeline:
    def __init__(self, ntiles, early, mutation=None):
        self.ntiles, self.early, self.mutation = ntiles, early, mutation
        self.full = [[Mbarrier(1) for _ in range(2)] for _ in range(5)]  # [group][buffer]; the producer = one
        self.empty = [Mbarrier(2) for _ in range(2)]  # [buffer]: both consumers
        self.pub = [_NamedBarrier(), _NamedBarrier()]
        self.tile = [None, None]  # the tile a buffer holds once its five groups landed
        self.writing = [False, False]
        self.readers = [set(), set()]  # (consumer, groups read) per buffer
        self.landed = [[None] * 5 for _ in range(2)]  # [buffer][group]: the tile whose group g landed there
        self.next_it = 0  # the producer's next tile
        self.pre = [None, None]  # consumer c's score group issued ahead (QMLA_HM_PRE): (buffer, tile), until a wait
        self.p_tile, self.p_taken = None, True  # the P buffer's tile and whether the other consumer took it
        self.outputs = [[], []]  # the tiles each consumer's output product covered, in order

    def producer(self):
        for it in range(self.ntiles):
            b = it & 1
            if it >= 2:
                while not self.empty[b].passes(_empty_parity(it)):
                    yield
            self._check_free(it, b, range(5))
            self.writing[b], self.tile[b], self.landed[b] = True, None, [None] * 5
            yield
            for g in range(5):
                if g == 4:
                    self.writing[b], self.tile[b], self.next_it = False, it, it + 1
                self.landed[b][g] = it
                self.full[g][b].arrive()
                yield

    def _check_free(self, it, b, groups):
        busy = [r for r in self.readers[b] if set(r[1]) & set(groups)]
        assert not busy, f"tile {it} written into buffer {b} while {busy} read it"

    def _read(self, c, b, tile, groups=range(5)):
        def ok():  # the whole buffer holds the tile
            return not self.writing[b] and self.tile[b] == tile

        assert ok(), f"consumer {c} read buffer {b} for tile {tile}"
        key = (c, tuple(groups))
        self.readers[b].add(key)
        yield
        assert ok(), f"buffer {b} refilled while consumer {c} read tile {tile}"
        self.readers[b].discard(key)

    def _pre(self, c, k, tile, exists=True):
        """QMLA_HM_PRE: the first score group of `tile` (buffer tile & 1) issued ahead; a tile past the end reads a
        buffer the producer will not write again (its products are never used)."""
        b = tile & 1
        if exists:
            while not self.full[0][b].passes(_full_parity(k)):
                yield
            assert self.landed[b][0] == tile, f"consumer {c} issued tile {tile}'s first group before it landed"
        else:
            assert tile >= self.ntiles and all(it & 1 != b for it in range(self.next_it, self.ntiles)), (c, tile)
        self.readers[b].add((c, (0,)))
        self.pre[c] = (b, tile)

    def _wait_all(self, c):  # wgmma_wait<0>: the group issued ahead is done with its buffer
        if self.pre[c] is not None:
            b, tile = self.pre[c]
            assert tile >= self.ntiles or self.landed[b][0] == tile, f"buffer {b} refilled under tile {tile}'s group"
            self.readers[b].discard((c, (0,)))
            self.pre[c] = None

    def _score(self, c, k):
        for g in range(5):
            while not self.full[g][c].passes(_full_parity(k)):
                yield
        yield from self._read(c, c, 2 * k + c)
        self._wait_all(c)

    def _publish(self, tile):
        assert self.p_taken, f"P of tile {tile} overwrote P of tile {self.p_tile} before it was taken"
        self.p_tile, self.p_taken = tile, False

    def _take(self, tile):
        assert self.p_tile == tile and not self.p_taken, f"took P of {self.p_tile}, wanted {tile}"
        self.p_taken = True

    def _sync(self, i):
        while not self.pub[i].ready():
            yield
        self.pub[i].synced += 1

    def _out(self, c, b, tile):  # the output product reads the consumer's channel half: groups 0-1 or 2-3
        yield from self._read(c, b, tile, range(2 * c, 2 * c + 2))
        self._wait_all(c)
        self.outputs[c].append(tile)

    def consumer(self, c):
        m, pre = self.mutation, self.early == "pre"
        if pre and c == 0 and self.ntiles > 0:
            yield from self._pre(0, 0, 0)  # tile 0's first group
        for k in range((self.ntiles + 1) // 2):
            own, other = 2 * k + c < self.ntiles, 2 * k + 1 - c < self.ntiles
            mine, theirs = 2 * k + c, 2 * k + 1 - c
            if self.early:
                if c == 0:
                    yield from self._score(c, k)
                    self._publish(mine)
                    self.pub[0].arrive()
                    if m == "release_first":
                        self.empty[0].arrive()
                    yield from self._out(c, 0, mine)
                    if m != "release_first":
                        self.empty[0].arrive()
                    if other:
                        if pre:  # tile 2k + 2's first group, through the wait for P(2k + 1)
                            yield from self._pre(c, k + 1, 2 * k + 2, 2 * k + 2 < self.ntiles)
                        yield from self._sync(1)
                        self._take(theirs)
                        yield from self._out(c, 1, theirs)
                    self.empty[1].arrive()
                else:
                    if pre and own:  # tile 2k + 1's first group, through the wait for P(2k)
                        yield from self._pre(c, k, mine)
                        if m == "pre_release_early":  # (a broken order: buffer 1 released with the group in flight)
                            self.empty[1].arrive()
                    yield from self._sync(0)
                    self._take(theirs)
                    yield from self._out(c, 0, theirs)
                    self.empty[0].arrive()
                    if own:
                        yield from self._score(c, k)
                        self._publish(mine)
                        self.pub[1].arrive()
                        yield from self._out(c, 1, mine)
                    if m != "pre_release_early" or not own:
                        self.empty[1].arrive()
            else:
                if own:
                    yield from self._score(c, k)
                if c == 0:
                    self._publish(mine)
                    self.pub[0].arrive()
                    if other:
                        yield from self._sync(1)
                        self._take(theirs)
                else:
                    if m == "publish_before_take" and own:
                        self._publish(mine)
                        self.pub[1].arrive()
                    yield from self._sync(0)
                    self._take(theirs)
                    if own and m != "publish_before_take":
                        self._publish(mine)
                        self.pub[1].arrive()
                if own:
                    yield from self._out(c, c, mine)
                if other:
                    yield from self._out(c, 1 - c, theirs)
                self.empty[0].arrive()
                self.empty[1].arrive()

    def run(self, rng):
        roles = [self.producer(), self.consumer(0), self.consumer(1)]
        steps = 0
        while roles:
            r = rng.choice(roles)
            try:
                next(r)
            except StopIteration:
                roles.remove(r)
            steps += 1
            assert steps < 100000, f"deadlock at {self.ntiles} tiles"
        return self.outputs


@pytest.mark.parametrize("early", [False, True, "pre"], ids=["default", "early", "early_pre"])
def test_hm_pipeline_has_no_race_or_deadlock_and_each_consumer_covers_every_tile(early):
    """Every schedule completes; nobody reads a buffer that is being written or refilled, nor takes a P that is not
    the one it waits for; each consumer's output product covers every tile of the split exactly once."""
    for ntiles in [*range(0, 10), 17, 32]:
        for seed in range(30):
            outputs = _Pipeline(ntiles, early).run(random.Random(seed))
            for c in (0, 1):
                assert sorted(outputs[c]) == list(range(ntiles)), (ntiles, seed, c, outputs[c])


@pytest.mark.parametrize(("early", "mutation", "error"), [
    (True, "release_first", "written into buffer|refilled while"),  # buffer 0 released before its output product
    (False, "publish_before_take", "overwrote P|took P of"),  # consumer 1 publishes before taking consumer 0's P
    ("pre", "pre_release_early", "written into buffer|refilled"),  # buffer 1 freed with a score group in flight
])  # fmt: skip
def test_hm_protocol_model_notices_a_broken_order(early, mutation, error):
    """The model is not vacuous: an order that frees a buffer or the P buffer too early is caught in some schedule."""
    with pytest.raises(AssertionError, match=error):
        for seed in range(200):
            _Pipeline(8, early, mutation).run(random.Random(seed))


_HM_BARRIERS = r"""
#include <cstdio>
#include "mla_hm.cuh"
using namespace qmla::hm;
int main() {
  for (int g = 0; g < 5; ++g)
    for (int b = 0; b < 2; ++b) printf("full %d %d %d\n", g, b, full_bar(g, b));
  for (int b = 0; b < 2; ++b) printf("empty %d %d\n", b, empty_bar(b));
  for (int k = 0; k < 64; ++k) printf("parity %d %d %d\n", k, full_parity(k), k >= 2 ? empty_parity(k) : -1);
  printf("smem %d %d\n", B_SM, SMEM);
}
"""


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc (a host program built from mla_hm.cuh; no GPU)")
def test_the_kernel_waits_with_the_parities_the_model_runs(tmp_path):
    """mla_hm.cuh's barrier offsets and wait parities, compiled into a host program: the twelve mbarriers are distinct
    8-byte slots inside the kernel's shared memory, and the parities are the ones the model above was run with."""
    (tmp_path / "b.cu").write_text(_HM_BARRIERS)
    r = subprocess.run([find_nvcc(), "-std=c++17", "-I", str(CSRC), "-o", str(tmp_path / "b"), str(tmp_path / "b.cu")],
                       capture_output=True, text=True, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = subprocess.run([str(tmp_path / "b")], capture_output=True, text=True, check=True).stdout.splitlines()
    rows = [line.split() for line in out if line]
    slots = [int(r[-1]) for r in rows if r[0] in ("full", "empty")]
    b_sm, smem = next((int(r[1]), int(r[2])) for r in rows if r[0] == "smem")
    assert len(slots) == 12 and len(set(slots)) == 12 and all(s % 8 == 0 and b_sm + s + 8 <= smem for s in slots)
    for _, k, full, empty in (r for r in rows if r[0] == "parity"):
        k = int(k)
        assert int(full) == _full_parity(k)
        if k >= 2:
            assert int(empty) == _empty_parity(k)
