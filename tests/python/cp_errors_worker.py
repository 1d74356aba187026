"""One rank of the context-parallel error tests (tests/python/test_context_parallel.py):
python cp_errors_worker.py RANK WORLD INIT_FILE CASE. Prints "RAISED <type>: <message>"
for the call's error (or "OK"), then exits 0; a hang is the caller's timeout."""
import sys

import torch
import torch.distributed as dist

import fp8attn  # noqa: F401
from fp8attn import context_parallel as cp


def main():
    rank, world, init, case = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    full = torch.randn(1, 2, 256, 32, generator=g)
    x = cp.shard(full, rank=rank, world_size=world)
    kw = {}
    try:
        if case == "causal":
            kw["causal"] = rank == 0
            cp.ring_attention(x, x, x, **kw)
        elif case == "heads":
            y = x if rank == 0 else torch.randn(1, 4, x.shape[2], 32)
            cp.ring_attention(y, y, y)
        elif case == "lengths":      # [0, 0, 50]-like: only some ranks see the mismatch locally
            n = 50 if rank == world - 1 else 0
            y = torch.randn(1, 2, n, 32)
            cp.ring_attention(y, y, y)
        elif case == "unshard":
            cp.unshard(x, 300)
        elif case == "ok":
            cp.ring_attention(x, x, x, causal=True)
        print("OK", flush=True)
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        print(f"RAISED {type(exc).__name__}: {exc}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
