"""Model check of the synchronization protocol of the wgmma backward's d <= 128
main kernel, v6 (csrc/hopper/bwd_wgmma_e4m3_blockscale_sm90.cu; the argument in
docs/kernels/bwd_wgmma_e4m3_blockscale_sm90.md, "v6"). CPU only; it checks the
protocol as written down here, not the CUDA code: keep the two in step.

Agents: the 8 warps (each stands for its 32 threads: every mbarrier expects 256
thread arrivals, i.e. 8 warp arrivals here). Per tile pair `it` (stage and dS
buffer it & 1) a warp does, in program order (kWgStageIssue picks one of the
three issue points):

    wait full[st] (parity (it >> 1) & 1)               reads stage st until its empty arrive
    [issue point 0]  S, P, dV  [issue point 1]  dP, dS
    it >= 2: wait ds_empty[st] (parity ((it >> 1) & 1) ^ 1)
    named barrier (its warpgroup) x 2, store its dS columns into buffer st, arrive ds_full[st]
    [issue point 2]  dK
    it > 0: wait ds_full[st ^ 1] (parity ((it - 1) >> 1) & 1), read buffer st ^ 1 (dQ of pair it - 1)
    arrive empty[st]; it > 0: arrive ds_empty[st ^ 1]
  issue: it + 1 < n_iters: it >= 1: wait empty[st ^ 1] (parity ((it - 1) >> 1) & 1);
         copies of pair it + 1 into stage st ^ 1, whose completion (asynchronous,
         any later time) arrives on full[st ^ 1]
  after the loop (n_iters > 0): dQ of the last pair (wait ds_full, read, arrive ds_empty).
  Prologue: pair 0's copies complete before every warp starts (cp.async.wait_group 0
  and __syncthreads); kWgPingpong: warpgroup 1 waits at named barrier 3 for
  warpgroup 0's arrive after its first dV.

Random interleavings (skewed warp speeds, random copy completion) check: no
deadlock; every mbarrier wait is released by exactly the completion it waits
for (no phase overrun); every read of a stage or dS buffer sees its own tile
pair's data, never overwritten while read. The mutation test shows that the
checks catch a missing wait, a wrong parity and an early arrive, at every
issue point, with and without pingpong.
"""
import random

import pytest


class MBar:
    def __init__(self, name, count):
        self.name, self.count, self.pending, self.phase = name, count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0, self.name
        if self.pending == 0:
            self.phase += 1
            self.pending = self.count

    def done(self, parity):  # mbarrier.try_wait.parity: the phase of that parity completed
        return (self.phase & 1) != parity


# The protocol's parities and guards (the kernel's expressions), as mutable hooks.
PROTOCOL = {
    "full_parity": lambda it: (it >> 1) & 1,
    "empty_wait": True,
    "empty_parity": lambda it: ((it - 1) >> 1) & 1,
    "dse_wait": True,
    "dse_parity": lambda it: ((it >> 1) & 1) ^ 1,
    "dsf_wait": True,
    "dsf_parity": lambda j: (j >> 1) & 1,
    "empty_arrive_after_dk": True,
}


