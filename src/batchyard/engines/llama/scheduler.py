"""What each step of one llama context holds, and what its results mean: plain Python.

One step is one ``llama_decode``:

1. drop cancelled jobs, freeing their cells, and end stopped ones;
2. admit waiting jobs while a slot (a request running at once, as
   ``llama-server`` calls it), sequence ids and cells are free; the cache
   manager (``engines.llama.cache``) gives each its opening from the cache or
   the shelf;
3. fill the batch: one token of every generating branch, then chunks of
   prompts being read up to the step's prefill budget (chunked prefill); a
   scoring job's candidate trie goes in beside its prompt's last chunk (the next
   step when this one has no room for it), so a text costs one decode;
4. decode, then sample each branch with its own sampler chain from its own
   logits row, and score what was scored.

A generating job whose prompt is read forks its branches off it (each a
sequence copy of the prompt), so ``n`` samples share one read. A scoring job
(decide: every outcome of every decision of one text) reads its prompt once
and decodes all its candidates as one token trie (``engines.llama.scoring``).

LoRA versions share the base model's context. llama.cpp applies adapters to a
whole context, not per sequence, so each step serves the jobs of one adapter
(or of the base), set on the context just before the step's decode. The
groups take turns of ``ADAPTER_TURN`` steps, so every live job gets tokens at
the same pace whatever its adapter, and the context switches adapters (which
makes llama.cpp re-plan its compute graph) at most once a turn. An idle prefix
belongs to the adapter it was read under.

The scheduler runs on one thread (``engines.llama.steps``) and touches
llama.cpp only through ``Context``, so the unit tests drive it step by step
over an in-memory context.
"""

from __future__ import annotations

import codecs
from collections import deque

import numpy as np

from batchyard.engines.llama.cache import CacheManager, Tuning
from batchyard.engines.llama.context import Adapter, Context
from batchyard.engines.llama.jobs import (
    Branch,
    BranchEnded,
    Cached,
    Done,
    Failed,
    Job,
    JobState,
    Piece,
    Scored,
    Stopped,
)
from batchyard.engines.llama_sampling import StopMatcher, log_softmax, top_logprobs
from batchyard.errors import UpstreamError

__all__ = ["ADAPTER_TURN", "Scheduler"]

#: Steps one adapter's group runs before the next group's turn. Switching makes
#: llama.cpp re-plan its graph; a few steps a turn keep that rare while streams of
#: every group still get a token every few steps.
ADAPTER_TURN = 4


