"""The executors of several ranks (`deltaspec.engine.executor`), tensor-parallel within a pipeline stage and pipeline
stages of consecutive layers (world rank = stage * T + tensor-parallel rank): rank 0's (`Leader`, in the caller's
process), which starts one follower process per other rank and drives it, and a follower's (`Follower`). Ranks an
outside launcher started (torchrun across nodes, Slurm, a Ray placement group: `join_launched`) join the same group
over `env://`; rank 0 leads as above, and every other rank follows instead of running the command it was started with.

Every rank runs the same engine over its shard of the model (its stage's layers, its heads of them): the same
scheduling, cache bookkeeping, drafting, sampling and rollback, in lock step, so prefix checkpoints, replay logs and
rollback need no messages of their own: each rank does them to its own layers and heads. Only rank 0 talks to the
outside (LLM, CLI, server); before each step it broadcasts what changed since the last one (requests admitted with
their resolved sampling seeds, aborts, failures) on a gloo group, and every rank applies it before stepping
(`follow`). The forward passes meet in the model's collectives (`deltaspec.parallel.group`) and, between stages, in
the activations the pipeline sends (`deltaspec.parallel.pipeline`). Sampling runs on every rank from the same full
logits and the same seeded generators, so every rank picks the same tokens; the step messages carry a digest of rank
0's running sequences (ids, output lengths, last tokens), which a follower checks against its own. A follower builds
its engine with the `replica` rank 0 hands it (the engine's class), so this module needs no engine of its own.

A follower that dies takes the engine down: rank 0 watches its followers and, when one exits, reports it and
exits (collectives waiting on a dead peer cannot be interrupted), and a follower whose parent is gone exits.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from deltaspec.errors import DeltaspecError
from deltaspec.parallel.group import TensorParallel, backend_for
from deltaspec.parallel.pipeline import Pipeline

log = logging.getLogger("deltaspec.parallel")
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # a step's collectives
IDLE_TIMEOUT = timedelta(days=365)  # a follower waits for the next step message as long as the server idles
POLL_S = 0.5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast(message, control):
    """Rank 0's `message` on every rank of the gloo group `control` (rank 0 passes it, followers pass None)."""
    box = [message]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


@dataclass
class Leader:
    """Rank 0's executor: the follower processes, then (once joined) `tp` for the model's collectives, its pipeline
    stage, the gloo group that carries the step messages, and the changes the next step message carries."""

    followers: list
    tp: TensorParallel | None = None
    pipeline: Pipeline | None = None
    control: object = None
    changes: list = field(default_factory=list)
    closing: bool = False

    def share(self, value):
        return _broadcast(value, self.control)

    def record(self, *change) -> None:
        self.changes.append(change)

    def step(self, running) -> None:
        """The changes since the last step and the `digest` of the `running` sequences, to every follower."""
        changes, self.changes = self.changes, []
        self.share([*changes, ("step", digest(running))])

    def stage_timings(self) -> list[tuple[int, float, float]]:
        """Every rank's (pipeline stage, seconds waited on other stages, seconds of pipelined passes) so far, in rank
        order."""
        self.share([("timings",)])
        return _gather_timings(self.pipeline, self.control)

    @contextmanager
    def building(self) -> Iterator[None]:
        """If building rank 0's engine fails, stop the followers (they wait for messages a failed build never sends)
        and leave the group."""
        try:
            yield
        except BaseException:
            self.closing = True
            for proc in self.followers:
                proc.kill()
            dist.destroy_process_group()
            raise

    def close(self) -> None:
        """Tell the followers to stop, wait for them, and leave the group."""
        if self.closing:
            return
        self.closing = True
        self.share([("stop",)])
        for proc in self.followers:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        dist.destroy_process_group()


