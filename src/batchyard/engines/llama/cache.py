"""What sits in the KV cache and on the host shelf, and which prompt a new job starts from.

The cache manager owns the context's sequence ids and cells. A job's read
prompt stays behind when the job ends as an *idle prefix* (at most one a
slot), for the next request that starts like it. Idle cells are not free:
every step attends over every cell up to the highest one in use. So when a
job is admitted, what no one about to run shares of the idle prompts moves to
the *shelf*, host memory (``llama_state_seq_get_data``), and comes back by
copy, not by reading it again, when a request starts like it, as
``llama-server``'s host prompt cache (``--cache-ram``) does for its slots.

``lookup`` is the one prefix index: over the idle prefixes, the prompts live
jobs have read so far, and the shelf. ``place`` gives an admitted job its
sequences, copying (``llama_memory_seq_cp``) or restoring its opening, and
makes room by moving idle prefixes to the shelf least recently used first:
one eviction order, for the cache and for the shelf. A request never fails
for room while something idle can make way; it waits for running jobs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchyard.engines.llama.context import Adapter, Context
from batchyard.engines.llama.jobs import Job

__all__ = [
    "SHELF_BYTES",
    "Answer",
    "CacheManager",
    "Idle",
    "Match",
    "Shelved",
    "Tuning",
    "common",
]

#: Host memory the shelf may hold by default. The embedded model's cells are about
#: 23 KB a token, so this keeps some 11,000 tokens.
SHELF_BYTES = 256 << 20

#: The fewest tokens a prompt must hold to go on the shelf.
SHELF_MIN = 8


@dataclass
class Tuning:
    """The scheduler's mechanisms, each switchable so a bench can measure it on and off."""

    #: Move what no one about to run shares of the idle prompts to the shelf on admission.
    shelve: bool = True
    #: A shelved prompt is put back when the tokens it saves reading are at least one
    #: in ``shelf_dup`` of the cached cells it duplicates (1: whenever it saves any).
    shelf_dup: int = 16
    #: Decode a scoring job's trie in the step of its prompt's last chunk, not the next,
    #: so a text costs one step, as ``llama-server``'s ``n_predict`` 1 does. A row's
    #: attention rounds by the shape of its micro-batch
    #: (docs/explanation/batch-invariance.md), so the trie's rows read beside the chunk
    #: differ in the last bits from the rows it would get after a cached prompt; a text
    #: asked again still scores as before, since its scores are kept with its prompt
    #: (``Idle.answer``) and handed back with no decode. Off: its paired measurement
    #: does not exclude 1.0, and a version's scores must be llama-cpp-python's own
    #: for the same GGUF (tests/integration/api/test_model_versions.py), which the
    #: trie's rows read beside the chunk are not.
    score_with_prompt: bool = False


#: A scoring job's candidates (``Trie.key``) and the scores they got (``Scored.scores``).
Answer = tuple[tuple[tuple[int, ...], ...], list[list[float]]]


