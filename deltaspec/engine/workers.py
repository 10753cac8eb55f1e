"""The processes of a tensor-parallel engine: rank 0 (the caller's process) and one worker per other rank.

Every rank runs the same `Engine` over its shard of the model: the same scheduling, cache bookkeeping,
drafting, sampling and rollback, in lock step, so prefix checkpoints and replay logs need no messages of
their own. Only rank 0 talks to the outside (LLM, CLI, server); before each step it broadcasts what
changed since the last one (requests admitted with their resolved sampling seeds, aborts, failures) on a
gloo group, and every rank applies it before stepping (`follow`). The forward passes meet in the model's collectives
(`deltaspec.parallel.group`). Sampling runs on every rank from the same full logits and the same seeded
generators, so every rank picks the same tokens; the step messages carry a digest of rank 0's running sequences
(ids, output lengths, last tokens), which a worker checks against its own.

A worker that dies takes the engine down: rank 0 watches its workers and, when one exits, reports it and
exits (collectives waiting on a dead peer cannot be interrupted), and a worker whose parent is gone exits.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaspec.parallel.group import SINGLE, TensorParallel, backend_for

log = logging.getLogger("deltaspec.parallel")
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a step's collectives
IDLE_TIMEOUT = timedelta(days=365)  # a worker waits for the next step message as long as the server idles
POLL_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Group:
    """This process's tensor-parallel group: `tp` for the model's collectives, the gloo group that carries the
    step messages, on rank 0 the worker processes and the changes the next step message carries."""

    tp: TensorParallel | None
    control: object
    workers: list
    changes: list = field(default_factory=list)
    closing: bool = False

    def send(self, message):
        """Rank 0's `message` on every rank (rank 0 passes it, workers pass None)."""
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def record(self, *change) -> None:
        """Rank 0: a change made from outside the engine (admit, abort, fail) for the workers to apply."""
        self.changes.append(change)

    def publish(self, running) -> None:
        """Rank 0, before a step: the changes since the last step and the `digest` of the `running` sequences."""
        if self.tp.rank == 0:
            changes, self.changes = self.changes, []
            self.send([*changes, ("step", digest(running))])

    @contextmanager
    def unless_built(self):
        """Around building rank 0's engine: if that fails, stop the workers (they wait for messages a failed build
        never sends) and leave the group."""
        try:
            yield
        except BaseException:
            self.closing = True
            for proc in self.workers:
                proc.kill()
            dist.destroy_process_group()
            raise

    def close(self) -> None:
        """Rank 0: tell the workers to stop and wait for them; every rank: leave the group."""
        if self.closing:
            return
        self.closing = True
        if self.tp is not None and self.tp.rank == 0:
            self.send([("stop",)])
            for proc in self.workers:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.terminate()
        dist.destroy_process_group()


class Solo:
    """The group of an engine on one device: nothing to send, record or close."""

    tp = SINGLE

    def send(self, message):
        return message

    def record(self, *change) -> None:
        pass

    def publish(self, running) -> None:
        pass

    @contextmanager
    def unless_built(self):
        yield

    def close(self) -> None:
        pass


SOLO = Solo()


def follow(engine) -> None:
    """A worker: apply rank 0's changes and step with it until it stops."""
    group = engine.group
    while True:
        for kind, *args in group.send(None):
            if kind == "stop":
                return
            if kind == "admit":
                request_id, prompt, prompt_ids, params, history_len, seed = args
                engine.admit(engine.new_sequence(request_id, prompt, prompt_ids, params, history_len, seed))
            elif kind == "abort":
                engine.abort(_unfinished(engine, args[0]))
            elif kind == "fail":
                engine.fail([_unfinished(engine, request_id) for request_id in args[0]], args[1])
            elif kind == "step":
                if digest(engine.scheduler.running) != args[0]:
                    raise RuntimeError(f"rank {group.tp.rank} diverged from rank 0: its running sequences differ")
                engine.step()


def digest(running) -> int:
    """What must agree on every rank before a step: each running sequence's id, output length and last token (crc32:
    Python's string hashes differ between processes)."""
    return zlib.crc32(repr([(seq.request_id, len(seq.output_ids), seq.output_ids[-1:]) for seq in running]).encode())


def _unfinished(engine, request_id: str):
    scheduler = engine.scheduler
    return next(seq for seq in (*scheduler.running, *scheduler.waiting) if seq.request_id == request_id)


def _join(rank: int, config, init_method: str) -> tuple[TensorParallel, object]:
    """Rank `rank` of the group `config` describes: joined, with its gloo control group."""
    size, device = config.tensor_parallel_size, torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    if device.type == "cuda":  # NCCL sets its communicator up at the first collective, which must not be in a capture
        dist.all_reduce(torch.zeros(1, device="cuda"))
    return TensorParallel(rank, size, config.enable_expert_parallel), control


def launch(config) -> Group:
    """Rank 0: start the workers of `config.tensor_parallel_size` ranks and join the group with them."""
    size = config.tensor_parallel_size
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(
            target=run_worker,
            args=(config, rank, size, init_method, os.getpid()),
            name=f"deltaspec-tp{rank}",
            daemon=True,
        )
        for rank in range(1, size)
    ]
    for proc in workers:
        proc.start()
    group = Group(None, None, workers)
    threading.Thread(target=_watch, args=(group,), name="deltaspec-tp-watch", daemon=True).start()
    group.tp, group.control = _join(0, config, init_method)
    atexit.register(group.close)
    return group


def _watch(group: Group) -> None:
    """Rank 0: exit the process, saying why, as soon as a worker is gone while the engine runs."""
    while not group.closing:
        for rank, proc in enumerate(group.workers, start=1):
            if proc.exitcode is not None and not group.closing:
                print(
                    f"deltaspec: tensor-parallel worker rank {rank} exited (code {proc.exitcode}); the engine cannot "
                    "go on without it and stops.",
                    file=sys.stderr,
                    flush=True,
                )
                for other in group.workers:
                    if other.is_alive():
                        other.kill()
                os._exit(1)
        time.sleep(POLL_S)


def _watch_parent(parent: int) -> None:
    """A worker: exit when rank 0's process is gone."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


def run_worker(config, rank: int, size: int, init_method: str, parent: int) -> None:
    """A worker process: join the group, build the engine's shard, follow rank 0's steps until it stops."""
    from deltaspec.engine.engine import Engine

    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        tp, control = _join(rank, config, init_method)
        group = Group(tp, control, [])
        follow(Engine(config, progress=False, group=group))
        group.close()
    except BaseException as exc:  # noqa: BLE001 - the worker reports and exits; rank 0's watch stops the engine
        print(f"deltaspec: tensor-parallel worker rank {rank} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