@dataclass
class Follower:
    """A follower's executor: `tp` for the model's collectives, its pipeline stage and the gloo group the step messages
    come on. It records nothing and sends nothing of its own: `follow` applies rank 0's changes and steps."""

    tp: TensorParallel
    pipeline: Pipeline
    control: object
    closing: bool = False

    def share(self, value):
        return _broadcast(value, self.control)

    def record(self, *change) -> None:
        pass

    def step(self, running) -> None:
        pass

    @contextmanager
    def building(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.closing = True
            dist.destroy_process_group()
            raise

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            dist.destroy_process_group()


def follow(engine) -> None:
    """A follower: apply rank 0's changes to `engine` and step with it until it stops."""
    executor = engine.executor
    while True:
        for kind, *args in executor.share(None):
            if kind == "stop":
                return
            if kind == "admit":
                request_id, prompt, prompt_ids, params, history_len, seed, images = args
                engine.admit(engine.new_sequence(request_id, prompt, prompt_ids, params, history_len, seed, images))
            elif kind == "abort":
                engine.abort(_unfinished(engine, args[0]))
            elif kind == "fail":
                engine.fail([_unfinished(engine, request_id) for request_id in args[0]], args[1])
            elif kind == "step":
                if digest(engine.scheduler.running) != args[0]:
                    raise RuntimeError(f"rank {dist.get_rank()} diverged from rank 0: its running sequences differ")
                engine.step()
            elif kind == "timings":
                _gather_timings(executor.pipeline, executor.control)


def _gather_timings(pipeline: Pipeline, control) -> list[tuple[int, float, float]] | None:
    """Every rank's (stage, waited, passes) seconds on rank 0 (None on the others)."""
    own = (pipeline.index, pipeline.waited_s, pipeline.pass_s)
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, every, dst=0, group=control)
    return every


def digest(running) -> int:
    """What must agree on every rank before a step: each running sequence's id, output length and last token (crc32:
    Python's string hashes differ between processes)."""
    return zlib.crc32(
        repr([(seq.request.request_id, len(seq.output_ids), seq.output_ids[-1:]) for seq in running]).encode()
    )


def _unfinished(engine, request_id: str):
    scheduler = engine.scheduler
    return next(seq for seq in (*scheduler.running, *scheduler.waiting) if seq.request.request_id == request_id)


def _join(
    rank: int, config, init_method: str, local_rank: int | None = None
) -> tuple[TensorParallel, Pipeline, object]:
    """Rank `rank` of the group `config` describes (on GPU `local_rank` of its host, `rank` by default): joined, with
    its tensor-parallel group, its pipeline stage and the gloo control group."""
    parallel, device = config.parallel, torch.device(config.host.device)
    tp_size, stages = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    if device.type == "cuda":
        torch.cuda.set_device(rank if local_rank is None else local_rank)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=parallel.world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    stage, tp_rank = divmod(rank, tp_size)
    tp_group = pipeline = None
    if stages > 1:  # every rank builds every group, in the same order
        for each in range(stages):
            group = dist.new_group(list(range(each * tp_size, (each + 1) * tp_size))) if tp_size > 1 else None
            tp_group = group if each == stage else tp_group
        for each in range(tp_size):
            group = dist.new_group([s * tp_size + each for s in range(stages)])
            results = group if each == tp_rank else None
            pipeline = pipeline if results is None else _stage(config, stage, tp_rank, results)
    if device.type == "cuda":  # NCCL sets its communicator up at the first collective, which must not be in a capture
        dist.all_reduce(torch.zeros(1, device="cuda"))
    tp = TensorParallel(tp_rank, tp_size, parallel.enable_expert_parallel, tp_group)
    return tp, pipeline or Pipeline(), control


def _stage(config, stage: int, tp_rank: int, results) -> Pipeline:
    """Stage `stage`'s place for tensor-parallel rank `tp_rank`: its neighbours and its results group."""
    tp_size, stages = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
    return Pipeline(
        stage,
        stages,
        (stage - 1) * tp_size + tp_rank if stage > 0 else None,
        (stage + 1) * tp_size + tp_rank if stage < stages - 1 else None,
        (stages - 1) * tp_size + tp_rank,
        results,
    )


