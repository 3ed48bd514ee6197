"""The embedded engine's continuous-batching scheduler: one llama context, many sequences.

One ``Scheduler`` per loaded model owns one llama context whose KV cache is
unified (``kv_unified``: every sequence draws cells from one pool, so a
sequence copy of a shared prefix costs no memory) and a single background
thread that runs the step loop:

1. take in new jobs (a job is one request: a prompt and its branches, the
   ``n`` samples of a generation or the candidates of a scoring call) and
   drop cancelled ones, freeing their cache cells;
2. admit waiting jobs while a slot, sequence ids and cache cells are free
   (idle prefixes are evicted least recently used first); a job whose prompt
   starts like a cached or live prompt copies that prefix
   (``llama_memory_seq_cp``) or takes the idle sequence over, and only the
   rest is read; one whose opening another live job is still reading waits
   a step or two for it and copies it (``_follow``), so requests that start
   together read a shared opening once;
3. build one batch: one token of every generating branch, then chunks of
   prompts being read up to the step's prefill budget (chunked prefill); a
   scoring job whose prompt is read puts the whole trie of its candidates in;
4. ``llama_decode`` once, then sample each branch with its own sampler chain
   from its own logits row; what the step produced is handed to the asyncio
   side in one wake-up per event loop, so streams see tokens as they are
   sampled without a thread handoff per token.

A generating job whose prompt is read forks its branches off it (each a
sequence copy of the prompt), so ``n`` samples share one read. A scoring
job (decide: every outcome of every decision of one text) reads its prompt
once and then decodes all its candidates as one token trie in one
``llama_decode`` (``Scoring``). When a job ends,
its prompt stays in the cache as an idle prefix for the next (at most one
idle prefix a slot; a decision set's later texts keep only the opening they
share with the set's first). Idle cells are not free: every step attends
over every cell up to the highest one in use. So when a job is admitted,
what no one about to run shares of the idle prompts moves to the shelf, a
host-memory store (``_shelve``), and comes back by copy, not by reading it
again, when a request starts like it (``_restore``). When a burst ends, the
idle prefixes are packed into the lowest cells (``_compact``), so the next
lone request does not attend over the span the burst left behind.

LoRA versions share the base model's scheduler. llama.cpp applies adapters
to a whole context, not per sequence, so each step serves the jobs of one
adapter (``Job.adapter``: an ``Adapter`` loaded once on the base model, or
None for the base itself), set on the context just before the step's decode.
The groups take turns, ``ADAPTER_TURN`` steps each, so every live job gets
tokens at the same pace whatever its adapter, and a context switches adapters
(which makes llama.cpp re-plan its compute graph) at most once per turn. An
idle prefix belongs to the adapter it was read under: its cache holds that
adapter's keys and values. ``release`` ends an adapter's jobs and prefixes and
frees it between steps, on the step thread, so no decode ever sees it freed.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import ctypes
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from batchyard.engines.llama_sampling import (
    SamplingParams,
    StopMatcher,
    build_sampler,
    log_softmax,
    token_piece,
    top_logprobs,
)
from batchyard.errors import UpstreamError

__all__ = ["ADAPTER_TURN", "SHELF_BYTES", "Adapter", "Branch", "Job", "Scheduler"]

log = logging.getLogger(__name__)

Event = tuple[Any, ...]
_T = TypeVar("_T")

#: Steps one adapter's group runs before the next group's turn. Switching costs
#: llama.cpp a re-plan of its graph (about a fifth of a one-token step on the
#: embedded model); a few steps a turn keep that small while streams of every
#: group still get a token every few steps.
ADAPTER_TURN = 4

#: llama.cpp pads the span of cells a step attends over to a multiple of 256
#: (``llama_kv_cache::get_n_kv``): packing the idle prefixes pays once the cache
#: has spread at least that far past them.
SPAN_PAD = 256

#: The most idle-prefix state packing copies (out and back in, a few milliseconds
#: at memory speed): past it the idle prompts are long, and a request that arrives
#: meanwhile would wait for the copy; they stay where they are.
PACK_BYTES = 64 << 20

#: The fewest prompt tokens worth waiting a step or two for while another live job
#: reads them (``_follow``); fewer are read again at once.
FOLLOW_MIN = 16

#: Host memory the shelf may hold by default (``Scheduler.shelf_bytes``): prompts
#: moved out of the cache, kept for a later request that starts like them. The
#: embedded model's cells are about 23 KB a token, so this keeps some 11,000 tokens.
SHELF_BYTES = 256 << 20

#: The fewest tokens a prompt must hold to go on the shelf.
SHELF_MIN = 8

#: A shelved prompt is put back whole, so the opening it shares with what the cache
#: holds is then held twice, and every step of every sequence attends over the copy.
#: It is put back when the tokens it saves reading are at least one in ``SHELF_DUP``
#: of the cells it duplicates (and at least one): reading a token costs ~3 ms on two
#: cores, putting back a 200-token prompt ~0.1 ms. A lone chat under a 28-token
#: system prompt takes back 2 tokens or more; a decide text under its set's 140
#: questions 9 or more, as its copy spans many steps of many texts.
SHELF_DUP = 16


@dataclass(eq=False)
class Adapter:
    """A LoRA adapter loaded once on the scheduler's model (``llama_adapter_lora_init``)."""

    name: str
    handle: Any
    scale: float = 1.0
    #: Its tensors' bytes, for the engine's memory budget.
    bytes: int = 0
    released: bool = False


