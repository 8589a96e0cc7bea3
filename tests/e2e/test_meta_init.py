"""Meta init: a model too big to build whole under a memory cap builds sharded."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import mpiexec, rank_env

pytestmark = pytest.mark.slow

# Each rank caps its address space at what it uses now plus 60% of the whole model: the dense
# path must allocate the whole model before sharding it; meta init allocates half of it per rank.
BUILD = r"""
import os, resource, sys
import torch
from worker.dist import detect_rank, init_process_group
from worker.presets import resolve_config
from worker.layout import plan_layout
from worker.parallel import build_mesh
from worker.build import build_model

info = detect_rank(os.environ)
init_process_group(info, "gloo", "cpu", 60)
layout = plan_layout(info.world, 1, 1)
mesh = build_mesh(layout, "cpu")
cfg = resolve_config("debug", dim=1024, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=4096,
                     vocab_size=32000, seq_len=16)
whole = cfg.num_params() * 4
vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize"))) * 1024
cap = vm + int(0.6 * whole)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
try:
    model = build_model(cfg, mesh, layout, torch.device("cpu"), sys.argv[1] == "on", seed=0)
except (MemoryError, RuntimeError) as exc:
    print(f"rank {info.rank}: OUT OF MEMORY ({type(exc).__name__})", flush=True)
    os._exit(3)
local = sum(p.to_local().numel() * 4 for p in model.parameters())
print(f"rank {info.rank}: BUILT {local / whole:.2f} of {whole >> 20} MiB", flush=True)
torch.distributed.barrier()
os._exit(0)
"""


def build(tmp_path, meta: str) -> subprocess.CompletedProcess:
    script = tmp_path / "build.py"
    script.write_text(BUILD)
    return subprocess.run(
        [mpiexec(), "-n", "2", sys.executable, str(script), meta],
        env=rank_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_meta_init_builds_what_dense_cannot(tmp_path):
    dense = build(tmp_path, "off")
    assert dense.returncode != 0
    assert "OUT OF MEMORY" in dense.stdout, dense.stdout + dense.stderr
    meta = build(tmp_path, "on")
    assert meta.returncode == 0, meta.stdout + meta.stderr
    assert meta.stdout.count("BUILT 0.50 of") == 2, meta.stdout