class Scheduler:
    """The jobs of one context and the step that serves them (see the module's docstring)."""

    def __init__(
        self,
        ctx: Context,
        *,
        slots: int,
        prefill_tokens: int,
        shelf_bytes: int,
        tuning: Tuning | None = None,
    ) -> None:
        self.ctx = ctx
        self.slots = max(1, slots)
        self.prefill = max(16, prefill_tokens)
        self.tuning = tuning or Tuning()
        self.cache = CacheManager(
            ctx, slots=self.slots, shelf_bytes=shelf_bytes, tuning=self.tuning
        )
        self.waiting: deque[Job] = deque()
        self.live: list[Job] = []
        # The adapter set on the context now (None: the base), and the group's turn.
        self._applied: Adapter | None = None
        self._turn: tuple[Adapter | None, int] = (None, 0)

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    def add(self, job: Job) -> None:
        self.waiting.append(job)

    # -- one step ------------------------------------------------------------------------

    def step(self) -> None:
        """Admit, fill one batch, decode it, and act on what it gave."""
        self.cache.tick += 1
        self._reap()
        self._admit()
        if not self.live:
            if self.waiting:
                # Nothing runs and the first waiting job cannot start: it never will.
                job = self.waiting.popleft()
                job.state = JobState.DONE
                job.post(
                    Failed(
                        UpstreamError(
                            f"the request needs {job.reserve} cache cells and "
                            f"{1 + len(job.branches)} sequences; the cache has "
                            f"{self.ctx.n_cells}",
                            code="context_length_exceeded",
                            retryable=False,
                        )
                    )
                )
            return
        group, ends, tries = self._fill()
        if self.ctx.batch_size == 0:
            return
        rc = self.ctx.decode()
        if rc == 1 and self.cache.put_all_away():
            # No room for the batch (the cache is fragmented): the idle prompts make way,
            # to the shelf. A refused decode changed nothing in the cache.
            rc = self.ctx.decode()
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        self._after(group, ends, tries)

    def fail_all(self, exc: BaseException) -> None:
        """A native failure: fail what runs and start clean."""
        for job in self.live:
            job.state = JobState.DONE
            job.post(Failed(exc))
        self.live.clear()
        self.cache.reset()
        self._applied = None
        self._turn = (None, 0)

    def release(self, adapter: Adapter) -> None:
        """End ``adapter``'s jobs and prefixes (on the step thread, between two steps)."""
        gone = UpstreamError(
            f"model version {adapter.name} was unloaded", code="model_unloaded", retryable=True
        )
        for job in [j for j in self.waiting if j.adapter is adapter]:
            self.waiting.remove(job)
            job.state = JobState.DONE
            job.post(Failed(gone))
        for job in [j for j in self.live if j.adapter is adapter]:
            self._finish(job, keep=False)
            job.post(Failed(gone))
        self.cache.forget(adapter)
        if self._applied is adapter:
            self._apply(None)
        if self._turn[0] is adapter:
            self._turn = (None, 0)

    # -- admission -----------------------------------------------------------------------

    def _reap(self) -> None:
        for job in [j for j in (*self.waiting, *self.live) if j.stopping and not j.cancelled]:
            # Its caller hung up. Generating: each branch ends as at its token limit and
            # the job as any other (its answer, then ``Done``), so it is billed for what
            # it produced. Anything else produced nothing: ``Stopped``, then it is
            # dropped as a cancelled job is.
            job.stopping = False
            if job.state is JobState.GENERATING:
                for branch in job.branches:
                    if not branch.done:
                        self._end(job, branch, "length", stopped=False)
                self._maybe_done(job)
            else:
                job.cancelled = True
                job.post(Stopped())
        if any(j.cancelled for j in self.waiting):
            for job in [j for j in self.waiting if j.cancelled]:
                job.state = JobState.DONE
            self.waiting = deque(j for j in self.waiting if not j.cancelled)
        for job in [j for j in self.live if j.cancelled]:
            self._finish(job, keep=job.pos > 0)

    def _admit(self) -> None:
        while self.waiting and len(self.live) < self.slots:
            job = self.waiting[0]
            if self.tuning.shelve:
                self.cache.shelve(job, self.live)
            match = self.cache.lookup(job, self.live)
            placed = self.cache.place(job, match)
            if placed is None:
                return
            self.waiting.popleft()
            self.live.append(job)
            self._opened(job, placed.n)
            if placed.logits is not None:
                # The whole scoring prompt and its last row came from the cache, and with
                # them, for the same candidates, their scores.
                job.logits = placed.logits
                job.state = JobState.SCORING
                if placed.scores is not None:
                    self._answer(job, placed.scores)
                elif job.trie is None or not job.trie.nodes:
                    self._score(job, [])
            else:
                job.state = JobState.READING

    def _opened(self, job: Job, n: int) -> None:
        """Record that ``job`` holds the first ``n`` tokens of its prompt."""
        job.pos = job.cached = n
        if not job.whole and job.trie is None:
            # A stream cut short is settled before ``Done`` says what was cached.
            job.post(Cached(n))

    # -- the batch -----------------------------------------------------------------------

    def _apply(self, adapter: Adapter | None) -> None:
        if adapter is not self._applied:
            self.ctx.set_adapter(adapter)
            self._applied = adapter

    def _next_adapter(self) -> Adapter | None:
        """The adapter whose jobs this step serves: the groups take turns of ``ADAPTER_TURN``."""
        groups: list[Adapter | None] = []
        for job in self.live:
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

    def _fill(self) -> tuple[list[Job], list[tuple[Job, int]], list[tuple[Job, list[int]]]]:
        """One step's batch: decoding branches and due tries first, then prompt chunks
        within the budget. Returns the group served, the jobs whose prompt ends in this
        step with that row, and the tries decoded with their rows."""
        ctx = self.ctx
        ctx.clear_batch()
        adapter = self._next_adapter()
        self._apply(adapter)
        group = [j for j in self.live if j.adapter is adapter]
        room = ctx.capacity
        tries: list[tuple[Job, list[int]]] = []
        for job in group:
            if job.state is JobState.SCORING:
                assert job.trie is not None
                if len(job.trie.nodes) <= room:
                    tries.append((job, self._add_trie(job)))
                    room -= len(job.trie.nodes)
            elif job.state is JobState.GENERATING:
                for branch in job.branches:
                    branch.row = -1
                    if branch.done or branch.next_token is None or room <= 0:
                        continue
                    branch.row = ctx.add(branch.next_token, branch.pos, [branch.seq], True)
                    branch.next_token = None
                    branch.pos += 1
                    room -= 1
        budget = min(self.prefill, room)
        ends: list[tuple[Job, int]] = []
        for job in group:
            if job.state is not JobState.READING or budget <= 0:
                continue
            chunk = job.prompt[job.pos : job.pos + budget]
            end = job.pos + len(chunk) == len(job.prompt)
            seqs = job.seqs()
            row = -1
            for k, token in enumerate(chunk):
                row = ctx.add(token, job.pos + k, seqs, end and k == len(chunk) - 1)
            job.pos += len(chunk)
            budget -= len(chunk)
            room -= len(chunk)
            if not end:
                continue
            ends.append((job, row))
            trie = job.trie
            if trie is not None:
                job.state = JobState.SCORING
                if trie.nodes and self.tuning.score_with_prompt and len(trie.nodes) <= room:
                    tries.append((job, self._add_trie(job)))
                    room -= len(trie.nodes)
        return group, ends, tries

    def _add_trie(self, job: Job) -> list[int]:
        """Every decoded node of a scoring job's trie, in its tips' sequences."""
        assert job.trie is not None
        n = len(job.prompt)
        tips = [b.seq for b in job.branches]
        add = self.ctx.add
        return [
            add(token, n + depth, [tips[t] for t in under], True)
            for token, depth, under in job.trie.nodes
        ]

    # -- what a step gave ----------------------------------------------------------------

    def _after(
        self,
        group: list[Job],
        ends: list[tuple[Job, int]],
        tries: list[tuple[Job, list[int]]],
    ) -> None:
        for job in group:
            if job.state is JobState.GENERATING and not job.cancelled:
                for branch in job.branches:
                    if not branch.done and branch.row >= 0:
                        self._sample(job, branch, branch.row)
                self._maybe_done(job)
        for job, row in ends:
            if job.cancelled:
                continue
            if job.trie is None:
                self._fork(job, row)
                continue
            job.logits = self.ctx.logits(row).copy()
            if not job.trie.nodes:
                self._score(job, [])  # one-token candidates: the prompt's row answers all
        for job, rows in tries:
            if not job.cancelled and job.state is JobState.SCORING:
                self._score(job, rows)

    def _score(self, job: Job, rows: list[int]) -> None:
        """A scoring job's rows are in: each candidate's log-probability, token by token."""
        assert job.trie is not None
        self._answer(job, job.trie.scores(job.logits, [self.ctx.logits(r) for r in rows]))

    def _answer(self, job: Job, scores: list[list[float]]) -> None:
        """A scoring job ends with ``scores``, kept with its prompt for the next like it."""
        job.scores = scores
        for branch in job.branches:
            branch.done = True
        self._finish(job, keep=True)
        job.post(Scored(scores))
        job.post(Done(len(job.prompt), job.cached))

    def _fork(self, job: Job, row: int) -> None:
        """The prompt is read: start every branch off it, sampling its first token."""
        ctx = self.ctx
        job.state = JobState.GENERATING
        n_prompt = len(job.prompt)
        for branch in job.branches:
            ctx.seq_rm(branch.seq, 0, -1)
            ctx.seq_cp(job.seq, branch.seq, 0, n_prompt)
            branch.pos = n_prompt
            assert branch.params is not None
            branch.sampler = ctx.sampler(branch.params)
            branch.matcher = StopMatcher(branch.stops)
            branch.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._sample(job, branch, row)
        self._maybe_done(job)

    def _sample(self, job: Job, branch: Branch, row: int) -> None:
        ctx = self.ctx
        lps = log_softmax(ctx.logits(row)) if branch.logprobs else None
        if branch.params is not None and branch.params.plain_greedy:
            token = int(np.argmax(ctx.logits(row)))
        else:
            assert branch.sampler is not None
            token = ctx.sample(branch.sampler, row)
        if ctx.is_eog(token):
            self._end(job, branch, "stop", stopped=False)
            return
        branch.out_tokens += 1
        raw = ctx.piece(token)
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
                            "token": (piece := ctx.piece(t)).decode("utf-8", errors="replace"),
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
            job.post(Piece(job.branches.index(branch), text, entries))
        if stopped:
            self._end(job, branch, "stop", stopped=True)
        elif branch.out_tokens >= branch.max_tokens:
            self._end(job, branch, "length", stopped=False)
        else:
            branch.next_token = token

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
            job.post(Piece(index, "".join(branch.held), branch.held_entries))
            branch.held, branch.held_entries = [], []
        job.post(BranchEnded(index, tail, finish, branch.out_tokens, matched))

    def _maybe_done(self, job: Job) -> None:
        if job.state is JobState.GENERATING and all(b.done for b in job.branches):
            # Freed before the caller hears: what it sends next finds the room.
            self._finish(job, keep=True)
            job.post(Done(len(job.prompt), job.cached))

    def _finish(self, job: Job, *, keep: bool) -> None:
        """Free a job's sequences; its read prompt may stay as an idle prefix."""
        job.state = JobState.DONE
        self.live.remove(job)
        for branch in job.branches:
            if branch.sampler is not None:
                branch.sampler.close()
                branch.sampler = None
        self.cache.keep(job, keep=keep)