@dataclass(eq=False)
class Branch:
    """One sequence forked off a job's prompt: a sample being generated, or a scoring tip.

    A scoring job's branches only hold the sequences its candidate trie is
    decoded in (see ``Scoring``); they sample nothing.
    """

    # A generation: how it samples and when it ends.
    params: SamplingParams | None = None
    max_tokens: int = 0
    stops: list[str] | None = None
    logprobs: bool = False
    top: int = 0
    # Run state, owned by the scheduler's thread.
    seq: int = -1
    pos: int = 0
    pending: list[int] = field(default_factory=list)
    sampler: Any = None
    out_tokens: int = 0
    done: bool = False
    finish: str = "stop"
    matcher: StopMatcher | None = None
    decoder: Any = None
    rows: list[int] = field(default_factory=list)
    #: A whole job's text and logprob entries so far, held here until the branch ends
    #: (``Job.whole``), instead of one ``piece`` event a token.
    held: list[str] = field(default_factory=list)
    held_entries: list[dict[str, Any]] = field(default_factory=list)


@dataclass(eq=False)
class Scoring:
    """Candidate continuations of one prompt, scored as a token trie in one step.

    Candidates that open alike (a decision's ``sentiment: `` before each
    outcome) share the trie's nodes. Only a node some candidate goes past is
    decoded (its logits row gives the next token of every candidate through
    it); a candidate's first token is read from the prompt's own row and its
    last from its parent's, so single-token candidates cost no decode at all.
    Each *tip* (a decoded node with no decoded child) is one sequence, and a
    node belongs to the sequences of every tip below it (one cache cell, many
    sequence ids), so every node goes into one ``llama_decode``, the step
    after the prompt's last chunk.
    """

    conts: list[list[int]]
    #: Decoded nodes, parents first: (token, depth after the prompt, indexes of its tips).
    nodes: list[tuple[int, int, list[int]]] = field(default_factory=list)
    #: Per candidate, per token: the node whose row gives that token (-1: the prompt's row).
    reads: list[list[int]] = field(default_factory=list)
    tips: int = 0
    # Run state, owned by the scheduler's thread.
    rows: list[int] = field(default_factory=list)
    due: bool = False

    def __post_init__(self) -> None:
        index: dict[tuple[int, ...], int] = {}
        for cont in self.conts:
            for j in range(1, len(cont)):
                index.setdefault(tuple(cont[:j]), -1)
        inner = sorted(index, key=len)
        index = {p: i for i, p in enumerate(inner)}
        tips = [p for p in inner if not any(q[:-1] == p for q in inner if len(q) == len(p) + 1)]
        self.tips = len(tips)
        self.nodes = [
            (p[-1], len(p) - 1, [t for t, tip in enumerate(tips) if tip[: len(p)] == p])
            for p in inner
        ]
        self.reads = [
            [-1, *(index[tuple(cont[:j])] for j in range(1, len(cont)))] for cont in self.conts
        ]


@dataclass(eq=False)
class Job:
    """One request's prompt and branches, and where its events go."""

    prompt: list[int]
    branches: list[Branch]
    post: Callable[[Event], None] = lambda _e: None
    adapter: Adapter | None = None
    #: Candidates to score off the prompt (then ``branches`` are its trie's tips).
    scoring: Scoring | None = None
    #: The caller wants each branch's answer whole, not token by token (a completion
    #: that is not streamed): its text is posted once, when the branch ends, so the
    #: event loop is not woken for every token. On two cores a wake-up a token took a
    #: core from llama.cpp's threads for every token of a lone request.
    whole: bool = False
    cancelled: bool = False
    #: Asked to end at the next step with what it has (``Scheduler.stop``).
    stopping: bool = False
    # Run state, owned by the scheduler's thread.
    seq: int = -1
    pos: int = 0
    cached: int = 0
    #: Its cached opening was copied from another scoring prompt's (``_finish`` keeps less).
    after_scoring: bool = False
    #: A live job still reading a longer opening of this prompt than the cache held
    #: when this one was admitted: this one waits for it and copies it (``_follow``).
    lead: Job | None = None
    #: How much of the prompt it copies from ``lead`` once ``lead`` has read that far.
    lead_at: int = 0
    forked: bool = False
    finished: bool = False
    row: int = -1
    logits: Any = None

    @property
    def reserve(self) -> int:
        """Cache cells this job may fill: its prompt and every branch at its longest."""
        if self.scoring is not None:
            return len(self.prompt) + len(self.scoring.nodes)
        return len(self.prompt) + sum(b.max_tokens for b in self.branches)

    def seqs(self) -> list[int]:
        """The sequences the prompt's tokens go into: a scoring job's tips share its cells."""
        if self.scoring is None:
            return [self.seq]
        return [self.seq, *(b.seq for b in self.branches)]


@dataclass(eq=False)
class _Idle:
    """A prompt left in the cache by a finished job, kept for the next that starts like it."""

    seq: int
    tokens: list[int]
    used: int
    logits: Any = None
    #: The adapter the prefix was read under: its cache is no other adapter's.
    adapter: Adapter | None = None
    #: Left by a scoring job (decide's prompt), not by a generation.
    scoring_prompt: bool = False


@dataclass(eq=False)
class _Shelved:
    """A prompt's cells copied to host memory (``llama_state_seq_get_data``).

    It is put back into a free sequence (``llama_state_seq_set_data``) when a
    request starts like it: milliseconds of copying instead of reading it again.
    """

    tokens: list[int]
    data: Any
    used: int
    adapter: Adapter | None = None
    scoring_prompt: bool = False
    #: The last prompt token's logits row, kept with a whole scoring prompt.
    logits: Any = None
    #: Host bytes it holds: its cells, and its logits row if any.
    size: int = 0


