"""The tutorial's elastic_train.py (../shared/reference, section 3.2) with one added line, the
``@restartable`` decorator, and the resilient_comm backends in place of nccl/gloo::

    resilient-run --nproc-per-node 4 -m resilient_comm.examples.elastic_train

Kill any worker (``kill -9 <pid>``): the survivors' all_reduce fails at once, ``main`` is
unwound and called again in the same processes with the new world, and ``load_step`` resumes
from the checkpoint -- no process restart. Without the decorator the same script recovers
under ``resilient-run --max-restarts 3`` by restarting every process (or, unmodified, under
``resilient-run --in-process``).

Environment (for tests and ``resilient-comm bench recovery``; the tutorial's values by
default): ELASTIC_CKPT (checkpoint path), ELASTIC_STEPS (60), ELASTIC_SLEEP_S (1.0).
"""

import os
import time

import torch
import torch.distributed as dist

import resilient_comm  # noqa: F401  (registers the resilient_* backends)
from resilient_comm.elastic import restartable

CKPT = os.environ.get("ELASTIC_CKPT", "/tmp/elastic_ckpt.pt")


def setup():
    use_cuda = torch.cuda.is_available()
    backend = "resilient_nccl" if use_cuda else "resilient_tcp"
    dist.init_process_group(backend=backend)
    rank = dist.get_rank()
    world = dist.get_world_size()
    print(f"[rank {rank}] joined, world_size={world}, backend={backend}, pid={os.getpid()}", flush=True)
    return rank, world, use_cuda


def load_step():
    if os.path.exists(CKPT):
        step = torch.load(CKPT)["step"]
        print(f"[resume] from checkpoint, step={step}", flush=True)
        return step
    return 0


@restartable
def main():
    rank, world, use_cuda = setup()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    step = load_step()
    max_steps = int(os.environ.get("ELASTIC_STEPS", "60"))
    pause = float(os.environ.get("ELASTIC_SLEEP_S", "1.0"))
    while step < max_steps:
        g = torch.ones(1, device=device) * (rank + 1)
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        print(f"[rank {rank}] step={step} world={world} sum={g.item():.0f} t={time.time():.6f}", flush=True)
        if rank == 0 and step % 5 == 0:
            torch.save({"step": step}, CKPT)
            print(f"[ckpt] step={step} saved, allreduce_sum={g.item():.0f}", flush=True)
        step += 1
        time.sleep(pause)
    print(f"[rank {rank}] DONE at step={step} pid={os.getpid()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
