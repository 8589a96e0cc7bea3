"""The in-process part of bench/ckpt.py: what each rank measures under `mpiexec` (raw write and
cold read, the memcpy floor, sync save and cold load, optimizer-state preparation and, with
`--async`, the async stage stall, readiness check, drain and save-to-marker), printed by rank 0
as one RESULT line. `bench/ckpt.py --role ranks` runs it; the model sizes live here, the one
place both parts read them."""

from __future__ import annotations

import gc
import json
import os
import statistics
import time
from pathlib import Path

# name -> worker model flags; state = params + two AdamW moments, fp32.
SIZES = {
    300: ["--dim", "512", "--n-layers", "6", "--n-heads", "8", "--n-kv-heads", "4",
          "--ffn-dim", "1536", "--vocab-size", "8192"],
    3000: ["--dim", "1536", "--n-layers", "9", "--n-heads", "12", "--n-kv-heads", "4",
           "--ffn-dim", "4096", "--vocab-size", "8192"],
}  # fmt: skip
COMMON = ["--seq-len", "32", "--batch-size", "1", "--log-every", "1000"]
RESULT = "BENCH-RESULT "


def evict(path: Path) -> None:
    """Drop a file's (or a directory's files') pages from the page cache: the next read is cold."""
    targets = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
    for p in targets:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ranks_main(size: int, workdir: Path, with_async: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from worker.args import parse_args
    from worker.build import build_model
    from worker.ckpt.async_save import AsyncCheckpointer, Readiness
    from worker.ckpt.checkpointer import Checkpointer
    from worker.ckpt.live_state import prefill_adamw_state
    from worker.ckpt.resume import RunIdentity
    from worker.ckpt.storage import shard_name
    from worker.dist import detect_rank, init_process_group
    from worker.parallel import build_mesh
    from worker.train import plan

    info = detect_rank(os.environ)
    torch.set_num_threads(1)
    args = parse_args([*SIZES[size], *COMMON])
    cfg, layout = plan(args, info)
    init_process_group(info, "gloo", "cpu", 600)
    mesh = build_mesh(layout, "cpu")
    model = build_model(cfg, mesh, layout, torch.device("cpu"), True, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    gc.freeze()  # as the worker does once the model is built

    def forward_backward() -> float:
        t0 = time.perf_counter()
        tokens = torch.randint(0, cfg.vocab_size, (1, cfg.seq_len + 1))
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        return time.perf_counter() - t0

    def update() -> None:
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def train_step() -> None:
        forward_backward()
        update()

    train_step()  # real Adam moments
    out: dict[str, float] = {}

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def total(nbytes: int) -> int:
        t = torch.tensor([nbytes], dtype=torch.int64)
        dist.all_reduce(t)
        return int(t[0])

    def local_bytes() -> int:
        n = 0
        for p in model.parameters():
            n += p.to_local().numel() * 4
            for v in optimizer.state[p].values():
                if v.dim() > 0:
                    n += v.to_local().numel() * v.element_size()
        return n

    mine = local_bytes()
    out["state_bytes"] = total(mine)
    workdir.mkdir(parents=True, exist_ok=True)

    # Raw bandwidth: this rank's share, written sequentially, fsynced; then read back cold.
    payload = torch.randint(0, 255, (mine,), dtype=torch.uint8)
    raw = workdir / f"raw-{info.rank}"
    view = memoryview(payload.numpy())
    chunk = 64 << 20
    dist.barrier()
    t0 = time.perf_counter()
    with raw.open("wb") as f:
        for off in range(0, mine, chunk):
            f.write(view[off : off + chunk])
        f.flush()
        os.fsync(f.fileno())
    out["raw_write_s"] = slowest(time.perf_counter() - t0)
    into = bytearray(chunk)

    def raw_read(path: Path = raw) -> float:
        evict(path)
        dist.barrier()
        t0 = time.perf_counter()
        with path.open("rb", buffering=0) as f:
            while f.readinto(into):
                pass
        return slowest(time.perf_counter() - t0)

    # Memcpy floor for the staged bytes: copy_ into a warm buffer.
    dst = torch.empty_like(payload)
    dst.copy_(payload)
    t0 = time.perf_counter()
    dst.copy_(payload)
    out["memcpy_s"] = slowest(time.perf_counter() - t0)
    del payload, dst, view

    identity = RunIdentity(cfg.fingerprint(), cfg.describe(), info.world, layout.describe())
    ckpt = Checkpointer(
        workdir / "ckpt",
        rank=info.rank,
        world=info.world,
        device_type="cpu",
        identity=identity,
        keep=2,
        verify="size",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    data = {"kind": "bench"}
    reps = 2 if size <= 1000 else 1
    saves = [slowest(ckpt.save(10 + i, 0, data)) for i in range(reps)]
    out["sync_save_s"] = min(saves)
    newest = files_step_dir(workdir / "ckpt", 10 + reps - 1)

    def cold_load() -> float:
        evict(newest)
        dist.barrier()
        t0 = time.perf_counter()
        ckpt.load(newest)
        return slowest(time.perf_counter() - t0)

    # Reads are noisy here (a shared virtual disk): the median of 5, raw and load interleaved.
    # Also the checkpoint's own shard file read the same raw way: the load against the bytes
    # it reads, wherever the file system put them.
    shard = newest / shard_name(info.rank)
    reads, shard_reads, loads = [], [], []
    for _ in range(5):
        reads.append(raw_read())
        shard_reads.append(raw_read(shard))
        loads.append(cold_load())
    out["raw_read_s"] = statistics.median(reads)
    out["shard_read_s"] = statistics.median(shard_reads)
    out["load_s"] = statistics.median(loads)
    raw.unlink()

    # Preparing optimizer state for a load: empty moments vs a dummy step.
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    prefill_adamw_state(fresh)
    out["prefill_s"] = slowest(time.perf_counter() - t0)
    del fresh
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t0 = time.perf_counter()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    fresh.step()
    fresh.zero_grad(set_to_none=True)
    out["dummy_step_s"] = slowest(time.perf_counter() - t0)
    del fresh

    if with_async:
        saver = AsyncCheckpointer(
            ckpt, stage_root=workdir / "stage", local_rank=info.local_rank, timeout_s=600
        )

        def async_save(step: int):
            """As the worker does: save after a step, then the next step's forward and
            backward run beside the staging copy, and its optimizer step waits for it. The
            readiness check is timed right after the save, while the write is surely in
            flight (the worker runs it after each step)."""
            report = saver.save(step, 0, data)
            for _ in range(5):  # the per-step readiness check, while this save is in flight
                dist.barrier()  # ranks arrive together, as after a step's all-reduce
                t0 = time.perf_counter()
                polled = saver.poll()
                if polled is not None and polled.state is Readiness.PENDING:
                    polls.append(time.perf_counter() - t0)
                elif polled is not None:
                    ended.append(polled)
            fwd_bwd = forward_backward()
            staged = saver.wait_staged()
            update()
            return report, staged, fwd_bwd

        polls: list[float] = []
        ended: list = []  # how the saves ended (READY or FAILED)
        plain = [forward_backward() for _ in range(3)]
        optimizer.zero_grad(set_to_none=True)
        out["fwd_bwd_s"] = slowest(statistics.median(plain))
        first, first_staged, _ = async_save(100)
        out["async_first_stage_s"] = slowest(first.call_seconds + first_staged.wait_seconds)
        saver.drain()
        report, staged, fwd_bwd = async_save(200)
        out["fwd_bwd_staging_s"] = slowest(fwd_bwd)
        out["async_stage_s"] = slowest(report.call_seconds + staged.wait_seconds)
        out["async_copy_s"] = slowest(staged.copy_seconds)
        out["staged_bytes"] = total(staged.nbytes)
        for part, seconds in {**report.parts, "wait_staged": staged.wait_seconds}.items():
            out[f"async_part_{part}_s"] = slowest(seconds)
        while saver.inflight is not None:
            time.sleep(0.02)  # a training step would run here
            polled = saver.poll()
            if polled.state is not Readiness.PENDING:
                ended.append(polled)
        result = ended[-1]
        out["poll_s"] = slowest(statistics.median(polls) if polls else 0.0)
        out["polls"] = len(polls)
        out["drain_s"] = slowest(result.drain_seconds)
        out["save_to_marker_s"] = slowest(result.save_to_marker_seconds)
        saver.close()

    if info.rank == 0:
        print(RESULT + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def files_step_dir(root: Path, step: int) -> Path:
    from contracts.ckpt_files import step_dir

    return step_dir(root, step)
