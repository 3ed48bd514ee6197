"""The step thread of one loaded model: it carries out the scheduler's steps, nothing else.

Requests arrive on the asyncio side (``run``) and wait in an inbox; the thread
moves them to the scheduler between two steps, runs the step, and hands what
the step produced to each event loop in one wake-up (``_deliver``), so streams
see tokens as they are sampled without a thread handoff per token. Work that
must run between two steps comes in the same way: an adapter to free
(``release``) and llama.cpp calls outside the scheduler's context (``call``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from batchyard.engines.llama.context import Adapter, Context
from batchyard.engines.llama.jobs import Done, Event, Failed, Job, Stopped
from batchyard.engines.llama.scheduler import Scheduler
from batchyard.errors import UpstreamError

__all__ = ["StepThread"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


class StepThread:
    """One thread that runs ``scheduler``'s steps while it has work."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.ctx: Context = scheduler.ctx
        self._cv = threading.Condition()
        self._inbox: list[Job] = []
        self._releases: list[tuple[Adapter, Callable[[], None], threading.Event]] = []
        #: Work to run on the step thread between two steps (``call``).
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._closing = False
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Any, Job, Event]] = []
        self._thread = threading.Thread(target=self._run, name="llama-steps", daemon=True)
        self._thread.start()

    @classmethod
    def open(
        cls,
        llama: Any,
        *,
        slots: int,
        n_ctx: int,
        cache_tokens: int,
        threads: int,
        prefill_tokens: int,
        shelf_bytes: int,
    ) -> StepThread:
        """A context on ``llama``'s model sized for ``slots`` requests, and its thread.

        A step holds the prefill budget and a few tokens a slot (a token of each
        branch, a scoring trie); there are enough sequence ids for every slot's
        branches and tips and the idle prefixes.
        """
        from batchyard.engines.llama.native import NativeContext

        slots, prefill = max(1, slots), max(16, prefill_tokens)
        ctx = NativeContext(
            llama,
            n_cells=max(cache_tokens, n_ctx),
            n_seq=8 * slots + 16,
            capacity=prefill + 16 * slots,
            threads=threads,
        )
        return cls(Scheduler(ctx, slots=slots, prefill_tokens=prefill, shelf_bytes=shelf_bytes))

    # -- the asyncio side ----------------------------------------------------------

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise UpstreamError("the embedded model is closing", code="model_unloaded")
            if job.adapter is not None and job.adapter.released:
                raise UpstreamError(
                    f"model version {job.adapter.name} was unloaded",
                    code="model_unloaded",
                    retryable=True,
                )
            self._inbox.append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cv:
            self._cv.notify()

    def stop(self, job: Job) -> None:
        """End ``job`` at the next step with what it produced so far (its caller hung up).

        Its branches end as if at their token limit (``length``) and the job
        ends as any other (its answer, then ``Done``), so it is billed for what
        it produced. A job that has produced nothing yet (it waits, or its
        prompt is still being read) ends with ``Stopped`` and is dropped as a
        cancelled one.
        """
        job.stopping = True
        with self._cv:
            self._cv.notify()

    def release(self, adapter: Adapter, free: Callable[[], None]) -> threading.Event:
        """End ``adapter``'s jobs and prefixes, then ``free`` it, between two steps.

        Jobs still running on it fail as retryable (the version was unloaded);
        its idle prefixes are evicted. The returned event is set once ``free``
        has run (on the step thread, or here when the thread is closed).
        """
        done = threading.Event()
        with self._cv:
            if self._closing:
                adapter.released = True
                free()
                done.set()
                return done
            self._releases.append((adapter, free, done))
            self._cv.notify()
        return done

    async def call(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the step thread between two steps, and return what it returns.

        For llama.cpp work outside the scheduler's context (the embedding
        context): every decode of the process then runs on one thread, so
        llama.cpp's OpenMP threads stay one team. A second thread that decodes
        makes a second team, and once libgomp manages more threads than there
        are cores it cuts every team's spin to about a hundred turns before
        sleeping, for the rest of the process's life
        (docs/explanation/embedded-speed.md).
        """
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        with self._cv:
            if self._closing:
                raise UpstreamError("the embedded model is closing", code="model_unloaded")
            self._calls.append((fn, done))
            self._cv.notify()
        return await asyncio.wrap_future(done)

    async def run(self, job: Job) -> AsyncIterator[Event]:
        """Submit ``job`` and yield its events until it ends; closing early cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()

        def post(event: Event) -> None:
            # Collected by the step thread and handed over once a step (``_deliver``).
            self._outbox.append((loop, queue, job, event))

        job.post = post
        self.submit(job)
        ended = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, Failed):
                    ended = True
                    raise event.error
                yield event
                if isinstance(event, Done | Stopped):
                    ended = True
                    return
        finally:
            if not ended:
                self.cancel(job)

    async def shelf_state(self) -> tuple[int, int]:
        """The shelf's bytes and prompts, read between two steps (the step thread owns it)."""
        cache = self.scheduler.cache
        return await self.call(lambda: (cache.shelf_held, len(cache.shelf)))

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        gone = UpstreamError("the embedded model was unloaded", retryable=True)
        for job in [*self.scheduler.waiting, *self.scheduler.live, *self._inbox]:
            job.post(Failed(gone))
        self._deliver()
        for _, call_done in self._calls:
            if call_done.set_running_or_notify_cancel():
                call_done.set_exception(gone)
        self._calls.clear()
        for adapter, free, done in self._releases:
            adapter.released = True
            free()
            done.set()
        self._releases.clear()
        self.ctx.close()

    # -- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._cv:
                while not (
                    self._closing or self._inbox or scheduler.busy or self._releases or self._calls
                ):
                    self._cv.wait()
                if self._closing:
                    return
                for job in self._inbox:
                    scheduler.add(job)
                self._inbox.clear()
                calls, self._calls = self._calls, []
                releases, self._releases = self._releases, []
                for adapter, _, _ in releases:
                    # From here on ``submit`` refuses its jobs; those already in are failed.
                    adapter.released = True
            for fn, answer in calls:
                if answer.set_running_or_notify_cancel():
                    try:
                        answer.set_result(fn())
                    except BaseException as exc:  # handed to the caller, whatever it is
                        answer.set_exception(exc)
            try:
                for adapter, free, done in releases:
                    try:
                        scheduler.release(adapter)
                        free()
                    finally:
                        done.set()
                scheduler.step()
            except Exception as exc:  # a native failure: fail what runs, start clean
                log.exception("embedded model step failed")
                scheduler.fail_all(UpstreamError(f"the embedded model failed: {exc}"))
            self._deliver()

    def _deliver(self) -> None:
        """Hand the step's events to their event loops: one wake-up per loop, not per token."""
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        jobs: dict[asyncio.AbstractEventLoop, list[Job]] = {}
        for loop, queue, job, event in out:
            by_loop.setdefault(loop, []).append((queue, event))
            jobs.setdefault(loop, []).append(job)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is gone: nobody is listening
                for job in jobs[loop]:
                    job.cancelled = True
