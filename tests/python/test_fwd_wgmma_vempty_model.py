"""Model check of the K/V stage protocol of the wgmma forward (d <= 128
fwd_wgmma_kernel and d >= 192 fwd_wgmma_d2_kernel; producer_warpgroup in
csrc/hopper/fwd_wgmma_e4m3_blockscale_sm90.cu), with the producer change
of branch fwd-vempty-wait (merged 2026-11-30): producer warps 1-3 wait v_empty[s] (parity ph ^ 1) before v_raw[s]
(parity ph) and their s_v stores. CPU only; it checks the protocol as written
down here, not the CUDA code: keep the two in step. Why: docs/kernels/
fwd_wgmma_e4m3_blockscale_sm90.md, "racecheck on reused K/V stages".

Agents (each one warp; key tile kt, stage s = kt % S, ph = (kt / S) & 1):
  warp 0:     wait k_empty[s] (ph ^ 1); store s_k[s]; arrive.expect_tx k_full[s]
              + K TMA into K[s]; wait v_empty[s] (ph ^ 1); arrive.expect_tx
              v_raw[s] + V TMA into V[s]
  warps 1-3:  [new] wait v_empty[s] (ph ^ 1); wait v_raw[s] (ph); read its
              slice of V[s] (raw), store it permuted, store its s_v[s]
              channels; arrive v_full[s]
  consumers (2 warpgroups x 4 warps, 3 for v11 in the n_mine tests; the kernel's per-thread arrivals on
              k_empty / v_empty, each after the thread's own reads, are one
              arrival of the warp here), per variant: wait k_full, QK^T reads
              K[s] (from issue to wgmma wait), softmax reads s_k[s], arrive
              k_empty[s]; wait v_full, P V reads V[s], promote reads s_v[s] in
              two channel chunks, arrive v_empty[s] after the last chunk.
              serial (v1, and the d2 kernel), overlap (v2: QK^T (kt + 1)
              before softmax (kt)), pingpong (v3, named barriers 1 / 2 around
              the wgmma issue slots).
An mbarrier phase completes when its pending arrivals and its transaction
bytes reach 0; a TMA completes at any later time (its data is "in flight"
until then); try_wait.parity p passes once the phase of parity p completed.

Happens-before by vector clocks, in two systems:
  full:   every mbarrier arrive -> wait of the completed phase, TMA issue ->
          its writes -> complete_tx, named barriers (the hardware order);
  direct: only the consumers' arrives on k_empty / v_empty and the producer's
          waits on them (plus program order and TMA issue): the order
          compute-sanitizer racecheck can see without following warp 0's
          arrive and the TMA completion on v_raw.
Checks: (1) no deadlock, and every wait is released by the phase it waits for
(no overrun); the new wait adds no stall (whenever it blocks, the v_raw wait
behind it would block too); (2) every read sees its own tile's data and every
pair of conflicting accesses is ordered in the full system; with the new wait
every consumer read of V / s_v / K / s_k is ordered before the next producer
store into that stage in the direct system; (3) main's protocol (no new wait)
passes the full system but fails the direct one exactly at warps 1-3's
stores; (4) the mutations in MUTATIONS fail.
Deadlock freedom (with no overrun, no partial phase at exit, no stall added
by the new wait) is also checked in every interleaving of the synchronization
operations of a reduced CTA (1 permuting warp, 1 consumer warp per
warpgroup; the shared-memory accesses, which never block, left out) for
n_tiles 0..5 at S = 2 (every stage reused twice) and 0..3 at S = 3; races
and stale reads rest on the vector clocks of the random runs.
"""
import random

import pytest

FULL, DIRECT = 0, 1

# The protocol's choices (the kernel's expressions), as mutable hooks.
PROTOCOL = {
    "perm_vempty_wait": True,                 # the branch's change (False: main)
    "perm_vempty_parity": lambda ph: ph ^ 1,
    "perm_vraw_wait": True,
    "w0_vempty_wait": True,
    "w0_kempty_wait": True,
    "vempty_after_last_chunk": True,          # False: arrive before the last s_v chunk read
    "kempty_after_softmax": True,             # False: arrive before the s_k reads
    # Serial schedule only (v1 / v11): key tiles each warpgroup computes, one
    # entry per warpgroup (None: 2 warpgroups computing every tile). A warpgroup
    # only hands the later tiles over: wait k_full, arrive k_empty, wait v_full,
    # arrive v_empty (the kernel's n_mine path).
    "n_mine": None,
    "skip_waits_for_stage": True,             # False: the hand-over arrives without waiting
}