def launched_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when an outside launcher started this process as one of several ranks:
    torchrun's `RANK` / `WORLD_SIZE` / `LOCAL_RANK` (also what a Ray placement group's actors are given), else
    Slurm's `SLURM_PROCID` / `SLURM_NTASKS` / `SLURM_LOCALID`; None for a process started alone. The rendezvous
    address is `MASTER_ADDR` / `MASTER_PORT` (torch's env:// method)."""
    for rank, size, local in (("RANK", "WORLD_SIZE", "LOCAL_RANK"), ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
        if int(os.environ.get(size, "1")) > 1 and rank in os.environ:
            return int(os.environ[rank]), int(os.environ[size]), int(os.environ.get(local, "0"))
    return None


def join_launched(config, replica: Callable) -> Leader:
    """This process's rank of a group an outside launcher started (`launched_rank`). Rank 0 joins and returns its
    `Leader` (the other ranks are not its children: nothing to start or watch; the launcher ends the group when one
    fails). Any other rank joins, builds its engine with `replica`, follows rank 0 until it stops, and exits the
    process: whatever command started it (`serve`, `generate`, ...) runs on rank 0 only."""
    rank, size, local = launched_rank()
    parallel = config.parallel
    if parallel.world_size != size and parallel.pipeline_parallel_size == 1:
        raise DeltaspecError(
            f"This process is rank {rank} of {size} started by a launcher (torchrun or Slurm), but "
            f"--tensor-parallel-size is {parallel.tensor_parallel_size}; give --tensor-parallel-size {size}."
        )
    if parallel.world_size != size:
        raise DeltaspecError(
            f"This process is rank {rank} of {size} started by a launcher (torchrun or Slurm), but "
            f"--pipeline-parallel-size {parallel.pipeline_parallel_size} x --tensor-parallel-size "
            f"{parallel.tensor_parallel_size} makes {parallel.world_size} ranks; start {parallel.world_size} ranks, "
            f"or give sizes whose product is {size}."
        )
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        raise DeltaspecError(
            f"Rank {rank} of {size} needs the rendezvous address: set MASTER_ADDR and MASTER_PORT (torchrun sets them)."
        )
    if rank == 0:
        leader = Leader([])
        leader.tp, leader.pipeline, leader.control = _join(0, config, "env://", local)
        atexit.register(leader.close)
        return leader
    follower = Follower(*_join(rank, config, "env://", local))
    follow(replica(config, progress=False, executor=follower))
    follower.close()
    sys.exit(0)


def launch(config, replica: Callable) -> Leader:
    """Rank 0: start the followers of `config.parallel.world_size` ranks (pipeline stages x tensor-parallel ranks),
    each building its engine as `replica(config, progress=False, executor=...)`, and join the group with them."""
    size = config.parallel.world_size
    if dist.is_initialized():
        gc.collect()  # an engine dropped without close() ends its group when collected (Engine's finalizer)
    if dist.is_initialized():
        raise DeltaspecError(
            "Another parallel engine is still open in this process; close it (LLM.close()) before starting a new one."
        )
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    followers = [_start_follower(replica, config, rank, init_method) for rank in range(1, size)]
    leader = Leader(followers)
    threading.Thread(target=_watch, args=(leader, config), name="deltaspec-tp-watch", daemon=True).start()
    leader.tp, leader.pipeline, leader.control = _join(0, config, init_method)
    atexit.register(leader.close)
    return leader


def _start_follower(replica: Callable, config, rank: int, init_method: str) -> subprocess.Popen:
    """A follower process started from its own module (`python -m deltaspec.engine.follower`, with this process's
    import path), never from the caller's `__main__`, so a script read from standard input or a notebook can start
    it; its arguments travel pickled on its standard input."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
    proc = subprocess.Popen([sys.executable, "-m", "deltaspec.engine.follower"], stdin=subprocess.PIPE, env=env)
    pickle.dump((replica, config, rank, init_method, os.getpid()), proc.stdin)
    proc.stdin.close()
    return proc


def worker_name(config, rank: int) -> str:
    """How the messages name world rank `rank`: its tensor-parallel rank, or its pipeline stage."""
    if config.parallel.pipeline_parallel_size == 1:
        return f"tensor-parallel worker rank {rank}"
    return f"pipeline stage {rank // config.parallel.tensor_parallel_size} (rank {rank})"


def _watch(leader: Leader, config) -> None:
    """Rank 0: exit the process, saying why, as soon as a follower is gone while the engine runs."""
    while not leader.closing:
        for rank, proc in enumerate(leader.followers, start=1):
            if proc.poll() is not None and not leader.closing:
                print(
                    f"deltaspec: {worker_name(config, rank)} exited (code {proc.returncode}); the engine cannot "
                    "go on without it and stops.",
                    file=sys.stderr,
                    flush=True,
                )
                for other in leader.followers:
                    if other.poll() is None:
                        other.kill()
                os._exit(1)
        time.sleep(POLL_S)


def _watch_parent(parent: int) -> None:
    """A follower: exit when rank 0's process is gone."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    os._exit(1)


def run_follower(replica: Callable, config, rank: int, init_method: str, parent: int) -> None:
    """A follower process: join the group, build the engine's shard with `replica`, follow rank 0's steps until it
    stops."""
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    try:
        follower = Follower(*_join(rank, config, init_method))
        follow(replica(config, progress=False, executor=follower))
        follower.close()
    except BaseException as exc:  # noqa: BLE001 - the follower reports and exits; rank 0's watch stops the engine
        print(f"deltaspec: {worker_name(config, rank)} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        os._exit(1)
