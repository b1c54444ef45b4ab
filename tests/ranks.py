"""A world of 2 ranks for tests: spawned processes, results by rank, a timeout instead of a hang."""

from __future__ import annotations

import faulthandler
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, body: Callable[[int], Any], out_dir: str, backend: str, timeout_s: float) -> None:
    # A rank still running shortly before the parent kills it prints every thread's stack: where it waits.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 5), exit=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=WORLD)
    try:
        result = body(rank)
        torch.save({"ok": result}, os.path.join(out_dir, f"{rank}.pt"))
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_world(body: Callable[[int], Any], backend: str = "gloo", timeout_s: float = TIMEOUT_S) -> list[Any]:
    """Run ``body(rank)`` (a picklable function) on 2 ranks of ``backend``; its results by rank.

    Fails, never hangs, when a rank is still running after ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out_dir:
        port = _free_port()
        procs = [ctx.Process(target=_worker, args=(r, port, body, out_dir, backend, timeout_s)) for r in range(WORLD)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert not hung, f"ranks {hung} still running after {timeout_s} s: a rank waits in a collective"
        results = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} raised:\n{res['error']}"
    return [res["ok"] for res in results]
