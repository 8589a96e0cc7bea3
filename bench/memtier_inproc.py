"""The in-process part of bench/memtier.py, one process in a gloo world of 1: the memcpy floor,
the tier's copy with nothing beside it (and its page sums' share), the hand-over, the seal, and
the load of a slot
(checked, unchecked and the whole `MemoryTier.load`), printed as one RESULT line.
`bench/memtier.py --role inproc` runs it; the model sizes live here, the one place both parts
read them."""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

# name -> worker model flags (bench/step.py's)
MODELS = {
    "debug": ["--model", "debug", "--seq-len", "256", "--batch-size", "2"],
    "250m": ["--model", "debug", "--dim", "1024", "--n-layers", "16", "--n-heads", "16",
             "--n-kv-heads", "4", "--ffn-dim", "2816", "--seq-len", "128", "--batch-size", "1"],
}  # fmt: skip
RESULT = "BENCH-RESULT "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inproc_main(size: str, workdir: Path, ranks: int) -> None:
    import gc

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from worker.args import parse_args
    from worker.build import build_model
    from worker.ckpt.checkpointer import Checkpointer
    from worker.ckpt.live_state import prefill_adamw_state
    from worker.ckpt.memory import Expect, MemoryTier, find, job_dir, read_into
    from worker.ckpt.resume import RunIdentity
    from worker.ckpt.staging import bytes_needed
    from worker.dist import RankInfo
    from worker.hooks import Hooks
    from worker.parallel import build_mesh
    from worker.train import plan

    torch.set_num_threads(1)
    args = parse_args(MODELS[size])
    info = RankInfo(0, 1, 0, 1, "single", socket.gethostname())
    cfg, layout = plan(args, info)
    dist.init_process_group(
        backend="gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    mesh = build_mesh(layout, "cpu")
    model = build_model(cfg, mesh, layout, torch.device("cpu"), True, 0)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    gc.freeze()  # as the worker does once the model is built
    tokens = torch.randint(0, cfg.vocab_size, (args.batch_size, cfg.seq_len + 1))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
    optimizer.step()  # real Adam moments
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}

    def floor(nbytes: int) -> float:
        """A plain copy_ of `nbytes` between two pre-faulted buffers: best of 5 (its CPU time
        too, in out["floor_cpu_s"]: on a shared host, what the wall time loses to others)."""
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
        best, cpu = float("inf"), float("inf")
        for _ in range(5):
            t0, c0 = time.perf_counter(), time.thread_time()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.thread_time() - c0)
        del src, dst
        out.setdefault("floor_cpu_s", cpu)
        return best

    # The floor first, before the slots take their memory (a 250M model's state is 3 GB).
    model_sd, optim_sd = get_state_dict(model, optimizer)
    nbytes = bytes_needed({"model": model_sd, "optim": optim_sd})  # what a slot holds
    del model_sd, optim_sd
    out["floor_s"] = floor(nbytes)
    if ranks > 1:
        out["floor_share_s"] = floor(nbytes // ranks)

    identity = RunIdentity(cfg.fingerprint(), cfg.describe(), 1, layout.describe())
    ckpt = Checkpointer(
        workdir / "ckpt",
        rank=0,
        world=1,
        device_type="cpu",
        identity=identity,
        keep=1,
        verify="size",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
    )
    tag = "bench-memtier"
    directory = job_dir(os.environ, tag)
    expect = Expect(tag, 0, 1, layout.describe(), cfg.fingerprint(), info.host)
    tier = MemoryTier(
        directory,
        expect,
        interval=1,
        local_world=1,
        model=model,
        optimizer=optimizer,
        describe=ckpt.describe,
        hooks=Hooks(),
    )

    # The tier's copies, nothing beside them: the first into each slot maps and faults it.
    data = {"kind": "bench"}
    copies, handovers, first, checks, sums = [], [], [], [], []
    for step in range(1, 6):
        t0 = time.perf_counter()
        tier.save(step, 0, data)
        handover = time.perf_counter() - t0
        report = tier.wait_copied()
        if report is None:
            raise RuntimeError(f"the tier made no copy: {tier.off_reason or 'off'}")
        copied = tier.stagers[(tier.target - 1) % len(tier.stagers)]
        while tier.sealed != step:  # the digests and the seal, on the copy thread
            if tier.off_reason:
                raise RuntimeError(f"the tier's seal failed: {tier.off_reason}")
            time.sleep(0.001)
        if step > 2:
            checks.append(tier.check_seconds)
            sums.append(copied.sum_seconds)
        if step <= 2:
            first.append(report.copy_seconds)
        else:
            copies.append(report.copy_seconds)
            handovers.append(handover)
        if report.nbytes != nbytes:
            raise RuntimeError(f"the slot holds {report.nbytes} bytes, the floor copied {nbytes}")
    out["nbytes"] = nbytes
    out["first_copy_s"] = max(first)
    out["copy_alone_s"] = min(copies)
    out["handover_s"] = statistics.median(handovers)
    out["check_s"] = min(checks)
    out["sum_s"] = min(sums)

    # The load of the newest slot: the read path alone, then the whole MemoryTier.load.
    held, refused = find(directory, expect)
    if not held:
        raise RuntimeError(f"no complete slot to load: {refused}")
    slot = held[0]
    table = slot.record["table"]
    out["read_bytes"] = sum(e["nbytes"] for e in table.values() if "offset" in e)
    prefill_adamw_state(optimizer)
    reads, loads, plain, cpu = [], [], [], {"read": [], "plain": []}
    for _ in range(3):  # interleaved: whatever else runs on the host hits all alike
        model_sd, optim_sd = get_state_dict(model, optimizer)
        flat, _ = flatten_state_dict({"model": model_sd, "optim": optim_sd})
        t0, c0 = time.perf_counter(), time.thread_time()
        read_into(slot.path, flat, table)
        reads.append(time.perf_counter() - t0)
        cpu["read"].append(time.thread_time() - c0)
        t0, c0 = time.perf_counter(), time.thread_time()
        unchecked_read(slot.path, flat, table)
        plain.append(time.perf_counter() - t0)
        cpu["plain"].append(time.thread_time() - c0)
        del model_sd, optim_sd, flat
        t0 = time.perf_counter()
        tier.load(slot, scheduler)
        loads.append(time.perf_counter() - t0)
    out["reads"], out["loads"] = reads, loads
    out["read_s"], out["load_s"] = min(reads), min(loads)
    out["plain_reads"], out["plain_read_s"] = plain, min(plain)
    out["read_cpu_s"], out["plain_read_cpu_s"] = min(cpu["read"]), min(cpu["plain"])
    tier.close(remove=True)
    out["left_in_root"] = len(list(directory.parent.iterdir()))
    print(RESULT + json.dumps(out), flush=True)
    dist.destroy_process_group()


def unchecked_read(path: Path, flat: dict[str, Any], table: dict[str, Any]) -> None:
    """The read path before the slots had checksums (issue 25 item 1), for comparison: each
    tensor's bytes read straight into it with one preadv, nothing checked."""
    import torch

    from worker.ckpt.memory import HEADER_BYTES

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        for key, live in flat.items():
            if not isinstance(live, torch.Tensor) or live.dim() == 0:
                continue
            local = getattr(live, "_local_tensor", live)
            view = memoryview(local.detach().view(-1).view(torch.uint8).numpy())
            offset, done = HEADER_BYTES + int(table[key]["offset"]), 0
            while done < len(view):
                done += os.preadv(fd, [view[done:]], offset + done)
    finally:
        os.close(fd)
