"""Routing one payload over 2 GiB (or 4 GiB) between two ranks on the side gloo group, bit for bit.

A full snapshot routes each rank's pieces of a file to the rank that writes it, one blob per peer, pickled with
its arrays out of band (``exchange_objects``). On a large model one blob can pass 2 GiB (a signed 32-bit length)
or 4 GiB (an unsigned one), sizes at which other transports have failed. This sends a random payload of
``--gib`` GiB from rank 0 to rank 1 both ways it can go: a bare ``dist.send``/``recv`` of a uint8 tensor (the
baseline, in the same run), then ``exchange_objects`` as the publisher calls it. It prints the time and rate of
each, their ratio, and whether the bytes received hash to the bytes sent. Host memory: about 3x the payload at
the peak (the payload and the send buffer on rank 0, the receive buffer on rank 1).

    python benchmarks/routing_exchange.py [--gib 2.01]     # --gib 4.01 passes 4 GiB
"""
from __future__ import annotations

import argparse
import hashlib
import os
import queue
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_args import arg_positive  # noqa: E402  (the repository root is on sys.path)

from fsdp_hotload.engine.comm import GlooComm, exchange_objects  # noqa: E402

from machine_info import machine  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, port: int, nbytes: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    comm = GlooComm.create(timeout_s=1800)
    payload = np.random.default_rng(7).integers(0, 256, size=nbytes if rank == 0 else 0, dtype=np.uint8)
    want = hashlib.sha256(payload).hexdigest() if rank == 0 else ""

    dist.barrier(group=comm.group)
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(torch.from_numpy(payload), dst=1, group=comm.group)
    else:
        got = torch.empty(nbytes, dtype=torch.uint8)
        dist.recv(got, src=0, group=comm.group)
    bare_s = time.perf_counter() - t0
    bare_hash = "" if rank == 0 else hashlib.sha256(got.numpy()).hexdigest()
    if rank == 1:
        del got

    dist.barrier(group=comm.group)
    t0 = time.perf_counter()
    outgoing: list[Any] = [None, {"payload": payload, "sha256": want}] if rank == 0 else [b"small", None]
    incoming, error = exchange_objects(comm, outgoing)
    routed_s = time.perf_counter() - t0
    if rank == 1:
        obj = incoming[0]
        ok = error is None and obj is not None and obj["payload"].nbytes == nbytes
        routed_ok = ok and hashlib.sha256(obj["payload"]).hexdigest() == obj["sha256"]
        results.put({"rank": rank, "bare_s": bare_s, "bare_hash": bare_hash, "routed_s": routed_s,
                     "routed_ok": routed_ok, "sha256": obj["sha256"] if obj is not None else "", "error": error})
    else:
        results.put({"rank": rank, "sender_error": error, "bare_s": bare_s, "routed_s": routed_s})
    comm.close()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=arg_positive(), default=2.01, help="payload size in GiB (4.01 passes 4 GiB)")
    args = p.parse_args()
    nbytes = int(args.gib * 2**30)
    print(f"machine: {machine()}")
    print(f"payload: {nbytes} bytes ({args.gib} GiB), rank 0 -> rank 1, gloo over 127.0.0.1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, nbytes, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    # Each rank puts one result; a rank that dies before it (the OOM killer at 4 GiB, an error) puts none, so wait
    # for the results only while no rank has exited without one.
    got: list[Any] = []
    deadline = time.monotonic() + 3600
    while len(got) < len(procs):
        try:
            got.append(results.get(timeout=1.0))
            continue
        except queue.Empty:
            pass
        done = {g["rank"] for g in got}
        dead = [(r, proc.exitcode) for r, proc in enumerate(procs) if r not in done and proc.exitcode is not None]
        if dead or time.monotonic() > deadline:
            for proc in procs:
                if proc.is_alive():
                    proc.kill()
            why = ", ".join(f"rank {r} exited with {code}" for r, code in dead) or "no result within an hour"
            print(f"routing_exchange: {why}; nothing measured", file=sys.stderr)
            return 1
    for proc in procs:
        proc.join()
    recv = next(g for g in got if "routed_ok" in g)
    send = next(g for g in got if "sender_error" in g)
    bare_ok = recv["bare_hash"] == recv["sha256"]
    gbs = nbytes / 1e9
    print(f"bare send/recv:   {recv['bare_s']:.2f} s ({gbs / recv['bare_s']:.2f} GB/s), bit-exact: {bare_ok}")
    print(f"exchange_objects: {recv['routed_s']:.2f} s ({gbs / recv['routed_s']:.2f} GB/s), "
          f"bit-exact: {recv['routed_ok']}, errors: {recv['error'] or send['sender_error'] or 'none'}")
    print(f"ratio exchange_objects / bare: {recv['routed_s'] / recv['bare_s']:.2f}x "
          "(one copy into the send buffer, arrays out of band; received as views of the receive buffer)")
    return 0 if bare_ok and recv["routed_ok"] and all(proc.exitcode == 0 for proc in procs) else 1


if __name__ == "__main__":
    sys.exit(main())