def simulate(n_iters, issue_point, pingpong, seed, proto=PROTOCOL):
    rng = random.Random(seed)
    W = 8
    speed = [rng.choice((0.02, 0.2, 1.0)) for _ in range(W + 1)]  # [W]: copy completion
    full = [MBar("full%d" % i, W) for i in range(2)]
    empty = [MBar("empty%d" % i, W) for i in range(2)]
    dsf = [MBar("ds_full%d" % i, W) for i in range(2)]
    dse = [MBar("ds_empty%d" % i, W) for i in range(2)]
    stage = [None, None]  # tile pair whose copies all completed in stage s
    stage_inflight = [0, 0]
    stage_readers = [set(), set()]
    ds = [[None] * W, [None] * W]  # ds[b][warp]: tile pair of the warp's dS columns in buffer b
    ds_readers = [set(), set()]
    pending = []  # copies in flight: (stage, pair)
    nb_count, nb_gen = {}, {}

    def nb_arrive(bid, n):
        c, g = nb_count.get(bid, 0) + 1, nb_gen.get(bid, 0)
        if c == n:
            nb_count[bid], nb_gen[bid] = 0, g + 1
        else:
            nb_count[bid] = c
        return g

    def check_stage(s, it):
        assert stage[s] == it and stage_inflight[s] == 0, ("stage read", s, it, stage[s])

    def warp(w):
        wg = w // 4
        if pingpong and n_iters > 0 and wg == 1:
            yield ("nb", 3, nb_arrive(3, 8))
        for it in range(n_iters):
            st = it & 1

            def issue_next():
                if it + 1 < n_iters:
                    if it >= 1 and proto["empty_wait"]:
                        yield ("wait", empty[st ^ 1], proto["empty_parity"](it), (it - 1) >> 1)
                    assert not any(p < it + 1 for _, p in stage_readers[st ^ 1]), ("stage overwritten while read", it + 1)
                    stage_inflight[st ^ 1] += 1
                    pending.append((st ^ 1, it + 1))

            yield ("wait", full[st], proto["full_parity"](it), it >> 1)
            check_stage(st, it)
            stage_readers[st].add((w, it))
            if not proto["empty_arrive_after_dk"]:
                empty[st].arrive()
            if issue_point == 0:
                yield from issue_next()
            yield ("work",)  # S, P, dV
            check_stage(st, it)
            if pingpong and it == 0 and wg == 0:
                nb_arrive(3, 8)
            if issue_point == 1:
                yield from issue_next()
            yield ("work",)  # dP, dS
            check_stage(st, it)
            if it >= 2 and proto["dse_wait"]:
                yield ("wait", dse[st], proto["dse_parity"](it), (it - 2) >> 1)
            for _ in range(2):  # amax -> scales -> stores
                yield ("nb", 1 + wg, nb_arrive(1 + wg, 4))
            assert not any(p < it for _, p in ds_readers[st]), ("dS buffer overwritten while read", it)
            ds[st][w] = it
            dsf[st].arrive()
            if issue_point == 2:
                yield from issue_next()
            yield ("work",)  # dK
            check_stage(st, it)
            if it > 0:
                if proto["dsf_wait"]:
                    yield ("wait", dsf[st ^ 1], proto["dsf_parity"](it - 1), (it - 1) >> 1)
                assert all(x == it - 1 for x in ds[st ^ 1]), ("dS read", it - 1, ds[st ^ 1])
                ds_readers[st ^ 1].add((w, it - 1))
            yield ("work",)
            stage_readers[st].discard((w, it))
            if proto["empty_arrive_after_dk"]:
                empty[st].arrive()
            if it > 0:
                yield ("work",)  # dQ chunks
                assert all(x == it - 1 for x in ds[st ^ 1])
                ds_readers[st ^ 1].discard((w, it - 1))
                dse[st ^ 1].arrive()
        if n_iters > 0:
            j = n_iters - 1
            if proto["dsf_wait"]:
                yield ("wait", dsf[j & 1], proto["dsf_parity"](j), j >> 1)
            assert all(x == j for x in ds[j & 1]), ("dS read", j, ds[j & 1])
            ds_readers[j & 1].add((w, j))
            yield ("work",)
            ds_readers[j & 1].discard((w, j))
            dse[j & 1].arrive()
        yield ("end",)

    if n_iters > 0:  # prologue: pair 0 complete before any warp starts
        stage[0] = 0
        for _ in range(W):
            full[0].arrive()
    progs = [warp(w) for w in range(W)]
    state = [next(p) for p in progs]
    while True:
        runnable = []
        for w, a in enumerate(state):
            if a[0] == "end":
                continue
            if a[0] == "wait" and not a[1].done(a[2]):
                continue
            if a[0] == "nb" and nb_gen.get(a[1], 0) <= a[2]:
                continue
            runnable.append(w)
        choices = runnable + (["copy"] if pending else [])
        if not choices:
            assert all(a[0] == "end" for a in state), ("deadlock", [(a[0],) + tuple(getattr(x, "name", x) for x in a[1:]) for a in state])
            return
        c = rng.choices(choices, weights=[speed[W] if x == "copy" else speed[x] for x in choices])[0]
        if c == "copy":
            s, pair = pending.pop(rng.randrange(len(pending)))
            stage_inflight[s] -= 1
            if stage_inflight[s] == 0:
                stage[s] = pair
            full[s].arrive()
            continue
        a = state[c]
        if a[0] == "wait":
            assert a[1].phase == a[3] + 1, ("phase overrun", a[1].name, a[1].phase, a[3])
        state[c] = next(progs[c])


@pytest.mark.parametrize("n_iters", [0, 1, 2, 3, 4, 7])
@pytest.mark.parametrize("issue_point", [0, 1, 2])
@pytest.mark.parametrize("pingpong", [False, True])
def test_protocol_deadlock_free_and_ordered(n_iters, issue_point, pingpong):
    # n_iters: tile pairs of one CTA, i.e. GQA group x query tiles (0: a causal
    # CTA whose keys no query sees; it only writes dK = dV = 0).
    for seed in range(60):
        simulate(n_iters, issue_point, pingpong, seed)


MUTATIONS = {
    "no empty wait": {"empty_wait": False},
    "no ds_empty wait": {"dse_wait": False},
    "no ds_full wait": {"dsf_wait": False},
    "ds_empty parity off by one phase": {"dse_parity": lambda it: (it >> 1) & 1},
    "full parity from it & 1": {"full_parity": lambda it: it & 1},
    "empty arrive right after the full wait": {"empty_arrive_after_dk": False},
    "ds_full parity off by one phase": {"dsf_parity": lambda j: ((j >> 1) & 1) ^ 1},
    "empty parity off by one phase": {"empty_parity": lambda it: (((it - 1) >> 1) & 1) ^ 1},
}


@pytest.mark.parametrize("pingpong", [False, True])  # True: the default (config_sm90.h kWgPingpong)
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_protocol_checks_catch_mutations(name, pingpong):
    proto = dict(PROTOCOL, **MUTATIONS[name])
    failures = [0, 0, 0]  # per issue point: each configuration must catch it
    for n_iters in (2, 3, 4, 5):
        for issue_point in (0, 1, 2):
            for seed in range(40):
                try:
                    simulate(n_iters, issue_point, pingpong, seed, proto)
                except AssertionError:
                    failures[issue_point] += 1
    assert all(f > 0 for f in failures), (name, failures)
