"""AsyncEngine: one engine loop on a background thread, fed and read from asyncio.

The loop thread owns the `Engine`: requests and aborts reach it through a command queue and are
applied between passes, so the engine is never touched from two threads. After every pass each
sequence that got tokens pushes a `RequestDelta` to its request's asyncio queue. The engine keeps a
failure to the request at fault; should a step itself raise (a defect in the engine), the requests
in the engine fail (finish reason "error") and the loop goes on.

Shutting down (`drain`): no new request is admitted (`EngineStopping`), the requests in flight get up
to a bounded time to finish, and those still running then end with `SHUTDOWN_ERROR`, so every client
gets a complete response or a clear error.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from deltaspec.engine.engine import Engine
from deltaspec.errors import DeltaspecError
from deltaspec.execution.sequence import Sequence
from deltaspec.model.vision.prompt import PromptImages
from deltaspec.sample.params import SamplingParams

log = logging.getLogger("deltaspec.engine")


@dataclass(frozen=True)
class RequestDelta:
    """What one pass added to one request: new tokens (and their logprobs), and how it ended."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list | None
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_text: str | None = None  # the full output text when a stop string cut it
    error: str | None = None
    prompt_logprobs: list | None = None  # with the first delta, when asked for
    metrics: dict = field(default_factory=dict)  # with the last delta


class RequestStream:
    """Async iterator over one request's deltas; ends after the delta with `finished` set."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestDelta] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestDelta:
        if self.done:
            raise StopAsyncIteration
        delta = await self.queue.get()
        self.done = delta.finished
        return delta


SHUTDOWN_ERROR = "The server is shutting down and ended this request; send it again."


class EngineStopping(DeltaspecError):
    """A request arrived after shutdown began."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[RequestStream, Sequence]] = {}
        self._sent: dict[str, int] = {}
        self._stop = False
        self.accepting = True
        self.drain_cut = False  # `cut_drain` was called: the drain stops waiting for requests in flight
        self._thread = threading.Thread(target=self._run, name="deltaspec-engine", daemon=True)
        self.usage = engine.usage()

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        history_len: int = 0,
        images: PromptImages | None = None,
    ) -> RequestStream:
        """Validate (DeltaspecError on bad input, EngineStopping once shutdown began) and queue a request; call
        from the event loop, with its `images` already encoded (`Engine.images.prompt`, off the loop)."""
        if not self.accepting:
            raise EngineStopping("The server is shutting down and takes no new requests; send it to another one.")
        seq = self.engine.new_sequence(request_id, prompt, prompt_ids, params, history_len, images=images)
        stream = RequestStream(request_id)
        self._commands.put(("add", seq, stream))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request and free its caches (a no-op once it has finished)."""
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    @property
    def in_flight(self) -> int:
        """Requests queued or running (read from any thread)."""
        return len(self._streams) + self._commands.qsize()

    async def drain(self, timeout: float) -> None:
        """Admit no new request; give those in flight up to `timeout` seconds (less once `cut_drain` is called),
        then end the rest with `SHUTDOWN_ERROR`; return once every request has had its last delta."""
        self.accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.in_flight and loop.time() < deadline and not self.drain_cut:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("ending %d request(s) still running after %.1f s of shutdown", self.in_flight, timeout)
            self._commands.put(("fail_all", SHUTDOWN_ERROR, None))
            self._wake.set()
        while self.in_flight:
            await asyncio.sleep(0.01)

    def cut_drain(self) -> None:
        """End the drain's waiting now (a second Ctrl-C): the requests still in flight end at once."""
        self.drain_cut = True

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, item, stream = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._streams[item.request.request_id] = (stream, item)
                self._sent[item.request.request_id] = 0
                self.engine.admit(item)
            elif kind == "fail_all":
                seqs = [seq for _, seq in self._streams.values()]
                self.engine.fail(seqs, item)
                for seq in seqs:
                    self._publish(seq)
            elif item in self._streams:
                seq = self._streams[item][1]
                self.engine.abort(seq)
                self._publish(seq)

    def _publish(self, seq: Sequence) -> None:
        stream, _ = self._streams[seq.request.request_id]
        sent = self._sent[seq.request.request_id]
        wants_logprobs = seq.request.params.logprobs is not None
        delta = RequestDelta(
            request_id=seq.request.request_id,
            new_token_ids=seq.output_ids[sent:],
            new_logprobs=seq.logprobs[sent:] if wants_logprobs else None,
            num_prompt_tokens=len(seq.request.prompt_ids),
            finished=seq.finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            stop_text=seq.stop_text,
            error=seq.error,
            prompt_logprobs=seq.prompt_logprobs
            if sent == 0 and seq.request.params.prompt_logprobs is not None
            else None,
            metrics=seq.metrics() if seq.finished else {},
        )
        self._sent[seq.request.request_id] = len(seq.output_ids)
        if seq.finished:
            del self._streams[seq.request.request_id], self._sent[seq.request.request_id]
        if stream.loop.is_closed():  # the client's event loop is gone: nobody is listening
            self.engine.abort(seq)
            return
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def _run(self) -> None:
        while not self._stop:
            self._apply_commands()
            if not self.engine.has_unfinished():
                self.usage = self.engine.usage()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            running = list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting)
            try:
                updated = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - one bad pass must not stop the server
                log.exception("engine pass failed")
                self.engine.fail(running, f"{type(exc).__name__}: {exc}")
                updated = running
            for seq in updated:
                if seq.request.request_id in self._streams:
                    self._publish(seq)
            self.usage = self.engine.usage()
