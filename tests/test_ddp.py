"""DistributedDataParallel: 2 CPU processes (gloo), each on half the batch, give the same parameter gradients
as one process on the whole batch, for the reference model and for the fused model (the Triton kernels,
through the interpreter on CPU). The workers are spawned from the test with a deadline."""
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import vit_fast

from .numerics import assert_close, bound

WORLD = 2
BATCH = 4  # 2 images per rank
BACKENDS = ("torch", "triton")
TIMEOUT_S = 180


def make_model(backend: str) -> vit_fast.VisionTransformer:
    torch.manual_seed(0)  # every rank builds the same weights (DDP would broadcast rank 0's anyway)
    return vit_fast.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=4, num_classes=10,
                                      init_values=0.1, backend=backend).train()


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 3, 32, 32, generator=g, device="cpu"),
            torch.randint(0, 10, (BATCH,), generator=g, device="cpu"))


def grads_of(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, ddp=None) -> dict:
    loss = F.cross_entropy((ddp or model)(images), labels)  # mean over the local batch; DDP averages ranks
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    try:
        images, labels = make_batch()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        result = {}
        for backend in BACKENDS:
            model = make_model(backend)
            ddp = torch.nn.parallel.DistributedDataParallel(model)
            result[backend] = grads_of(model, images[shard], labels[shard], ddp)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_workers(tmp_path) -> list[dict]:
    context = mp.start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"DDP workers did not finish within {TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_ddp_gradients_equal_single_process_on_the_whole_batch(tmp_path):
    per_rank = run_workers(tmp_path)
    images, labels = make_batch()
    for backend in BACKENDS:
        single = grads_of(make_model(backend), images, labels)
        assert set(per_rank[0][backend]) == set(single)
        for name, grad in single.items():
            assert torch.equal(per_rank[0][backend][name], per_rank[1][backend][name]), (
                f"{backend} {name}: ranks differ")
            assert_close(per_rank[0][backend][name], grad, bound(torch.float32, "dot"), name=f"{backend} grad {name}")
        # the comparison can fail: one rank's local gradient alone is not the all-reduced one
        local = grads_of(make_model(backend), images[: BATCH // WORLD], labels[: BATCH // WORLD])
        assert not torch.allclose(local["head.weight"], single["head.weight"], rtol=1e-3)
