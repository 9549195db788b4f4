"""Run by the serving Python: the NCCL preflight, one process a GPU, a local rendezvous, a few
all-reduces; prints the bandwidth and whether the sum came out right as one JSON line.

argv: the number of GPUs, the bytes per all-reduce, the iterations.
"""

if __name__ not in ("__main__", "__mp_main__"):  # a program the agent runs (python -c, or a spawned child)
    raise ImportError(__name__ + " is a program the deploy agent runs, not a module to import")

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port, size, iters, queue):
    """One rank: join the local rendezvous, all-reduce, check the sum, time it."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    x = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    right = bool((x == world).all().item())
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(x)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    if rank == 0:
        queue.put({"right": right, "seconds": seconds})
    dist.destroy_process_group()


if __name__ == "__main__":
    world, size, iters = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(worker, args=(world, port, size, iters, queue), nprocs=world, start_method="spawn")
    r = queue.get(timeout=5)
    algbw = size * iters / r["seconds"] / 1e9
    print(
        json.dumps(
            {
                "gpus": world,
                "bytes": size,
                "iterations": iters,
                "seconds": r["seconds"],
                "right": r["right"],
                "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (world - 1) / world,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                "torch": torch.__version__,
            }
        )
    )