def common(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` open with alike."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(eq=False)
class Idle:
    """A prompt left in the cache by a finished job, kept for the next that starts like it."""

    seq: int
    tokens: list[int]
    used: int
    #: The last prompt token's logits row, kept with a whole scoring prompt.
    logits: Any = None
    #: The adapter the prefix was read under: its cache is no other adapter's.
    adapter: Adapter | None = None
    #: With the last row, the candidates scored off the whole prompt and their scores:
    #: the same candidates asked again get the same answer, with no decode.
    answer: Answer | None = None


@dataclass(eq=False)
class Shelved:
    """A prompt's cells copied to host memory, put back into a free sequence when asked."""

    tokens: list[int]
    data: Any
    used: int
    adapter: Adapter | None = None
    logits: Any = None
    #: Host bytes it holds: its cells, and its logits row if any.
    size: int = 0
    answer: Answer | None = None


Source = Idle | Shelved | Job


@dataclass
class Match:
    """Where a new job's opening can come from (``lookup``)."""

    #: The source it comes from and how many tokens (the shelf's when it offers more).
    src: Source | None
    n: int
    #: What the cache itself holds of it: read from here if the shelved one cannot come back.
    cached: Idle | Job | None
    cached_n: int
    #: The whole prompt is held with its last row: a scoring job needs no decode at all.
    logits: Any = None
    #: ...and with its candidates' scores, when they are this job's candidates.
    scores: list[list[float]] | None = None


class CacheManager:
    """The sequence ids, cells, idle prefixes and shelf of one context."""

    def __init__(self, ctx: Context, *, slots: int, shelf_bytes: int, tuning: Tuning) -> None:
        self.ctx = ctx
        self.slots = slots
        self.shelf_bytes = max(0, shelf_bytes)
        self.tuning = tuning
        self.free = list(range(ctx.n_seq - 1, -1, -1))
        #: Cells reserved by live jobs and held by idle prefixes.
        self.used = 0
        self.idle: list[Idle] = []
        #: Prompts moved out of the cache to host memory.
        self.shelf: list[Shelved] = []
        #: Steps so far: the clock of the one eviction order (least recently used first).
        self.tick = 0

    @property
    def n_cells(self) -> int:
        return self.ctx.n_cells

    @property
    def shelf_held(self) -> int:
        """Host bytes the shelf holds now."""
        return sum(s.size for s in self.shelf)

    # -- the prefix index --------------------------------------------------------------

    def lookup(self, job: Job, live: list[Job]) -> Match:
        """The idle, live or shelved prompt ``job``'s opening is best taken from.

        A shelved prompt is put back whole, so the opening it shares with what the
        cache holds is then held twice (until the next admission shelves the copy),
        and putting it back to save a token or two churns the shelf; it is chosen
        when the tokens it saves reading are at least one in ``Tuning.shelf_dup`` of
        the cells it duplicates.
        """
        prompt = job.prompt
        best: Idle | Job | None = None
        most = 0
        for idle in self.idle:
            if idle.adapter is job.adapter:
                n = common(idle.tokens, prompt)
                if n > most:
                    best, most = idle, n
        for other in live:
            if other.adapter is job.adapter:
                n = min(common(other.prompt, prompt), other.pos)
                if n > most:
                    best, most = other, n
        shelved: Shelved | None = None
        need = most + max(1, -(-most // max(1, self.tuning.shelf_dup))) - 1
        for s in self.shelf:
            if s.adapter is job.adapter:
                n = common(s.tokens, prompt)
                if n > need:
                    shelved, need = s, n
        src: Source | None = shelved or best
        n = need if shelved is not None else most
        logits = scores = None
        if (
            isinstance(src, Idle | Shelved)
            and job.trie is not None
            and n == len(prompt) == len(src.tokens)
        ):
            logits = src.logits
            if logits is not None and src.answer is not None and src.answer[0] == job.trie.key:
                scores = src.answer[1]
        if logits is None:
            n = min(n, len(prompt) - 1)  # the last token is read for its logits
        return Match(src, n, best, min(most, len(prompt) - 1), logits, scores)

    # -- admission ---------------------------------------------------------------------

    def place(self, job: Job, match: Match) -> Match | None:
        """Give ``job`` its sequences holding the opening ``match`` offers (None: no room yet).

        An idle prefix is copied while there is room, so the job it came from (a
        chat's next turn, the next text of a decision set) still finds it; it is
        taken over only when room is short. Idle prefixes leave for the shelf, least
        recently used first, until the job fits. Returns what it was given.
        """
        ctx = self.ctx
        src, n = match.src, match.n
        room = len(self.free) >= len(job.branches) + 1 and self.used + job.reserve <= ctx.n_cells
        take = isinstance(src, Idle) and n > 0 and not room
        ids = len(job.branches) + (0 if take else 1)
        cells = job.reserve - (len(src.tokens) if take and isinstance(src, Idle) else 0)
        if isinstance(src, Shelved):
            cells += len(src.tokens) - n  # put back whole, then cut to ``n``
        for idle in sorted(self.idle, key=lambda i: i.used):
            if len(self.free) >= ids and self.used + cells <= ctx.n_cells:
                break
            if idle is not src or not take:
                self.put_away(idle)
                if idle is src:
                    match = Match(None, 0, None, 0)
                    src, n = None, 0
        if len(self.free) < ids or self.used + cells > ctx.n_cells:
            return None
        if take and isinstance(src, Idle):
            self.idle.remove(src)
            self.used -= len(src.tokens)
            job.seq = src.seq
            ctx.seq_rm(job.seq, n, -1)
        else:
            job.seq = self.free.pop()
            ctx.seq_rm(job.seq, 0, -1)
            if isinstance(src, Shelved):
                if not self.restore(src, job.seq, n):
                    # Read it instead, from what the cache itself holds of it.
                    kept, kept_n = match.cached, match.cached_n
                    match = Match(None, 0, None, 0)
                    if kept_n and (kept in self.idle or (isinstance(kept, Job) and kept.live)):
                        assert kept is not None
                        match = Match(kept, kept_n, None, 0)
                        ctx.seq_cp(kept.seq, job.seq, 0, kept_n)
            elif src is not None and n > 0:
                ctx.seq_cp(src.seq, job.seq, 0, n)
            else:
                match = Match(None, 0, None, 0)
        if match.src is None or match.n == 0:
            match.logits = match.scores = None
        for branch in job.branches:
            branch.seq = self.free.pop()
            if job.trie is not None:
                # A tip sees the prompt: the copied prefix now, the rest as it is read.
                ctx.seq_rm(branch.seq, 0, -1)
                if match.n:
                    ctx.seq_cp(job.seq, branch.seq, 0, match.n)
        self.used += job.reserve
        if isinstance(match.src, Idle | Shelved):
            match.src.used = self.tick
        return match

    # -- a job ends --------------------------------------------------------------------

    def keep(self, job: Job, *, keep: bool) -> None:
        """Free ``job``'s branches and its reservation; its read prompt stays as an idle prefix.

        As many idle prefixes as slots are kept; the least recently used go to the
        shelf first.
        """
        ctx = self.ctx
        self.used -= job.reserve
        for branch in job.branches:
            if branch.seq >= 0:
                self.release_seq(branch.seq)
                branch.seq = -1
        n = min(job.pos, len(job.prompt))
        kept = job.prompt[:n]
        if keep and any(i.tokens == kept and i.adapter is job.adapter for i in self.idle):
            keep = False  # the cache already holds this prompt (it was copied from it)
        if keep and n > 0:
            ctx.seq_rm(job.seq, n, -1)
            logits = job.logits if n == len(job.prompt) else None
            answer = None
            if logits is not None and job.trie is not None and job.scores is not None:
                answer = (job.trie.key, job.scores)
            self.idle.append(Idle(job.seq, kept, self.tick, logits, job.adapter, answer))
            self.used += n
            while len(self.idle) > self.slots:
                self.put_away(min(self.idle, key=lambda i: i.used))
        else:
            self.release_seq(job.seq)
        job.seq = -1

    def release_seq(self, seq: int) -> None:
        """Free a sequence's cells and its id."""
        self.ctx.seq_rm(seq, 0, -1)
        self.free.append(seq)

    # -- the shelf ---------------------------------------------------------------------

    def shelve(self, job: Job, live: list[Job]) -> None:
        """Before ``job`` is placed, move out of the cache what no one about to run shares.

        An idle prompt's cells that neither ``job`` nor a live job shares are
        copied to the shelf and freed; the part they share stays.
        """
        for idle in list(self.idle):
            share = common(idle.tokens, job.prompt) if idle.adapter is job.adapter else 0
            for other in live:
                if other.adapter is idle.adapter:
                    share = max(share, min(common(idle.tokens, other.prompt), other.pos))
            if share >= len(idle.tokens):
                continue
            self.save(idle)
            held = any(
                other is not idle
                and other.adapter is idle.adapter
                and common(other.tokens, idle.tokens) >= share
                for other in self.idle
            )
            if share == 0 or held:
                self.evict(idle)
            else:
                self.ctx.seq_rm(idle.seq, share, -1)
                self.used -= len(idle.tokens) - share
                idle.tokens, idle.logits, idle.answer = idle.tokens[:share], None, None

    def save(self, idle: Idle) -> None:
        """Copy an idle prompt's cells to the shelf, unless it holds them already."""
        n = len(idle.tokens)
        if n < SHELF_MIN or not self.shelf_bytes:
            return
        same = [s for s in self.shelf if s.adapter is idle.adapter]
        for shelved in same:
            if len(shelved.tokens) >= n and shelved.tokens[:n] == idle.tokens:
                shelved.used = max(shelved.used, idle.used)
                return
        size = self.ctx.state_size(idle.seq)
        if size > self.shelf_bytes:
            return
        data = self.ctx.state_get(idle.seq, size)
        if data is None:
            return
        for shelved in same:  # a shorter opening of it is now redundant
            if shelved.tokens == idle.tokens[: len(shelved.tokens)]:
                self.shelf.remove(shelved)
        if idle.logits is not None:
            size += int(idle.logits.nbytes)
        self.shelf.append(
            Shelved(idle.tokens, data, idle.used, idle.adapter, idle.logits, size, idle.answer)
        )
        while self.shelf_held > self.shelf_bytes:
            self.shelf.remove(min(self.shelf, key=lambda s: s.used))

    def restore(self, shelved: Shelved, seq: int, n: int) -> bool:
        """Put the first ``n`` tokens of a shelved prompt back into ``seq`` (False: no room)."""
        if not self.ctx.state_set(seq, shelved.data):
            return False  # no run of free cells long enough: the prompt is read instead
        self.ctx.seq_rm(seq, n, -1)
        return True

    def put_away(self, idle: Idle) -> None:
        """An idle prompt leaves the cache for the shelf, its cells freed."""
        self.save(idle)
        self.evict(idle)

    def put_all_away(self) -> bool:
        """Every idle prompt leaves the cache for the shelf; False when there was none."""
        if not self.idle:
            return False
        while self.idle:
            self.put_away(self.idle[0])
        return True

    def evict(self, idle: Idle) -> None:
        self.idle.remove(idle)
        self.release_seq(idle.seq)
        self.used -= len(idle.tokens)

    def forget(self, adapter: Adapter) -> None:
        """Drop an adapter's idle prefixes and shelved prompts (it is being freed)."""
        for idle in [i for i in self.idle if i.adapter is adapter]:
            self.evict(idle)
        self.shelf = [s for s in self.shelf if s.adapter is not adapter]

    def reset(self) -> None:
        """Start clean after a native failure: every cell and id free, nothing idle."""
        self.ctx.clear()
        self.idle.clear()
        self.free = list(range(self.ctx.n_seq - 1, -1, -1))
        self.used = 0