def _put_all(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


def _lse(row: Any) -> float:
    """The log of the sum of exp over a logits row, in float64 (log-probability = logit - this)."""
    row64 = np.asarray(row, dtype=np.float64)
    peak = float(row64.max())
    return peak + float(np.log(np.exp(row64 - peak).sum()))


def _left_by_scoring(src: _Idle | _Shelved | Job) -> bool:
    """Whether a prefix source is a scoring prompt (decide's), live, idle or shelved."""
    return src.scoring is not None if isinstance(src, Job) else src.scoring_prompt


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """The step loop of one loaded model (see the module's docstring)."""

    def __init__(
        self,
        llama: Any,
        *,
        slots: int,
        n_ctx: int,
        cache_tokens: int,
        threads: int,
        prefill_tokens: int,
        on_cached: Callable[[int], None] | None = None,
        shelf_bytes: int = SHELF_BYTES,
    ) -> None:
        import llama_cpp
        from llama_cpp import _internals

        self.llama = llama
        self.model = llama._model
        self.vocab = self.model.vocab
        self.n_vocab: int = llama.n_vocab()
        self.slots = max(1, slots)
        self.n_ctx = n_ctx
        self.prefill = max(16, prefill_tokens)
        self.capacity = self.prefill + 16 * self.slots
        self.n_seq = min(llama_cpp.llama_max_parallel_sequences(), 8 * self.slots + 16)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = max(cache_tokens, n_ctx)
        params.n_batch = self.capacity
        params.n_ubatch = min(self.capacity, 512)
        params.n_seq_max = self.n_seq
        params.n_threads = params.n_threads_batch = max(1, threads)
        params.kv_unified = True
        # Flash attention, explicitly: its CPU kernel skips masked cells, so a sequence's
        # answer does not depend on where its cells sit in the shared cache (a prefix
        # copied from another sequence leaves gaps). Without it the softmax sums over
        # gaps in another order, and a near-tied greedy pick flipped after a copy. A
        # lone request equals llama-cpp-python's ``Llama(..., flash_attn=True)`` exactly.
        params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        self.ctx: Any = _internals.LlamaContext(model=self.model, params=params, verbose=False)
        self.n_cells: int = llama_cpp.llama_n_ctx(self.ctx.ctx)
        self.memory = llama_cpp.llama_get_memory(self.ctx.ctx)
        # Up to every sequence id on one token: a scoring trie's node is in all its tips.
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, self.n_seq)
        self._lib = llama_cpp
        # A logits row's address as a plain int (the bindings' own function returns a
        # ctypes pointer, and turning that into an array costs more than the argmax):
        # a separate function object, so the bindings' one is left as it is.
        self._logits_at = llama_cpp.llama_cpp._lib["llama_get_logits_ith"]
        self._logits_at.argtypes = [ctypes.c_void_p, ctypes.c_int32]
        self._logits_at.restype = ctypes.c_void_p
        self._row_type = ctypes.c_float * self.n_vocab
        #: Each token's bytes and whether it ends a generation, as first asked: the
        #: vocabulary never changes (so neither outgrows it), and a call into llama.cpp
        #: costs more than a lookup.
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        # The adapter set on the context now (None: the base), and the group's turn.
        self._applied: Adapter | None = None
        self._turn: tuple[Adapter | None, int] = (None, 0)
        self._releases: list[tuple[Adapter, Callable[[], None], threading.Event]] = []
        #: Work to run on the step thread between two steps (``call``).
        self._calls: list[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] = []
        self._on_cached = on_cached
        self._cv = threading.Condition()
        self._inbox: list[Job] = []
        self._waiting: deque[Job] = deque()
        self._live: list[Job] = []
        self._idle: list[_Idle] = []
        #: Prompts moved out of the cache to host memory, oldest use first (``_shelve``).
        self._shelf: list[_Shelved] = []
        self.shelf_bytes = max(0, shelf_bytes)
        self._free = list(range(self.n_seq - 1, -1, -1))
        self._used = 0
        #: The most cells the live and idle sequences held at once since the idle
        #: prefixes were last packed (``_compact``): how far the cache may have spread.
        self._high = 0
        self._tick = 0
        self._closing = False
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Any, Job, Event]] = []
        self._thread = threading.Thread(target=self._run, name="llama-steps", daemon=True)
        self._thread.start()

    # -- the asyncio side ------------------------------------------------------------

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
        """End ``job``'s branches at the next step, each with what it produced so far.

        Its caller hung up: the branches end as if at their token limit
        (``length``) and the job ends as any other (its answer, then ``done``),
        so it is billed for what it produced. A job that has produced nothing
        yet (its prompt is still being read, or it waits) ends with a
        ``stopped`` event instead, and is dropped as a cancelled one.
        """
        job.stopping = True
        with self._cv:
            self._cv.notify()

    def release(self, adapter: Adapter, free: Callable[[], None]) -> threading.Event:
        """End ``adapter``'s jobs and prefixes, then ``free`` it, between two steps.

        Jobs still running on it fail as retryable (the version was unloaded);
        its idle prefixes are evicted. The returned event is set once ``free``
        has run (on the step thread, or here when the scheduler is closed).
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

        For llama.cpp work outside this scheduler's context (the embedding
        context): every decode of the process then runs on one thread, so
        llama.cpp's OpenMP threads stay one team. A second thread that decodes
        makes a second team, and once libgomp manages more threads than there
        are cores it cuts every team's spin to about a hundred turns before
        sleeping: one sequence then decoded at a third of its speed (33 against
        90 tokens/s on two cores) for the rest of the process's life.
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
                if event[0] == "error":
                    ended = True
                    raise event[1]
                yield event
                if event[0] in ("done", "stopped"):
                    ended = True
                    return
        finally:
            if not ended:
                self.cancel(job)

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify()
        self._thread.join()
        for job in [*self._waiting, *self._live, *self._inbox]:
            job.post(("error", UpstreamError("the embedded model was unloaded", retryable=True)))
        self._deliver()
        for _, call_done in self._calls:
            if call_done.set_running_or_notify_cancel():
                call_done.set_exception(
                    UpstreamError("the embedded model was unloaded", retryable=True)
                )
        self._calls.clear()
        for adapter, free, done in self._releases:
            adapter.released = True
            free()
            done.set()
        self._releases.clear()
        self._lib.llama_batch_free(self.batch)
        self.ctx.close()

    # -- the step loop ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._closing
                    or self._inbox
                    or self._live
                    or self._waiting
                    or self._releases
                    or self._calls
                ):
                    self._cv.wait()
                if self._closing:
                    return
                self._waiting.extend(self._inbox)
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
                    self._release(adapter, free, done)
                self._step()
            except Exception as exc:  # a native failure: fail what runs, start clean
                log.exception("embedded model step failed")
                for job in [*self._live]:
                    self._fail(job, UpstreamError(f"the embedded model failed: {exc}"))
                self._lib.llama_memory_clear(self.memory, True)
                self._idle.clear()
                self._free = list(range(self.n_seq - 1, -1, -1))
                self._used = 0
            self._deliver()
            if self._spread():
                self._compact()

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

    def _step(self) -> None:
        self._tick += 1
        self._reap()
        self._admit()
        if not self._live:
            if self._waiting:
                # Nothing runs and the first waiting job cannot start: it never will.
                job = self._waiting.popleft()
                job.post(
                    (
                        "error",
                        UpstreamError(
                            f"the request needs {job.reserve} cache cells and "
                            f"{1 + len(job.branches)} sequences; the cache has {self.n_cells}",
                            code="context_length_exceeded",
                            retryable=False,
                        ),
                    )
                )
            return
        self._follow()
        rows = self._fill()
        if self.batch.n_tokens == 0:
            return
        rc = self._lib.llama_decode(self.ctx.ctx, self.batch)
        if rc == 1 and self._idle:
            # No room for the batch (the cache is fragmented): the idle prompts make way,
            # to the shelf, where a later request still finds them. A refused decode
            # changed nothing in the cache, so what they hold is intact.
            while self._idle:
                self._put_away(self._idle[0])
            rc = self._lib.llama_decode(self.ctx.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self._high = max(self._high, self._held())
        self._after(rows)

    def _held(self) -> int:
        """Cells the live jobs and idle prefixes hold now (a shared prefix counted each time)."""
        cells = sum(len(i.tokens) for i in self._idle)
        for job in self._live:
            cells += job.pos
            if job.scoring is not None:
                cells += len(job.scoring.nodes) if job.scoring.rows else 0
            else:
                cells += sum(max(0, b.pos - len(job.prompt)) for b in job.branches)
        return cells

    def _spread(self) -> bool:
        """Nothing runs or waits, and a burst spread the cache a span step past the idle cells."""
        if not self._idle or self._live or self._waiting or self._high - self._used < SPAN_PAD:
            return False
        with self._cv:
            return not self._inbox

    def _compact(self) -> None:
        """Pack the idle prefixes into the lowest cells, while nothing runs.

        A unified cache attends, every step, over every cell up to the highest
        one in use (``bench/cache_span.py``: a thousand cells more cost a lone
        sequence 13 % a token). A burst of requests spreads the cache; when it
        ends, the few prompts kept as idle prefixes sit wherever their requests
        happened to be placed, and the next lone request paid for the whole
        span of the burst (1.14 x slower a token after a burst of sixteen
        chats). Each idle prefix is saved (``llama_state_seq_get_data``), the
        cache emptied, and the prefixes put back from cell 0, longest first; a
        prefix that begins like one already back shares that one's cells again,
        as it did before (``llama_memory_seq_cp``). Cells keep their order, so
        attention sums in the same order: answers are unchanged. It costs a copy
        of the idle cells (tens of kilobytes a token, at most ``PACK_BYTES``),
        and runs only when the burst spread the cache at least one span step
        (``SPAN_PAD``) past them.
        """
        lib, ctx = self._lib, self.ctx.ctx
        self._high = self._used
        longest_first = sorted(self._idle, key=lambda i: -len(i.tokens))
        sizes = [lib.llama_state_seq_get_size(ctx, idle.seq) for idle in longest_first]
        if sum(sizes) > PACK_BYTES:
            return  # long idle prompts: copying them would stall the next request
        saved: list[tuple[_Idle, Any]] = []
        for idle, size in zip(longest_first, sizes, strict=True):
            data = (ctypes.c_uint8 * size)()
            if lib.llama_state_seq_get_data(ctx, data, size, idle.seq) != size:
                return  # nothing moved yet: leave the cache as it is
            saved.append((idle, data))
        lib.llama_memory_clear(self.memory, False)
        back: list[_Idle] = []
        for idle, data in saved:
            src, shared = None, 0
            for other in back:
                if other.adapter is idle.adapter:
                    n = _common(other.tokens, idle.tokens)
                    if n > shared:
                        src, shared = other, n
            if src is not None and shared == len(idle.tokens):
                lib.llama_memory_seq_cp(self.memory, src.seq, idle.seq, 0, shared)
            elif lib.llama_state_seq_set_data(ctx, data, len(data), idle.seq) == 0:
                self._evict(idle)  # no room after all (it had room before): lose only it
                continue
            elif src is not None:
                lib.llama_memory_seq_rm(self.memory, idle.seq, 0, shared)
                lib.llama_memory_seq_cp(self.memory, src.seq, idle.seq, 0, shared)
            back.append(idle)

    def _reap(self) -> None:
        for job in [j for j in (*self._waiting, *self._live) if j.stopping and not j.cancelled]:
            job.stopping = False
            if job.forked and job.scoring is None and job in self._live:
                for branch in job.branches:
                    if not branch.done:
                        self._end(job, branch, "length", stopped=False)
                self._maybe_done(job)
            else:
                job.cancelled = True
                job.post(("stopped",))
        if any(j.cancelled for j in self._waiting):
            self._waiting = deque(j for j in self._waiting if not j.cancelled)
        for job in [j for j in self._live if j.cancelled]:
            self._finish(job, keep=job.pos > 0)

    def _best_prefix(self, new: Job) -> tuple[_Idle | Job | None, int]:
        """The idle or live prompt that starts most like ``new``'s, and how much it shares."""
        prompt = new.prompt
        best: _Idle | Job | None = None
        most = 0
        for idle in self._idle:
            if idle.adapter is not new.adapter:
                continue
            n = _common(idle.tokens, prompt)
            if n > most:
                best, most = idle, n
        for job in self._live:
            if job.adapter is not new.adapter:
                continue
            n = min(_common(job.prompt, prompt), job.pos)
            if n > most:
                best, most = job, n
        return best, most

    def _shelved_prefix(self, new: Job, have: int) -> tuple[_Shelved | None, int]:
        """A shelved prompt worth putting back: it shares enough more of ``new``'s than ``have``.

        Enough is one token in ``SHELF_DUP`` of the ``have`` cells it would duplicate, and
        at least one.
        """
        best: _Shelved | None = None
        most = have + max(1, -(-have // SHELF_DUP)) - 1
        for shelved in self._shelf:
            if shelved.adapter is new.adapter:
                n = _common(shelved.tokens, new.prompt)
                if n > most:
                    best, most = shelved, n
        return best, (most if best is not None else have)

    def _admit(self) -> None:
        while self._waiting and len(self._live) < self.slots:
            job = self._waiting[0]
            self._shelve(job)
            kept, held = self._best_prefix(job)
            shelved, match = self._shelved_prefix(job, held)
            src: _Idle | _Shelved | Job | None = shelved or kept
            reuse_logits = (
                isinstance(src, _Idle | _Shelved)
                and job.scoring is not None
                and match == len(job.prompt) == len(src.tokens)
                and src.logits is not None
            )
            if not reuse_logits:
                match = min(match, len(job.prompt) - 1)
            lead, lead_at = self._leader(job, match)
            # Copy an idle prefix while there is room, so the job it came from
            # (a chat's next turn, the next text of a decision set) still finds it;
            # take the idle sequence over only when room is short.
            room = (
                len(self._free) >= len(job.branches) + 1
                and self._used + job.reserve <= self.n_cells
            )
            take = isinstance(src, _Idle) and match > 0 and not room
            ids = len(job.branches) + (0 if take else 1)
            cells = job.reserve - (len(src.tokens) if take and isinstance(src, _Idle) else 0)
            if isinstance(src, _Shelved):
                cells += len(src.tokens) - match  # put back whole, then cut to ``match``
            for idle in sorted(self._idle, key=lambda i: i.used):
                if len(self._free) >= ids and self._used + cells <= self.n_cells:
                    break
                if idle is not src or not take:
                    self._put_away(idle)
                    if idle is src:
                        src, match, reuse_logits = None, 0, False
            if len(self._free) < ids or self._used + cells > self.n_cells:
                return
            self._waiting.popleft()
            if take and isinstance(src, _Idle):
                self._idle.remove(src)
                self._used -= len(src.tokens)
                job.seq = src.seq
                self._lib.llama_memory_seq_rm(self.memory, job.seq, match, -1)
            else:
                job.seq = self._free.pop()
                self._lib.llama_memory_seq_rm(self.memory, job.seq, -1, -1)
                if isinstance(src, _Shelved):
                    if not self._restore(src, job.seq, match):
                        # Read it instead, from what the cache itself holds of it.
                        src, match, reuse_logits = None, 0, False
                        if kept is not None and (kept in self._idle or kept in self._live):
                            src, match = kept, min(held, len(job.prompt) - 1)
                            self._lib.llama_memory_seq_cp(self.memory, kept.seq, job.seq, 0, match)
                elif src is not None and match > 0:
                    self._lib.llama_memory_seq_cp(self.memory, src.seq, job.seq, 0, match)
                else:
                    match = 0
            if reuse_logits and isinstance(src, _Idle | _Shelved):
                job.logits = src.logits
            for branch in job.branches:
                branch.seq = self._free.pop()
                if job.scoring is not None:
                    # A tip sees the prompt: the copied prefix now, the rest as it is read.
                    self._lib.llama_memory_seq_rm(self.memory, branch.seq, -1, -1)
                    if match:
                        self._lib.llama_memory_seq_cp(self.memory, job.seq, branch.seq, 0, match)
            self._used += job.reserve
            self._opened(job, src, match)
            job.lead, job.lead_at = lead, lead_at
            self._live.append(job)
            if reuse_logits and job.logits is not None:
                self._fork(job, None)

    def _leader(self, new: Job, have: int) -> tuple[Job | None, int]:
        """A live job still reading at least ``FOLLOW_MIN`` more of ``new``'s opening.

        Requests that start together and share a long opening (the rows of a run
        under one system prompt, the first texts of a decision set) would each
        read it: the cache holds it only once one has. The newcomer waits for
        the one reading it instead, and copies it (``_follow``): the opening is
        read once, and the cache holds one copy of it, not one a request (four
        decide texts starting together had left four whole prompts idle, 420
        cells that slowed the rest of their load by a tenth).
        """
        best: Job | None = None
        most = have + FOLLOW_MIN - 1
        for job in self._live:
            if job.adapter is not new.adapter:
                continue
            n = min(_common(job.prompt, new.prompt), len(new.prompt) - 1)
            if n > most and job.pos < n:  # read that far already: ``_best_prefix`` had it
                best, most = job, n
        return best, (most if best is not None else 0)

    def _follow(self) -> None:
        """Jobs waiting on another's reading copy what it has read (see ``_leader``)."""
        for job in self._live:
            lead = job.lead
            if lead is None:
                continue
            if lead.finished or lead.cancelled:
                # It ended first (a one-token answer) or was cancelled: what it read
                # may be an idle prefix now; else the rest is read here.
                job.lead = None
                src, n = self._best_prefix(job)
                n = min(n, len(job.prompt) - 1)
                if src is not None and n > job.pos:
                    self._copy_opening(job, src, n)
                continue
            if lead.lead is None and lead.pos >= job.lead_at:
                job.lead = None
                self._copy_opening(job, lead, job.lead_at)

    def _copy_opening(self, job: Job, src: _Idle | Job, n: int) -> None:
        """Replace what ``job`` holds of its prompt by the first ``n`` tokens of ``src``'s."""
        lib = self._lib
        for seq in job.seqs():
            lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
            lib.llama_memory_seq_cp(self.memory, src.seq, seq, 0, n)
        self._opened(job, src, n)

    def _opened(self, job: Job, src: _Idle | _Shelved | Job | None, n: int) -> None:
        """Record that ``job`` holds the first ``n`` tokens of its prompt, from ``src``."""
        if n and src is not None:
            if not isinstance(src, Job):
                src.used = self._tick
            job.after_scoring = _left_by_scoring(src)
            if self._on_cached is not None:
                self._on_cached(n - job.cached)
        job.pos = job.cached = n
        if not job.whole and job.scoring is None:
            # A stream cut short is settled before "done" says what was cached.
            job.post(("cached", n))

    def _shelve(self, job: Job) -> None:
        """Before ``job`` is placed, move out of the cache what no one about to run shares.

        Every step attends over every cell up to the highest one in use, idle
        ones included (``bench/cache_span.py``): a decision set's prompt left
        idle slowed every token of the chats that followed it by 5-8 %, and a
        finished chat's own text, which the next rows of a run never share, as
        much. An idle prompt's cells that neither ``job`` nor a live job shares
        are copied to host memory (the shelf) and freed; the part they share
        stays. A later request that starts like a shelved prompt gets it back
        in milliseconds (``_restore``) instead of reading it again, as
        ``llama-server``'s host prompt cache (``--cache-ram``) does for its
        slots. Each slot of ``llama-server`` attends only over its own cells;
        this is how one unified cache attends over little more.
        """
        for idle in list(self._idle):
            share = _common(idle.tokens, job.prompt) if idle.adapter is job.adapter else 0
            for live in self._live:
                if live.adapter is idle.adapter:
                    share = max(share, min(_common(idle.tokens, live.prompt), live.pos))
            if share >= len(idle.tokens):
                continue
            self._save(idle)
            held = any(
                other is not idle
                and other.adapter is idle.adapter
                and _common(other.tokens, idle.tokens) >= share
                for other in self._idle
            )
            if share == 0 or held:
                self._evict(idle)
            else:
                self._lib.llama_memory_seq_rm(self.memory, idle.seq, share, -1)
                self._used -= len(idle.tokens) - share
                idle.tokens, idle.logits = idle.tokens[:share], None

    def _save(self, idle: _Idle) -> None:
        """Copy an idle prompt's cells to the shelf, unless it holds them already."""
        n = len(idle.tokens)
        if n < SHELF_MIN or not self.shelf_bytes:
            return
        same = [s for s in self._shelf if s.adapter is idle.adapter]
        for shelved in same:
            if len(shelved.tokens) >= n and shelved.tokens[:n] == idle.tokens:
                shelved.used = max(shelved.used, idle.used)
                return
        lib, ctx = self._lib, self.ctx.ctx
        size = int(lib.llama_state_seq_get_size(ctx, idle.seq))
        if size > self.shelf_bytes:
            return
        data = (ctypes.c_uint8 * size)()
        if lib.llama_state_seq_get_data(ctx, data, size, idle.seq) != size:
            return
        for shelved in same:  # a shorter opening of it is now redundant
            if shelved.tokens == idle.tokens[: len(shelved.tokens)]:
                self._shelf.remove(shelved)
        if idle.logits is not None:
            size += int(idle.logits.nbytes)
        self._shelf.append(
            _Shelved(
                idle.tokens,
                data,
                idle.used,
                idle.adapter,
                idle.scoring_prompt,
                idle.logits,
                size,
            )
        )
        while self.shelf_held > self.shelf_bytes:
            self._shelf.remove(min(self._shelf, key=lambda s: s.used))

    @property
    def shelf_held(self) -> int:
        """Host bytes the shelf holds now."""
        return sum(s.size for s in self._shelf)

    async def shelf_state(self) -> tuple[int, int]:
        """The shelf's bytes and prompts, read between two steps (the step thread owns it)."""
        return await self.call(lambda: (self.shelf_held, len(self._shelf)))

    def _put_away(self, idle: _Idle) -> None:
        """An idle prompt leaves the cache for the shelf (``_save``), its cells freed."""
        self._save(idle)
        self._evict(idle)

    def _restore(self, shelved: _Shelved, seq: int, n: int) -> bool:
        """Put the first ``n`` tokens of a shelved prompt back into ``seq`` (False: no room)."""
        lib = self._lib
        data = shelved.data
        if lib.llama_state_seq_set_data(self.ctx.ctx, data, len(data), seq) == 0:
            return False  # no run of free cells long enough: the prompt is read instead
        lib.llama_memory_seq_rm(self.memory, seq, n, -1)
        return True

    def _evict(self, idle: _Idle) -> None:
        self._idle.remove(idle)
        self._lib.llama_memory_seq_rm(self.memory, idle.seq, -1, -1)
        self._free.append(idle.seq)
        self._used -= len(idle.tokens)

    def _add(self, token: int, pos: int, seqs: list[int], logits: bool) -> int:
        b = self.batch
        i = int(b.n_tokens)
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = len(seqs)
        ids = b.seq_id[i]
        for k, seq in enumerate(seqs):
            ids[k] = seq
        b.logits[i] = logits
        b.n_tokens = i + 1
        return i

    def _apply_adapter(self, adapter: Adapter | None) -> None:
        """Set ``adapter`` (None: none) on the context for the step about to be decoded."""
        if adapter is self._applied:
            return
        lib = self._lib
        if adapter is None:
            rc = lib.llama_set_adapters_lora(self.ctx.ctx, None, 0, None)
        else:
            handles = (lib.llama_adapter_lora_p_ctypes * 1)(adapter.handle)
            scales = (ctypes.c_float * 1)(adapter.scale)
            rc = lib.llama_set_adapters_lora(self.ctx.ctx, handles, 1, scales)
        if rc != 0:
            raise RuntimeError(f"llama_set_adapters_lora returned {rc}")
        self._applied = adapter

    def _next_adapter(self) -> Adapter | None:
        """The adapter whose jobs this step serves: the groups take turns of ``ADAPTER_TURN``."""
        groups: list[Adapter | None] = []
        for job in self._live:
            if job.adapter not in groups:
                groups.append(job.adapter)
        current, steps = self._turn
        if current in groups and (steps < ADAPTER_TURN or len(groups) == 1):
            self._turn = (current, steps + 1)
            return current
        # The next group after the current one, in the order the live jobs arrived.
        after = groups.index(current) + 1 if current in groups else 0
        chosen = groups[after % len(groups)]
        self._turn = (chosen, 1)
        return chosen

    def _release(self, adapter: Adapter, free: Callable[[], None], done: threading.Event) -> None:
        """``release``'s work, on the step thread between two steps."""
        try:
            gone = UpstreamError(
                f"model version {adapter.name} was unloaded", code="model_unloaded", retryable=True
            )
            for job in [j for j in self._waiting if j.adapter is adapter]:
                self._waiting.remove(job)
                job.post(("error", gone))
            for job in [j for j in self._live if j.adapter is adapter]:
                self._finish(job, keep=False)
                job.post(("error", gone))
            for idle in [i for i in self._idle if i.adapter is adapter]:
                self._evict(idle)
            self._shelf = [s for s in self._shelf if s.adapter is not adapter]
            if self._applied is adapter:
                self._apply_adapter(None)
            if self._turn[0] is adapter:
                self._turn = (None, 0)
            free()
        finally:
            done.set()

    def _fill(self) -> list[Job]:
        """One step's batch: decoding branches and scoring tries first, then prompt chunks
        within the budget. A scoring job's trie goes in the step after its prompt's last
        chunk, whole."""
        self.batch.n_tokens = 0
        adapter = self._next_adapter()
        self._apply_adapter(adapter)
        group = [j for j in self._live if j.adapter is adapter]
        room = self.capacity
        for job in group:
            if job.scoring is not None:
                if job.scoring.due and len(job.scoring.nodes) <= room:
                    room -= self._add_nodes(job)
                continue
            if not job.forked:
                continue
            for branch in job.branches:
                branch.rows = []
                if branch.done or not branch.pending:
                    continue
                take = branch.pending[: max(0, room)]
                if not take:
                    continue
                del branch.pending[: len(take)]
                for token in take:
                    branch.rows.append(self._add(token, branch.pos, [branch.seq], True))
                    branch.pos += 1
                room -= len(take)
        budget = min(self.prefill, room)
        for job in group:
            job.row = -1
            if job.forked or job.lead is not None or job.pos >= len(job.prompt) or budget <= 0:
                continue
            chunk = job.prompt[job.pos : job.pos + budget]
            end = job.pos + len(chunk) == len(job.prompt)
            seqs = job.seqs()
            row = -1
            for k, token in enumerate(chunk):
                row = self._add(token, job.pos + k, seqs, end and k == len(chunk) - 1)
            job.row = row if end else -1
            job.pos += len(chunk)
            budget -= len(chunk)
            room -= len(chunk)
            if end and job.scoring is not None and job.scoring.nodes:
                # Its trie goes into the next step, not beside this chunk: a row's
                # attention rounds by the shape of its micro-batch (see
                # docs/explanation/batch-invariance.md), and read apart a text's
                # scores are the ones its prompt gives alone.
                job.scoring.due = True
        return group

    def _add_nodes(self, job: Job) -> int:
        """Every decoded node of a scoring job's trie, in the tips' sequences."""
        scoring = job.scoring
        assert scoring is not None
        n = len(job.prompt)
        tips = [b.seq for b in job.branches]
        scoring.rows = [
            self._add(token, n + depth, [tips[t] for t in under], True)
            for token, depth, under in scoring.nodes
        ]
        scoring.due = False
        return len(scoring.nodes)

    def _row(self, i: int) -> Any:
        """Batch row ``i``'s logits, a view into llama.cpp's buffer (valid until the next step)."""
        address = self._logits_at(self.ctx.ctx, i)
        if not address:
            raise RuntimeError(f"llama.cpp has no logits for batch row {i}")
        return np.frombuffer(self._row_type.from_address(address), dtype=np.float32)

    def _piece(self, token: int) -> bytes:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = token_piece(self.vocab, token)
        return piece

    def _ends(self, token: int) -> bool:
        """Whether ``token`` ends a generation (end of turn, end of text)."""
        ends = self._eog.get(token)
        if ends is None:
            ends = self._eog[token] = bool(self._lib.llama_vocab_is_eog(self.vocab, token))
        return ends

    def _after(self, group: list[Job]) -> None:
        for job in group:
            if job.cancelled:
                continue
            if job.scoring is not None:
                self._scored(job)
                continue
            if not job.forked:
                if job.row >= 0:
                    self._fork(job, job.row)
                continue
            for branch in job.branches:
                if branch.done or not branch.rows:
                    continue
                self._sample(job, branch, branch.rows[-1])
            self._maybe_done(job)

    def _scored(self, job: Job) -> None:
        """A scoring job's rows are in: each candidate's log-probability, summed over its tokens."""
        scoring = job.scoring
        assert scoring is not None
        if job.row >= 0:
            job.logits = self._row(job.row).copy()
            job.forked = True
        if job.logits is None or (scoring.nodes and not scoring.rows):
            return  # the prompt or the trie is still to be decoded
        rows = [job.logits, *(self._row(r) for r in scoring.rows)]
        lse = [_lse(r) for r in rows]
        scores = [
            [float(rows[src + 1][t]) - lse[src + 1] for src, t in zip(reads, cont, strict=True)]
            for reads, cont in zip(scoring.reads, scoring.conts, strict=True)
        ]
        for branch in job.branches:
            branch.done = True
        self._finish(job, keep=True)
        job.post(("scores", scores))
        job.post(("done", len(job.prompt), job.cached))

    def _fork(self, job: Job, row: int | None) -> None:
        """The prompt is read: start every branch off it (a scoring job: its trie is due)."""
        job.forked = True
        if job.scoring is not None:
            if job.scoring.nodes:
                job.scoring.due = True  # decoded in the next step
            else:
                self._scored(job)  # every candidate is one token: the cached row answers all
            return
        assert row is not None
        n_prompt = len(job.prompt)
        for branch in job.branches:
            self._lib.llama_memory_seq_rm(self.memory, branch.seq, -1, -1)
            self._lib.llama_memory_seq_cp(self.memory, job.seq, branch.seq, 0, n_prompt)
            branch.pos = n_prompt
            assert branch.params is not None
            branch.sampler = build_sampler(self.model, self.n_vocab, branch.params)
            branch.matcher = StopMatcher(branch.stops)
            branch.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._sample(job, branch, row)
        self._maybe_done(job)

    def _sample(self, job: Job, branch: Branch, row: int) -> None:
        lib = self._lib
        lps = log_softmax(self._row(row)) if branch.logprobs else None
        if branch.params is not None and branch.params.plain_greedy:
            token = int(np.argmax(self._row(row)))
        else:
            token = int(lib.llama_sampler_sample(branch.sampler.sampler, self.ctx.ctx, row))
        if self._ends(token):
            self._end(job, branch, "stop", stopped=False)
            return
        branch.out_tokens += 1
        raw = self._piece(token)
        assert branch.decoder is not None and branch.matcher is not None
        text, stopped = branch.matcher.feed(branch.decoder.decode(raw))
        entries = None
        if lps is not None:
            entries = [
                {
                    "token": raw.decode("utf-8", errors="replace"),
                    "logprob": float(lps[token]),
                    "bytes": list(raw),
                    "top_logprobs": [
                        {
                            "token": (piece := self._piece(t)).decode("utf-8", errors="replace"),
                            "logprob": lp,
                            "bytes": list(piece),
                        }
                        for t, lp in top_logprobs(lps, branch.top)
                    ],
                }
            ]
        if job.whole:
            if text:
                branch.held.append(text)
            if entries:
                branch.held_entries.extend(entries)
        elif text or entries:
            job.post(("piece", job.branches.index(branch), text, entries))
        if stopped:
            self._end(job, branch, "stop", stopped=True)
        elif branch.out_tokens >= branch.max_tokens:
            self._end(job, branch, "length", stopped=False)
        else:
            branch.pending = [token]

    def _end(self, job: Job, branch: Branch, finish: str, *, stopped: bool) -> None:
        branch.done, branch.finish = True, finish
        assert branch.matcher is not None and branch.decoder is not None
        tail = ""
        if not stopped:
            # Text held back for a stop string that never came is the answer's too.
            tail, _ = branch.matcher.feed(branch.decoder.decode(b"", final=True))
            tail += branch.matcher.flush()
        matched = branch.matcher.matched if stopped else None
        index = job.branches.index(branch)
        if branch.held or branch.held_entries:
            job.post(("piece", index, "".join(branch.held), branch.held_entries))
            branch.held, branch.held_entries = [], []
        job.post(("branch", index, tail, finish, branch.out_tokens, matched))

    def _maybe_done(self, job: Job) -> None:
        if job.forked and all(b.done for b in job.branches):
            # Freed before the caller hears: what it sends next finds the room.
            self._finish(job, keep=True)
            job.post(("done", len(job.prompt), job.cached))

    def _finish(self, job: Job, *, keep: bool) -> None:
        """Free a job's branches; its read prompt stays as an idle prefix."""
        job.finished = True
        self._live.remove(job)
        self._used -= job.reserve
        for branch in job.branches:
            if branch.seq >= 0:
                self._lib.llama_memory_seq_rm(self.memory, branch.seq, -1, -1)
                self._free.append(branch.seq)
                branch.seq = -1
            if branch.sampler is not None:
                branch.sampler.close()
                branch.sampler = None
        n = min(job.pos, len(job.prompt))
        if job.scoring is not None and job.after_scoring and n // 2 <= job.cached < n:
            # A scoring prompt that began with most of another scoring prompt (the
            # next text of a decision set: the set's questions, then its own text)
            # keeps only the opening they share. Its text is rarely asked again, and
            # every idle cell widens the span each step's attention runs over (a
            # unified cache attends up to its highest used cell): eight idle texts of
            # a set doubled that span (docs/explanation/embedded-speed.md). The
            # first text of a set, which shares only the chat template's opening
            # with what came before, stays whole: its questions are the opening the
            # next texts copy.
            n = job.cached
        kept = job.prompt[:n]
        if keep and any(i.tokens == kept and i.adapter is job.adapter for i in self._idle):
            keep = False  # the cache already holds this prompt (it was copied from it)
        if keep and n > 0:
            self._lib.llama_memory_seq_rm(self.memory, job.seq, n, -1)
            logits = job.logits if n == len(job.prompt) else None
            scoring = job.scoring is not None
            self._idle.append(
                _Idle(
                    job.seq,
                    kept,
                    self._tick,
                    logits,
                    job.adapter,
                    scoring,
                )
            )
            self._used += n
            # As many idle prefixes as slots, the least recently used to the shelf first:
            # every step's attention scans the cache up to its highest used cell (row by
            # row, masked cells included), so idle cells kept beyond what the next
            # requests can reuse slow every request down.
            while len(self._idle) > self.slots:
                self._put_away(min(self._idle, key=lambda i: i.used))
        else:
            self._lib.llama_memory_seq_rm(self.memory, job.seq, -1, -1)
            self._free.append(job.seq)

    def _fail(self, job: Job, exc: BaseException) -> None:
        job.post(("error", exc))
        if job in self._live:
            self._live.remove(job)
