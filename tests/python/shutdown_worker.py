"""One rank of the ddp.shutdown tests of tests/python/test_ddp.py (test_shutdown_*).

Usage: python shutdown_worker.py MODE   (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the env)

Makes the groups a training run makes, as it makes them: the default group
(ddp.init_from_env, gloo), context-parallel subgroups (ddp.new_group, one per pair
of ranks, as trainer.setup_context_parallel) and a 2-D DeviceMesh (ddp.device_mesh;
its 1-rank dimension gets groups of its own, the other is the default group), a
collective on each, and drops its own references to them (the trainer's models die
with train_mode). Then tears them down:
  shutdown:      ddp.shutdown()
  default_only:  a barrier and dist.destroy_process_group() (the previous
                 ddp.shutdown: the subgroups and mesh groups outlive it)
and prints one JSON line: the live threads (/proc/self/task, by name) before the
init, before the teardown and after it (polled for up to 5 s: a thread ends as its
group's last reference is dropped), and the live process groups before and after.
  peer_late:     rank 1 sleeps 8 s before its ddp.shutdown(); rank 0 calls
                 ddp.shutdown(timeout_s=1) and prints {"ok", "wait_s"} (rank 1
                 prints {"ok"} if its shutdown returns).
"""
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from fp8attn.train import ddp


def threads() -> dict:
    """{thread name: count} of this process's OS threads (gloo's are named pt_gloo_*
    once they have started; a thread just made still has the process's name)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:   # ended meanwhile
            continue
        out[name] = out.get(name, 0) + 1
    return out


def make_groups(world: int) -> None:
    for g in range(world // 2):
        grp = ddp.new_group(range(2 * g, 2 * g + 2))
        if grp != dist.GroupMember.NON_GROUP_MEMBER:
            dist.all_reduce(torch.ones(4), group=grp)
    mesh = ddp.device_mesh("cpu", (world, 1))
    for d in range(2):
        dist.all_reduce(torch.ones(4), group=mesh.get_group(d))
    dist.all_reduce(torch.ones(4))


def main():
    mode = sys.argv[1]
    torch.set_num_threads(1)
    torch.ones(2).add_(1)
    base = threads()
    ctx = ddp.init_from_env("cpu")
    assert ctx.enabled and ctx.world_size == int(os.environ["WORLD_SIZE"]), ctx
    make_groups(ctx.world_size)
    gc.collect()
    before, groups_before = threads(), len(ddp.live_groups())
    if mode == "shutdown":
        assert ddp.shutdown() is True
    elif mode == "peer_late":   # rank 1 reaches the barrier 8 s late: rank 0 gives up after 1 s
        if ctx.rank:
            time.sleep(8)
            ok = ddp.shutdown()
        else:
            t0 = time.monotonic()
            ok = ddp.shutdown(timeout_s=1.0)
            print(json.dumps({"rank": 0, "ok": ok, "wait_s": time.monotonic() - t0}), flush=True)
            return
        print(json.dumps({"rank": 1, "ok": ok}), flush=True)
        return
    elif mode == "default_only":
        dist.barrier()
        dist.destroy_process_group()
        gc.collect()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    t_end = time.monotonic() + 5.0
    after = threads()
    while sum(after.values()) > sum(base.values()) and time.monotonic() < t_end:
        time.sleep(0.05)
        after = threads()
    print(json.dumps({"rank": ctx.rank, "base": base, "before": before, "after": after,
                      "groups_before": groups_before, "groups_after": len(ddp.live_groups()),
                      "initialized_after": dist.is_initialized()}), flush=True)


if __name__ == "__main__":
    main()
