"""A job (one request: a prompt and its branches), its state, and the events it posts.

A job's state moves one way, on the step thread::

    WAITING -> READING -> GENERATING -> DONE
                    \\         \\-> SCORING ----/
                     \\------------------------/

``WAITING``: queued, holding no sequence. ``READING``: admitted, its prompt
goes in, a chunk a step. ``GENERATING``: its branches (the ``n``
samples) were forked off the read prompt and sample a token a step.
``SCORING``: a scoring job whose candidates' trie is still to be decoded.
``DONE``: its sequences are freed and its last event posted. The asyncio side
only ever sets ``cancelled`` or ``stopping``; the step thread reaps the job at
its next step.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchyard.engines.llama.context import Adapter, Sampler
from batchyard.engines.llama.scoring import Trie
from batchyard.engines.llama_sampling import SamplingParams, StopMatcher

__all__ = [
    "Branch",
    "BranchEnded",
    "Cached",
    "Done",
    "Event",
    "Failed",
    "Job",
    "JobState",
    "Piece",
    "Scored",
    "Stopped",
]


@dataclass(frozen=True, slots=True)
class Cached:
    """How many of the prompt's tokens the cache gave (a stream tells it with its first piece)."""

    tokens: int


@dataclass(frozen=True, slots=True)
class Piece:
    """Text (and logprob entries) a branch produced: a token's, or a whole answer's."""

    branch: int
    text: str
    entries: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class BranchEnded:
    """A branch ended: its held-back tail, why, how many tokens, and the stop string hit."""

    branch: int
    tail: str
    finish: str
    tokens: int
    stop: str | None


@dataclass(frozen=True, slots=True)
class Scored:
    """Each candidate's log-probability, token by token."""

    scores: list[list[float]]


@dataclass(frozen=True, slots=True)
class Done:
    """The job ended: its prompt's tokens and how many of them came from the cache."""

    prompt_tokens: int
    cached: int


@dataclass(frozen=True, slots=True)
class Failed:
    """The job failed (its model unloaded, a native failure)."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Stopped:
    """The job was stopped (``Job.stopping``) before it produced anything: no answer."""


Event = Cached | Piece | BranchEnded | Scored | Done | Failed | Stopped


class JobState(enum.Enum):
    WAITING = "waiting"
    READING = "reading"
    GENERATING = "generating"
    SCORING = "scoring"
    DONE = "done"


@dataclass(eq=False)
class Branch:
    """One sequence forked off a job's prompt: a sample being generated, or a scoring tip.

    A scoring job's branches only hold the sequences its candidate trie is
    decoded in; they sample nothing.
    """

    # A generation: how it samples and when it ends.
    params: SamplingParams | None = None
    max_tokens: int = 0
    stops: list[str] | None = None
    logprobs: bool = False
    top: int = 0
    # Run state, owned by the step thread.
    seq: int = -1
    pos: int = 0
    #: The token sampled last, decoded in the next step (None: none due).
    next_token: int | None = None
    sampler: Sampler | None = None
    out_tokens: int = 0
    done: bool = False
    finish: str = "stop"
    matcher: StopMatcher | None = None
    decoder: Any = None
    #: Its row in the step being decoded (-1: none).
    row: int = -1
    #: A whole job's text and logprob entries so far, held here until the branch ends
    #: (``Job.whole``), instead of one ``Piece`` a token.
    held: list[str] = field(default_factory=list)
    held_entries: list[dict[str, Any]] = field(default_factory=list)


def _ignore(_event: Event) -> None:
    pass


@dataclass(eq=False)
class Job:
    """One request's prompt and branches, and where its events go."""

    prompt: list[int]
    branches: list[Branch]
    post: Callable[[Event], None] = _ignore
    adapter: Adapter | None = None
    #: Candidates to score off the prompt (then ``branches`` are the trie's tips).
    trie: Trie | None = None
    #: The caller wants each branch's answer whole, not token by token (a completion
    #: that is not streamed): its text is posted once, when the branch ends, so the
    #: event loop is not woken for every token.
    whole: bool = False
    #: Set by the asyncio side; the step thread ends the job at its next step.
    cancelled: bool = False
    #: Set by the asyncio side (its caller hung up): the step thread ends the job at its
    #: next step with what it produced (``Scheduler._reap``).
    stopping: bool = False
    # Run state, owned by the step thread.
    state: JobState = JobState.WAITING
    seq: int = -1
    #: Prompt tokens in the cache so far, and how many of them came from it.
    pos: int = 0
    cached: int = 0
    #: A scoring job's prompt row (its last token's logits), once read.
    logits: Any = None
    #: A scoring job's answer (``Scored.scores``), kept with its prompt when it ends.
    scores: list[list[float]] | None = None

    @property
    def scoring(self) -> bool:
        return self.trie is not None

    @property
    def live(self) -> bool:
        return self.state not in (JobState.WAITING, JobState.DONE)

    @property
    def reserve(self) -> int:
        """Cache cells this job may fill: its prompt and every branch at its longest."""
        if self.trie is not None:
            return len(self.prompt) + len(self.trie.nodes)
        return len(self.prompt) + sum(b.max_tokens for b in self.branches)

    def seqs(self) -> list[int]:
        """The sequences the prompt's tokens go into: a scoring job's tips share its cells."""
        if self.trie is None:
            return [self.seq]
        return [self.seq, *(b.seq for b in self.branches)]