def programs(n_tiles, S, variant, n_perm, n_cons, proto):
    """Op lists per agent (the control flow is static given n_tiles)."""
    def bar(kind, s):
        return (kind, s)

    w0 = []
    for kt in range(n_tiles):
        s, ph, u = kt % S, (kt // S) & 1, kt // S
        if proto["w0_kempty_wait"]:
            w0.append(("wait", bar("k_empty", s), ph ^ 1, u, None))
        w0.append(("write", ("sks", s), kt))
        w0.append(("tma", bar("k_full", s), (("sk", s),), kt))
        if proto["w0_vempty_wait"]:
            w0.append(("wait", bar("v_empty", s), ph ^ 1, u, None))
        w0.append(("tma", bar("v_raw", s), tuple(("sv", s, w) for w in range(n_perm)), kt))
    progs = {"w0": w0}
    for w in range(n_perm):
        p = []
        for kt in range(n_tiles):
            s, ph, u = kt % S, (kt // S) & 1, kt // S
            vraw = ("wait", bar("v_raw", s), ph, u + 1, None)
            if proto["perm_vempty_wait"]:
                p.append(("wait", bar("v_empty", s), proto["perm_vempty_parity"](ph), u, vraw))
            if proto["perm_vraw_wait"]:
                p.append(vraw)
            p.append(("read", ("sv", s, w), ("raw", kt)))
            p.append(("write", ("sv", s, w), ("perm", kt)))
            p.append(("write", ("svs", s, w), kt))
            p.append(("arrive", bar("v_full", s)))
        progs["p%d" % (w + 1)] = p
    n_mine = proto["n_mine"]
    n_wg = len(n_mine) if n_mine is not None else 2
    for c in range(n_cons):
        cw = c * n_wg // n_cons  # warpgroup of consumer warp c
        p = []

        def wait_k(kt):
            s = kt % S
            p.append(("wait", bar("k_full", s), (kt // S) & 1, kt // S + 1, None))
            p.append(("read", ("sk", s), kt))  # QK^T issue

        def softmax(kt):  # QK^T (kt) complete before it
            s = kt % S
            p.append(("read", ("sk", s), kt))  # the wgmma's last read (wait<0>)
            if not proto["kempty_after_softmax"]:
                p.append(("arrive", bar("k_empty", s)))
            p.append(("read", ("sks", s), kt))
            if proto["kempty_after_softmax"]:
                p.append(("arrive", bar("k_empty", s)))

        def pv_issue(kt):
            s = kt % S
            p.append(("wait", bar("v_full", s), (kt // S) & 1, kt // S + 1, None))
            p.extend(("read", ("sv", s, w), ("perm", kt)) for w in range(n_perm))

        def promote(kt):  # P V complete before it
            s = kt % S
            p.extend(("read", ("sv", s, w), ("perm", kt)) for w in range(n_perm))
            p.extend(("read", ("svs", s, w), kt) for w in range(n_perm))  # chunk 0
            if not proto["vempty_after_last_chunk"]:
                p.append(("arrive", bar("v_empty", s)))
            p.extend(("read", ("svs", s, w), kt) for w in range(n_perm))  # last chunk
            if proto["vempty_after_last_chunk"]:
                p.append(("arrive", bar("v_empty", s)))

        def turn_wait():
            p.append(("nbsync", 1 + cw))

        def turn_pass():
            p.append(("nbarrive", 1 + (cw ^ 1)))

        if variant == "serial":
            for kt in range(n_tiles):
                if n_mine is not None and kt >= n_mine[cw]:  # hand-over only
                    s, ph, u = kt % S, (kt // S) & 1, kt // S
                    if proto["skip_waits_for_stage"]:
                        p.append(("wait", bar("k_full", s), ph, u + 1, None))
                    p.append(("arrive", bar("k_empty", s)))
                    if proto["skip_waits_for_stage"]:
                        p.append(("wait", bar("v_full", s), ph, u + 1, None))
                    p.append(("arrive", bar("v_empty", s)))
                    continue
                wait_k(kt)
                softmax(kt)
                pv_issue(kt)
                promote(kt)
        elif variant == "overlap":
            if n_tiles > 0:
                wait_k(0)
            for kt in range(n_tiles):
                if kt + 1 < n_tiles:
                    wait_k(kt + 1)
                softmax(kt)
                pv_issue(kt)
                promote(kt)
        else:  # pingpong
            if cw == 1:
                p.append(("nbarrive", 1))  # warpgroup 0 starts
            if n_tiles > 0:
                turn_wait()
                wait_k(0)
                turn_pass()
            for kt in range(n_tiles):
                softmax(kt)
                turn_wait()
                pv_issue(kt)
                if kt + 1 < n_tiles:
                    wait_k(kt + 1)
                turn_pass()
                promote(kt)
            if cw == 0:
                turn_wait()
        progs["c%d" % c] = p
    counts = {}
    for s in range(S):
        counts[("k_full", s)] = 1     # warp 0 (one arrival per warp here) + TMA bytes
        counts[("k_empty", s)] = n_cons
        counts[("v_raw", s)] = 1      # warp 0's arrive.expect_tx + TMA bytes
        counts[("v_full", s)] = n_perm
        counts[("v_empty", s)] = n_cons
    return progs, counts


def key_tile(v):
    return v if isinstance(v, int) else v[1]


class Fail(Exception):
    pass


class Machine:
    """One CTA's state; step() runs one agent's op or completes one TMA."""

    def __init__(self, n_tiles, S, variant, n_perm, n_cons, proto, clocks=True, sync_only=False):
        self.progs, self.counts = programs(n_tiles, S, variant, n_perm, n_cons, proto)
        if sync_only:  # NOTE: shared-memory accesses never block: no effect on deadlock
            self.progs = {a: [op for op in p if op[0] not in ("read", "write")] for a, p in self.progs.items()}
        self.agents = sorted(self.progs)
        self.n_cons = n_cons
        self.pc = {a: 0 for a in self.agents}
        self.bars = {b: (0, c, 0) for b, c in self.counts.items()}  # phase, pending, tx
        self.locs = [(k, s) for k in ("sk", "sks") for s in range(S)] + \
            [(k, s, w) for k in ("sv", "svs") for s in range(S) for w in range(n_perm)]
        self.nb = {1: (0, 0), 2: (0, 0)}   # generation, arrivals
        self.nb_joined = {}                # agent -> generation it waits for
        self.mem = {}
        self.pending = []                  # TMA in flight: (bar, locs, tag, tma agent)
        self.clocks = clocks
        self.direct_misses = []            # (reader, writer, loc): not ordered in the direct system
        self.stalls = []                   # the new wait blocked while v_raw would not
        if clocks:
            self.vc = {a: [{a: 1}, {a: 1}] for a in self.agents}
            self.bar_acc = {b: [{}, {}] for b in self.counts}
            self.bar_rel = {}              # (bar, phase) -> clocks released by that phase
            self.nb_acc = {1: [{}, {}], 2: [{}, {}]}
            self.nb_rel = {}
            self.log = {}                  # loc -> [last write (agent, epoch), reads [(agent, epoch)]]
            self.consumer_reads = {}       # loc -> {consumer: (epoch, key tile)} of its last read
            self.n_tma = 0

    # ---- state for the exhaustive search ----
    def key(self):
        return (tuple(self.pc.values()), tuple(self.bars.values()), tuple(self.nb.values()),
                tuple(sorted(self.nb_joined.items())), tuple(self.mem.get(loc) for loc in self.locs),
                tuple(sorted((b, t) for b, _, t, _ in self.pending)))

    def copy(self):
        m = Machine.__new__(Machine)
        m.__dict__.update(self.__dict__)
        m.pc = dict(self.pc)
        m.bars = dict(self.bars)
        m.nb = dict(self.nb)
        m.nb_joined = dict(self.nb_joined)
        m.mem = dict(self.mem)
        m.pending = list(self.pending)
        return m

    # ---- clocks ----
    @staticmethod
    def _join(dst, src):
        for k, v in src.items():
            if dst.get(k, 0) < v:
                dst[k] = v

    def _tick(self, a):
        for sys in (FULL, DIRECT):
            self.vc[a][sys][a] = self.vc[a][sys].get(a, 0) + 1

    @staticmethod
    def _direct_edge(bar):
        return bar[0] in ("k_empty", "v_empty")

    def _release(self, a, bar):
        if self.clocks:
            self._join(self.bar_acc[bar][FULL], self.vc[a][FULL])
            if self._direct_edge(bar):
                self._join(self.bar_acc[bar][DIRECT], self.vc[a][DIRECT])
            self._tick(a)

    def _acquire(self, a, bar):
        rel = self.bar_rel.get((bar, self.bars[bar][0] - 1)) if self.clocks else None
        if rel is not None:
            self._join(self.vc[a][FULL], rel[FULL])
            if self._direct_edge(bar):
                self._join(self.vc[a][DIRECT], rel[DIRECT])

    def _update(self, bar, d_pending, d_tx):
        phase, pending, tx = self.bars[bar]
        pending, tx = pending + d_pending, tx + d_tx
        if pending == 0 and tx == 0:  # phase complete
            if self.clocks:
                self.bar_rel[(bar, phase)] = self.bar_acc[bar]
                self.bar_acc[bar] = [{}, {}]
            phase, pending = phase + 1, self.counts[bar]
        self.bars[bar] = (phase, pending, tx)

    def _arrive(self, a, bar, tx=0):
        if self.bars[bar][1] == 0:
            raise Fail(("arrival on a full phase", bar))
        self._release(a, bar)
        self._update(bar, -1, tx)

    def _access(self, a, loc, write, clk, tag):
        """Race check of one access by agent a (clocks clk) of use `tag` (key tile)."""
        if not self.clocks:
            return
        ent = self.log.setdefault(loc, [None, []])
        epoch = clk[FULL].get(a, 0)
        prior = ([ent[0]] if ent[0] else []) + (ent[1] if write else [])
        for b, e in prior:
            if b != a and clk[FULL].get(b, 0) < e:
                raise Fail(("race", loc, b, a))
        if write:
            ent[0], ent[1] = (a, epoch), []
        else:
            ent[1] = [(b, e) for b, e in ent[1] if b != a] + [(a, epoch)]
        # direct system: each consumer's last read of loc against every producer
        # store of a later key tile into it
        last = self.consumer_reads.setdefault(loc, {})
        if a.startswith("c"):
            last[a] = (epoch, tag)
        elif write:
            for b, (e, t) in last.items():
                if t < tag and clk[DIRECT].get(b, 0) < e:
                    self.direct_misses.append((b, a, loc))

    # ---- scheduling ----
    def done(self, bar, parity):  # mbarrier.try_wait.parity
        return (self.bars[bar][0] & 1) != parity

    def runnable(self):
        out = []
        for a in self.agents:
            prog, pc = self.progs[a], self.pc[a]
            if pc == len(prog):
                continue
            op = prog[pc]
            if op[0] == "wait" and not self.done(op[1], op[2]):
                nxt = op[4]
                if nxt is not None and self.done(nxt[1], nxt[2]):
                    self.stalls.append((a, op[1]))
                continue
            if op[0] == "nbsync" and a in self.nb_joined and self.nb[op[1]][0] <= self.nb_joined[a]:
                continue
            out.append(a)
        return out + ["tma%d" % i for i in range(len(self.pending))]

    def finished(self):
        return all(self.pc[a] == len(self.progs[a]) for a in self.agents) and not self.pending

    def step(self, c):
        if c.startswith("tma"):
            bar, locs, tag, ta = self.pending.pop(int(c[3:]))
            for loc in locs:
                self.mem[loc] = ("raw", tag) if loc[0] == "sv" else tag
            if self.clocks:  # complete_tx: the TMA's writes released on the barrier
                self._join(self.bar_acc[bar][FULL], self.vc[ta][FULL])
            self._update(bar, 0, -1)
            return
        a = c
        op = self.progs[a][self.pc[a]]
        self.pc[a] += 1
        kind = op[0]
        if kind == "wait":
            if self.bars[op[1]][0] != op[3]:
                raise Fail(("phase overrun", a, op[1], self.bars[op[1]][0], op[3]))
            self._acquire(a, op[1])
        elif kind == "arrive":
            self._arrive(a, op[1])
        elif kind == "tma":
            bar, locs, tag = op[1], op[2], op[3]
            self._arrive(a, bar, tx=1)  # arrive.expect_tx, then the copy
            ta = None
            if self.clocks:
                self.n_tma += 1
                ta = "tma%d" % self.n_tma
                self.vc[ta] = [dict(self.vc[a][FULL]), dict(self.vc[a][DIRECT])]
                self.vc[ta][FULL][ta] = self.vc[ta][DIRECT][ta] = 1
            for loc in locs:
                self._access(ta, loc, True, self.vc[ta] if self.clocks else None, tag)
                self.mem[loc] = ("tma", tag)  # in flight: reading it sees partial data
            self.pending.append((bar, locs, tag, ta))
        elif kind == "read":
            if self.mem.get(op[1]) != op[2]:
                raise Fail(("stale read", a, op[1], self.mem.get(op[1]), op[2]))
            self._access(a, op[1], False, self.vc[a] if self.clocks else None, key_tile(op[2]))
            if self.clocks:
                self._tick(a)
        elif kind == "write":
            self._access(a, op[1], True, self.vc[a] if self.clocks else None, key_tile(op[2]))
            self.mem[op[1]] = op[2]
            if self.clocks:
                self._tick(a)
        elif kind == "nbsync" and a in self.nb_joined:  # generation complete: pass
            gen = self.nb_joined.pop(a)
            if self.clocks:
                self._join(self.vc[a][FULL], self.nb_rel[(op[1], gen)][FULL])
        elif kind in ("nbsync", "nbarrive"):  # bar.sync joins (and waits), bar.arrive only joins
            gen, n_arr = self.nb[op[1]]
            if self.clocks:
                self._join(self.nb_acc[op[1]][FULL], self.vc[a][FULL])
                self._tick(a)
            if n_arr + 1 == self.n_cons:  # 256 threads: one warpgroup syncs, the other arrives
                if self.clocks:
                    self.nb_rel[(op[1], gen)] = self.nb_acc[op[1]]
                    self.nb_acc[op[1]] = [{}, {}]
                self.nb[op[1]] = (gen + 1, 0)
            else:
                self.nb[op[1]] = (gen, n_arr + 1)
            if kind == "nbsync":
                self.nb_joined[a] = gen
                self.pc[a] -= 1  # the same op passes once the generation completes

    def check_end(self):
        partial = [b for b, st in self.bars.items() if st[1] != self.counts[b] or st[2]]
        if partial:
            raise Fail(("partial mbarrier phase at exit", partial))
        if any(v[1] for v in self.nb.values()):
            raise Fail(("named barrier arrival left", self.nb))


def simulate(n_tiles, S, variant, seed, proto=PROTOCOL, n_perm=3, n_cons=8):
    """One random interleaving (skewed agent speeds); returns the Machine, or
    raises Fail."""
    rng = random.Random(seed)
    m = Machine(n_tiles, S, variant, n_perm, n_cons, proto)
    speed = {a: rng.choice((0.02, 0.2, 1.0)) for a in m.agents}
    speed_tma = rng.choice((0.02, 0.2, 1.0))
    while True:
        choices = m.runnable()
        if not choices:
            if not m.finished():
                raise Fail(("deadlock", {a: m.progs[a][m.pc[a]] for a in m.agents if m.pc[a] < len(m.progs[a])}))
            m.check_end()
            return m
        c = rng.choices(choices, weights=[speed_tma if x.startswith("tma") else speed[x] for x in choices])[0]
        m.step(c)


def explore(n_tiles, S, variant, proto=PROTOCOL):
    """Every interleaving of the synchronization operations (mbarrier, named
    barrier, TMA issue and completion; the shared-memory accesses left out,
    they never block) of the reduced CTA (1 permuting warp, 1 consumer warp per
    warpgroup): no deadlock, no phase overrun, no partial phase at exit, the
    new wait never stalls beyond v_raw. Returns the number of states, or
    raises Fail."""
    m0 = Machine(n_tiles, S, variant, 1, 2, proto, clocks=False, sync_only=True)
    seen, stack = {m0.key()}, [m0]
    if m0.stalls:
        raise Fail(("new wait stalls beyond v_raw", m0.stalls[:3]))
    while stack:
        m = stack.pop()
        choices = m.runnable()
        if not choices:
            if not m.finished():
                raise Fail(("deadlock", {a: m.progs[a][m.pc[a]] for a in m.agents if m.pc[a] < len(m.progs[a])}))
            m.check_end()
            continue
        for c in choices:
            n = m.copy()
            n.step(c)
            k = n.key()
            if k not in seen:
                seen.add(k)
                stack.append(n)
    if m0.stalls:  # shared by every copy
        raise Fail(("new wait stalls beyond v_raw", m0.stalls[:3]))
    return len(seen)


VARIANTS = ["pingpong", "serial", "overlap"]  # pingpong: v3 at d <= 128; serial: v1 and the d2 kernel
SEEDS = range(10)


@pytest.mark.parametrize("S", [2, 3])  # 2: config_sm90.h fwdw::kStages
@pytest.mark.parametrize("variant", VARIANTS)
def test_branch_protocol_every_interleaving_of_reduced_cta(variant, S):
    """(1) exhaustively: n_tiles up to 2 S + 1 (every stage reused twice, both
    parities of every barrier) at S = 2; up to S (one reuse) at S = 3. The
    state count grows linearly in n_tiles (the protocol's window is bounded)."""
    for n in range(0, 2 * S + 2 if S == 2 else S + 1):
        assert explore(n, S, variant) > 0


@pytest.mark.parametrize("S", [2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_branch_protocol_ordered_directly_through_v_empty(variant, S):
    """(1) and (2) under random interleavings of the whole CTA (3 permuting
    warps, 8 consumer warps): no deadlock, no stale read or race; every
    consumer read of a stage is ordered before the next producer store into it
    through the empty barrier itself; the new wait never stalls a warp that the
    v_raw wait behind it would not stall."""
    for n in (0, 1, 2 * S + 1):
        for seed in SEEDS:
            m = simulate(n, S, variant, 1000 * n + seed)
            assert not m.direct_misses, m.direct_misses[:3]
            assert not m.stalls, m.stalls[:3]


@pytest.mark.parametrize("S", [2, 3])
@pytest.mark.parametrize("variant", VARIANTS)
def test_main_protocol_ordered_only_through_warp_0(variant, S):
    """(3): main's protocol (no v_empty wait in warps 1-3) is ordered in the
    full system (no race, no stale read), but a consumer's read of V[s] /
    s_v[s] reaches warps 1-3's next stores into s only through warp 0's arrive
    on v_raw and the TMA completion: the direct system misses exactly those
    pairs (what racecheck reported), and only once a stage is reused."""
    proto = dict(PROTOCOL, perm_vempty_wait=False)
    missed = set()
    for n in (1, S, 2 * S + 1):
        for seed in SEEDS[:6]:
            m = simulate(n, S, variant, 1000 * n + seed, proto)
            missed |= {(w[0], loc[0]) for _, w, loc in m.direct_misses}
            if n <= S:  # no stage reused: nothing to order
                assert not m.direct_misses
    assert missed == {("p", "sv"), ("p", "svs")}, missed


RACY = {"stale read", "race"}
MUTATIONS = {
    # name: (protocol change, failures it may cause under random interleavings,
    #        whether the synchronization alone fails in the exhaustive search)
    "new wait with parity ph": ({"perm_vempty_parity": lambda ph: ph}, {"deadlock"}, True),
    "consumers release v_empty before their last s_v read": ({"vempty_after_last_chunk": False}, RACY, False),
    "warp 0 does not wait v_empty": ({"w0_vempty_wait": False}, RACY | {"arrival on a full phase"}, True),
    "warps 1-3 wait v_empty but not v_raw": ({"perm_vraw_wait": False}, RACY, True),
    "consumers release k_empty before their s_k read": ({"kempty_after_softmax": False}, RACY, False),
    "warp 0 does not wait k_empty": ({"w0_kempty_wait": False}, RACY | {"arrival on a full phase", "deadlock"}, True),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_mutations_fail(name, variant):
    """(4): each slip fails under random interleavings (every seed, with the
    failure it should cause) and, where it breaks the synchronization itself,
    in the exhaustive search (a deadlock: the "new wait with parity ph" hangs
    at key tile 0, v_full[0] waiting for the warps that wait for it)."""
    change, want, sync_fails = MUTATIONS[name]
    proto = dict(PROTOCOL, **change)
    S = 2
    fails = []
    for seed in SEEDS:
        try:
            simulate(2 * S + 1, S, variant, seed, proto)
        except Fail as e:
            fails.append(e.args[0][0])
    assert len(fails) == len(SEEDS) and set(fails) <= want, (name, fails)
    if sync_fails:  # (the others slip in the data accesses only)
        with pytest.raises(Fail) as ei:
            explore(2 * S + 1, S, variant, proto)
        assert ei.value.args[0][0] in want | {"deadlock"}, ei.value


N_MINE_CASES = [  # (S, n_tiles, n_mine per warpgroup): 2 warpgroups (v1) and 3 (v11)
    (S, n, nm) for S in (2, 3) for n in (1, S, 2 * S + 1)
    for nm in ((0, n), (n - 1, n), (0, 0), (n, 0, n), (1, n, 0), (0, 1, 2))
    if all(x <= n for x in nm)
]


@pytest.mark.parametrize("S,n,n_mine", N_MINE_CASES, ids=str)
def test_serial_handover_of_unseen_tiles(S, n, n_mine):
    """The serial schedules' n_mine path (a warpgroup computes only the key
    tiles its rows see and hands the rest over), 2 and 3 warpgroups: no
    deadlock, stale read or race under random interleavings of the full CTA
    (4 warps per warpgroup), every read ordered directly through the empty
    barriers; with 2 warpgroups also every interleaving of the reduced CTA."""
    proto = dict(PROTOCOL, n_mine=n_mine)
    for seed in SEEDS[:4]:
        m = simulate(n, S, "serial", 7919 * seed + n, proto, n_cons=4 * len(n_mine))
        assert not m.direct_misses and not m.stalls, (m.direct_misses[:2], m.stalls[:2])
    if len(n_mine) == 2 and n <= 2 * S + 1:
        assert explore(n, S, "serial", proto) > 0


def test_serial_handover_without_stage_wait_fails():
    """Mutation: the hand-over arrives on k_empty / v_empty without waiting
    for the stage, so the arrival can count toward the previous phase while
    the other warpgroups still read the stage."""
    proto = dict(PROTOCOL, n_mine=(0, 5, 5), skip_waits_for_stage=False)
    fails = []
    for seed in SEEDS:
        try:
            simulate(5, 2, "serial", seed, proto, n_cons=12)
        except Fail as e:
            fails.append(e.args[0][0])
    assert len(fails) == len(SEEDS) and set(fails) <= RACY | {"deadlock", "arrival on a full phase"}, fails


def test_mbarrier_parity_wait_semantics():
    """The model's try_wait.parity: parity 1 passes on a fresh barrier (the
    phase before phase 0 counts as completed), parity 0 after one completion;
    two completions later the same parity blocks again (why a wait that lags
    two phases would hang)."""
    m = Machine(0, 2, "serial", 1, 2, PROTOCOL)
    b = ("v_empty", 0)
    assert m.done(b, 1) and not m.done(b, 0)
    m._arrive("c0", b)
    m._arrive("c1", b)
    assert m.done(b, 0) and not m.done(b, 1)
    m._arrive("c0", b)
    m._arrive("c1", b)
    assert m.done(b, 1) and not m.done(b, 0)
