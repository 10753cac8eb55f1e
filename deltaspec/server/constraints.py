"""Compiling requests' output constraints off the request path: `ConstraintCompiles`.

A JSON schema, regex or grammar can take llguidance seconds or minutes to compile (a schema of thousands of
pattern properties), and its native compile cannot be interrupted. So the server never compiles on the threads
that parse requests, nor on the engine's: compiles run on their own daemon threads (`--structured-outputs-workers`;
they never hold up the process's exit), and

- a constraint larger than `--max-constraint-bytes` is refused before any work (400);
- a request waits for its constraint at most `--structured-outputs-timeout` seconds (400 past it); the compile
  goes on, and its result is cached, so the same constraint is answered at once afterwards;
- at most `MAX_WAITING` compiles per thread wait for one (429 past that, with Retry-After);
- requests with the same constraint share one compile, and a request whose client leaves stops waiting (the
  compile is dropped when no one waits for it any more and it has not started);
- at shutdown, whoever still waits gets a 503.

Results, failures included, are cached by content in the engine's `StructuredCompiler`, where the engine finds
them when the request is admitted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from concurrent.futures import Future

from starlette.requests import Request

from deltaspec.errors import DeltaspecError
from deltaspec.sample.params import StructuredOutputsParams
from deltaspec.sample.structured import StructuredCompiler
from deltaspec.server.errors import APIError

log = logging.getLogger("deltaspec.server")

MAX_WAITING = 8  # compiles waiting per worker thread before a request is told to retry
DISCONNECT_POLL_S = 0.25
SHUTDOWN = "The server is shutting down; send the request again once it is back."


def constraint_bytes(spec: StructuredOutputsParams) -> int:
    """How large the constraint is as the request gave it (UTF-8 bytes of the schema's JSON, the regex, the choices
    or the grammar)."""
    if spec.json is not None:
        text = spec.json if isinstance(spec.json, str) else json.dumps(spec.json, ensure_ascii=False)
    else:
        text = spec.regex or spec.grammar or "".join(spec.choice or ())
    return len(text.encode("utf-8", "surrogatepass"))


class ConstraintCompiles:
    """The compile threads, the jobs waiting or running (one per distinct constraint) and their waiters."""

    def __init__(self, compiler: StructuredCompiler, workers: int, timeout_s: float, max_bytes: int):
        self.compiler, self.timeout_s, self.max_bytes = compiler, timeout_s, max_bytes
        self.max_waiting = MAX_WAITING * workers
        self._queue: queue.Queue[tuple[StructuredOutputsParams, Future] | None] = queue.Queue()
        self._jobs: dict[str, Future] = {}  # constraint -> its compile, waiting or running
        self._waiters: dict[str, int] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"constraint-compile-{i}", daemon=True) for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    async def compile(self, spec: StructuredOutputsParams | None, param: str | None, request: Request | None) -> None:
        """Return once `spec` is compiled (None: nothing to do); an APIError if it is invalid, too large, too slow,
        the server too busy compiling, or the client left."""
        if spec is None:
            return
        if (size := constraint_bytes(spec)) > self.max_bytes:
            raise APIError(
                400,
                f"The output constraint is {size} bytes, more than this server's limit of {self.max_bytes} "
                "(--max-constraint-bytes); send a smaller JSON schema, regex, choice list or grammar.",
                param=param,
            )
        try:
            if self.compiler.cached(spec) is not None:
                return
            key, job = self._submit(spec)
        except DeltaspecError as exc:
            raise APIError(400, str(exc), param=param) from None
        try:
            await self._wait(job, request)
        except DeltaspecError as exc:
            raise APIError(400, str(exc), param=param) from None
        finally:
            self._leave(key, job)

    def _submit(self, spec: StructuredOutputsParams) -> tuple[str, Future]:
        """The job compiling `spec`: the one already waiting or running, or a new one (429 when too many wait)."""
        key = repr(spec)
        with self._lock:
            if self._closed:
                raise APIError(503, SHUTDOWN)
            job = self._jobs.get(key)
            if job is None:
                if sum(not job.running() for job in self._jobs.values()) >= self.max_waiting:
                    raise APIError(
                        429,
                        "The server is compiling too many output constraints at once; send the request again in a "
                        "few seconds.",
                        headers={"Retry-After": "5"},
                    )
                job = self._jobs[key] = Future()
                self._queue.put((spec, job))
            self._waiters[key] = self._waiters.get(key, 0) + 1
        return key, job

    async def _wait(self, job: Future, request: Request | None) -> None:
        """The job's outcome, waiting at most the timeout, and only while the client is connected."""
        outcome = asyncio.wrap_future(job)
        watcher = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            finished, _ = await asyncio.wait(
                [outcome, *([watcher] if watcher else [])], timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if watcher is not None:
                watcher.cancel()
        if outcome in finished:
            outcome.result()  # the compile's DeltaspecError, or an APIError at shutdown
            return
        outcome.add_done_callback(_retrieved)  # no longer awaited (cancelling it would cancel the shared job)
        if finished:
            raise APIError(400, "The client closed the connection while its output constraint compiled.")
        raise APIError(
            400,
            f"Compiling the output constraint took longer than {self.timeout_s:g} s (--structured-outputs-timeout); "
            "send a simpler JSON schema, regex or grammar, or the same one again later (it goes on compiling).",
        )

    def _leave(self, key: str, job: Future) -> None:
        """One waiter of `key` is done; the job is dropped if it has not started and no one waits for it."""
        with self._lock:
            self._waiters[key] -= 1
            if self._waiters[key] == 0:
                del self._waiters[key]
                if job.cancel():  # not started: the worker skips it
                    self._jobs.pop(key, None)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            spec, job = item
            if job.done() or not job.set_running_or_notify_cancel():  # dropped, or answered at shutdown
                continue
            outcome: DeltaspecError | None = None
            try:
                self.compiler.compile(spec)
            except DeltaspecError as exc:
                outcome = exc
            except Exception as exc:  # noqa: BLE001 - a compile that breaks fails its requests, not the thread
                log.exception("compiling an output constraint failed")
                outcome = DeltaspecError(f"The output constraint could not be compiled ({type(exc).__name__}).")
            with self._lock:
                self._jobs.pop(repr(spec), None)
                if job.done():  # shutdown answered it
                    continue
                if outcome is None:
                    job.set_result(None)
                else:
                    job.set_exception(outcome)

    def close(self) -> None:
        """Stop the threads (a running compile is left to finish, or to end with the process) and give whoever
        still waits a 503."""
        with self._lock:
            self._closed = True
            for job in self._jobs.values():
                if not job.done():
                    job.set_exception(APIError(503, SHUTDOWN))
            self._jobs = {}
        for _ in self._threads:
            self._queue.put(None)


def _retrieved(outcome: asyncio.Future) -> None:
    """Collect the outcome of a compile no one awaits any more, so that asyncio does not report it as lost."""
    if not outcome.cancelled():
        outcome.exception()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
