"""The embedded scheduler and its cache manager, step by step, over an in-memory context.

``tests/support/fake_llama.py`` keeps cells and sequence ids as llama.cpp does,
and its logits depend on exactly what a sequence holds: every answer below is
checked against the same prompt computed alone, so a prefix copied, shelved,
or put back wrongly shows as a wrong token or score.
"""

from __future__ import annotations

import pytest

from batchyard.engines.llama.cache import Tuning
from batchyard.engines.llama.context import Adapter
from batchyard.engines.llama.jobs import (
    Branch,
    BranchEnded,
    Cached,
    Done,
    Event,
    Failed,
    Job,
    JobState,
    Piece,
    Scored,
    Stopped,
)
from batchyard.engines.llama.scheduler import ADAPTER_TURN, Scheduler
from batchyard.engines.llama.scoring import Trie
from batchyard.engines.llama.steps import StepThread
from batchyard.engines.llama_sampling import SamplingParams
from batchyard.errors import UpstreamError
from tests.support.fake_llama import FakeContext, greedy, score, text_of

GREEDY = SamplingParams(temperature=0.0)


def make(
    *,
    slots: int = 4,
    n_cells: int = 256,
    n_seq: int = 16,
    prefill: int = 16,
    shelf_bytes: int = 1 << 20,
    **tuning: object,
) -> tuple[Scheduler, FakeContext]:
    ctx = FakeContext(n_cells=n_cells, n_seq=n_seq, capacity=prefill + 16 * slots)
    sched = Scheduler(
        ctx,
        slots=slots,
        prefill_tokens=prefill,
        shelf_bytes=shelf_bytes,
        tuning=Tuning(**tuning),  # type: ignore[arg-type]
    )
    return sched, ctx


class Run:
    """A job and the events it posted."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.events: list[Event] = []
        job.post = self.events.append

    def text(self, branch: int = 0) -> str:
        parts = [e.text for e in self.events if isinstance(e, Piece) and e.branch == branch]
        parts += [e.tail for e in self.events if isinstance(e, BranchEnded) and e.branch == branch]
        return "".join(parts)

    @property
    def done(self) -> Done:
        ends = [e for e in self.events if isinstance(e, Done)]
        assert len(ends) == 1, self.events
        return ends[0]

    @property
    def scores(self) -> list[float]:
        got = [e for e in self.events if isinstance(e, Scored)]
        assert len(got) == 1, self.events
        return [sum(s) for s in got[0].scores]


def chat(
    prompt: list[int],
    max_tokens: int = 4,
    *,
    n: int = 1,
    adapter: Adapter | None = None,
    whole: bool = True,
    params: SamplingParams = GREEDY,
    stops: list[str] | None = None,
) -> Run:
    branches = [Branch(params=params, max_tokens=max_tokens, stops=stops) for _ in range(n)]
    return Run(Job(list(prompt), branches, adapter=adapter, whole=whole))


def scoring(prompt: list[int], conts: list[list[int]], adapter: Adapter | None = None) -> Run:
    trie = Trie(conts)
    return Run(Job(list(prompt), [Branch() for _ in range(trie.tips)], trie=trie, adapter=adapter))


def run_all(sched: Scheduler, *runs: Run, limit: int = 500) -> None:
    for r in runs:
        sched.add(r.job)
    for _ in range(limit):
        if not sched.busy:
            return
        sched.step()
    raise AssertionError("the scheduler did not finish")


def prompt(seed: int, n: int) -> list[int]:
    return [1 + (seed * 7 + i * 3) % 26 for i in range(n)]


OPENING = prompt(1, 40)


# -- generation ----------------------------------------------------------------------


def test_a_lone_request_answers_what_its_prompt_gives_alone() -> None:
    sched, ctx = make()
    r = chat(prompt(2, 10), 6, whole=False)
    run_all(sched, r)
    assert r.text() == text_of(greedy(prompt(2, 10), 6))
    assert isinstance(r.events[0], Cached) and r.events[0].tokens == 0
    assert r.done == Done(10, 0)
    ends = [e for e in r.events if isinstance(e, BranchEnded)]
    assert [(e.finish, e.tokens) for e in ends] == [("length", 6)]
    assert r.job.state is JobState.DONE
    # Read in one step, then one token a step: the last sampled token is never decoded.
    assert [len(b) for b in ctx.decoded] == [10, 1, 1, 1, 1, 1]


def test_a_long_prompt_is_read_in_chunks_beside_running_streams() -> None:
    sched, ctx = make(prefill=16)
    short, long = chat(prompt(3, 5), 8), chat(prompt(4, 50), 2)
    sched.add(short.job)
    sched.step()
    run_all(sched, long)
    assert short.text() == text_of(greedy(prompt(3, 5), 8))
    assert long.text() == text_of(greedy(prompt(4, 50), 2))
    # No step reads more than the prefill budget of prompt, and while the long prompt
    # was read the short stream still got a token every step.
    reading = [b for b in ctx.decoded[1:] if any(not logits for *_, logits in b)]
    assert len(reading) == 4
    assert all(sum(1 for *_, logits in b if not logits) <= 16 for b in ctx.decoded)
    assert all(any(len(seqs) == 1 and logits for _, _, seqs, logits in b) for b in reading[:3])


def test_n_samples_fork_one_read_prompt() -> None:
    sched, ctx = make()
    sampled = SamplingParams(temperature=0.8, seed=1)
    r = chat(prompt(5, 12), 5, n=3, params=sampled)
    run_all(sched, r)
    assert ctx.tokens_decoded() == 12 + 3 * 4  # the prompt once, then each branch
    ends = [e for e in r.events if isinstance(e, BranchEnded)]
    assert sorted(e.branch for e in ends) == [0, 1, 2]
    assert ctx.samplers == 0  # every branch's sampler closed


def test_a_stop_string_ends_the_answer_and_is_not_shown() -> None:
    sched, _ = make()
    p = prompt(6, 8)
    full = text_of(greedy(p, 8))
    stop = full[3:5]
    r = chat(p, 8, stops=[stop], whole=False)
    run_all(sched, r)
    end = next(e for e in r.events if isinstance(e, BranchEnded))
    assert (end.finish, end.stop) == ("stop", stop)
    assert r.text() == full[: full.index(stop)]


def test_a_whole_answer_is_posted_once_when_its_branch_ends() -> None:
    sched, _ = make()
    r = chat(prompt(7, 8), 6, whole=True)
    run_all(sched, r)
    assert [type(e) for e in r.events] == [Piece, BranchEnded, Done]
    assert r.text() == text_of(greedy(prompt(7, 8), 6))


# -- prefixes: the cache and the shelf ---------------------------------------------------


def test_a_repeated_prompt_is_read_from_the_cache_and_its_idle_prefix_stays() -> None:
    sched, ctx = make()
    first = chat(prompt(8, 20), 3)
    run_all(sched, first)
    before = ctx.tokens_decoded()
    again = chat(prompt(8, 20), 3)
    run_all(sched, again)
    assert again.done == Done(20, 19)  # all but the last token, whose row is needed
    assert again.text() == first.text()
    assert ctx.tokens_decoded() - before == 1 + 2
    # Copied while there was room: the prompt is still idle for the next.
    assert [len(i.tokens) for i in sched.cache.idle] == [20]


def test_a_prompt_that_opens_like_an_idle_one_copies_the_opening() -> None:
    sched, _ = make()
    run_all(sched, chat(OPENING + prompt(9, 6), 2))
    r = chat(OPENING + prompt(10, 6), 4)
    run_all(sched, r)
    assert r.done.cached == len(OPENING)
    assert r.text() == text_of(greedy(OPENING + prompt(10, 6), 4))


def test_an_idle_prefix_is_taken_over_when_room_is_short() -> None:
    sched, _ = make(slots=1, n_cells=64, n_seq=3)
    run_all(sched, chat(prompt(11, 30), 2))
    (idle,) = sched.cache.idle
    r = chat(prompt(11, 30) + prompt(12, 5), 10)
    run_all(sched, r)
    assert r.done.cached == 30
    assert r.text() == text_of(greedy(prompt(11, 30) + prompt(12, 5), 10))
    assert sched.cache.idle[0].seq == idle.seq  # the same sequence, now the longer prompt


def test_what_no_one_shares_moves_to_the_shelf_and_comes_back() -> None:
    sched, ctx = make()
    poem, fact = prompt(13, 30), prompt(14, 12)
    run_all(sched, chat(poem, 2))
    run_all(sched, chat(fact, 2))
    # Admitting the fact moved the poem out of the cache: nothing about to run shares it.
    assert [len(s.tokens) for s in sched.cache.shelf] == [30]
    assert all(len(i.tokens) != 30 for i in sched.cache.idle)
    before = ctx.tokens_decoded()
    again = chat(poem, 3)
    run_all(sched, again)
    assert again.done.cached == 29  # put back from host memory, not read
    assert again.text() == text_of(greedy(poem, 3))
    assert ctx.tokens_decoded() - before == 1 + 2


def test_a_shelved_prompt_comes_back_only_when_it_saves_enough_reading() -> None:
    """Put back whole, a shelved prompt duplicates the opening the cache holds: it comes
    back only when the tokens it saves are at least one in 16 of those cells."""
    sched, _ = make()
    first = OPENING + prompt(24, 20)
    run_all(sched, chat(first, 1))
    run_all(sched, chat(OPENING + prompt(25, 6), 1))  # shelves the first's own words
    one_more = chat(first[:41] + prompt(26, 6), 1)
    run_all(sched, one_more)
    assert one_more.done.cached == len(OPENING)  # one token more: read, not put back
    # The cache now holds 41 of the first's tokens (the last prompt's): five more than
    # that are worth the copy.
    five_more = chat(first[:46] + prompt(27, 6), 1)
    run_all(sched, five_more)
    assert five_more.done.cached == 46
    assert five_more.text() == text_of(greedy(first[:46] + prompt(27, 6), 1))


def test_a_shelved_prompt_that_cannot_be_put_back_is_read_instead() -> None:
    sched, ctx = make()
    poem = prompt(15, 30)
    run_all(sched, chat(poem, 2))
    run_all(sched, chat(prompt(16, 12), 2))
    assert sched.cache.shelf
    ctx.refuse_state_set = True
    again = chat(poem, 3)
    run_all(sched, again)
    assert again.done.cached == 0
    assert again.text() == text_of(greedy(poem, 3))


def test_the_shelf_keeps_within_its_budget_and_can_be_turned_off() -> None:
    sched, _ = make(shelf_bytes=100 * 25)
    for seed in range(17, 21):
        run_all(sched, chat(prompt(seed, 20), 2))
    assert sched.cache.shelf_held <= 100 * 25
    assert len(sched.cache.shelf) == 1
    off, _ = make(shelf_bytes=0)
    for seed in range(17, 21):
        run_all(off, chat(prompt(seed, 20), 2))
    assert off.cache.shelf == []


def test_idle_prefixes_beyond_the_slots_go_to_the_shelf_least_recently_used_first() -> None:
    sched, _ = make(slots=2, shelve=False)
    for seed in (21, 22, 23):
        run_all(sched, chat(prompt(seed, 12), 1))
    assert [i.tokens for i in sched.cache.idle] == [prompt(22, 12), prompt(23, 12)]
    assert [s.tokens for s in sched.cache.shelf] == [prompt(21, 12)]


# -- room ------------------------------------------------------------------------------


def test_a_full_cache_queues_requests_instead_of_failing() -> None:
    sched, ctx = make(slots=4, n_cells=64)
    runs = [chat(prompt(30 + i, 20), 30) for i in range(3)]
    run_all(sched, *runs)
    for i, r in enumerate(runs):
        assert r.text() == text_of(greedy(prompt(30 + i, 20), 30))
    assert max(len({seq for *_, seqs, _ in b for seq in seqs}) for b in ctx.decoded) == 1


def test_a_request_that_can_never_fit_fails_with_a_stable_code() -> None:
    sched, _ = make(n_cells=32)
    r = chat(prompt(33, 20), 30)
    run_all(sched, r)
    (failed,) = r.events
    assert isinstance(failed, Failed) and isinstance(failed.error, UpstreamError)
    assert failed.error.code == "context_length_exceeded"


def test_a_refused_decode_is_sent_again_once_the_idle_prompts_leave() -> None:
    sched, ctx = make()
    run_all(sched, chat(OPENING + prompt(34, 8), 2))
    ctx.refuse = 1
    r = chat(OPENING + prompt(35, 8), 3)
    run_all(sched, r)
    assert r.done.cached == len(OPENING)
    assert r.text() == text_of(greedy(OPENING + prompt(35, 8), 3))
    # The idle opening made way (to the shelf); the decode went through the second time.
    assert ctx.refuse == 0
    assert [i.tokens for i in sched.cache.idle] == [OPENING + prompt(35, 8)]


def test_a_failed_decode_raises_and_failing_everything_starts_clean() -> None:
    sched, ctx = make()
    r = chat(prompt(36, 10), 3)
    sched.add(r.job)
    ctx.fail_next = True
    with pytest.raises(RuntimeError, match="llama_decode returned -1"):
        sched.step()
    sched.fail_all(UpstreamError("the embedded model failed"))
    assert isinstance(r.events[-1], Failed)
    assert ctx.used_cells == 0 and len(sched.cache.free) == ctx.n_seq and not sched.busy


# -- cancellation ----------------------------------------------------------------------


def test_a_cancelled_job_frees_its_cells_at_the_next_step() -> None:
    sched, ctx = make()
    r = chat(prompt(37, 10), 50, n=2)
    sched.add(r.job)
    for _ in range(3):
        sched.step()
    branch_seqs = [b.seq for b in r.job.branches]
    assert all(ctx.held(s) for s in branch_seqs)
    r.job.cancelled = True
    sched.step()
    assert r.job.state is JobState.DONE and not sched.live
    assert not any(ctx.held(s) for s in branch_seqs)
    assert ctx.samplers == 0
    # Its read prompt stays idle; every other id is free.
    assert len(sched.cache.free) + len(sched.cache.idle) == ctx.n_seq


def test_a_job_cancelled_while_waiting_never_runs() -> None:
    sched, ctx = make(slots=1)
    first, second = chat(prompt(38, 10), 5), chat(prompt(39, 10), 5)
    sched.add(first.job)
    sched.add(second.job)
    sched.step()
    second.job.cancelled = True
    run_all(sched)
    assert second.events == [] and second.job.state is JobState.DONE
    assert all(seq != second.job.seq for b in ctx.decoded for *_, seqs, _ in b for seq in seqs)


# -- stopping (the caller hung up) --------------------------------------------------------


def test_a_stopped_job_answers_what_it_produced_and_frees_its_sequences() -> None:
    sched, ctx = make()
    p = prompt(40, 10)
    r = chat(p, 50, n=2)
    sched.add(r.job)
    for _ in range(3):
        sched.step()
    branch_seqs = [b.seq for b in r.job.branches]
    r.job.stopping = True
    sched.step()
    # Ended at the step, before its decode: each branch as at its token limit, with
    # the tokens it had, and the job as any other, so it is billed for them.
    ends = [e for e in r.events if isinstance(e, BranchEnded)]
    assert sorted((e.branch, e.finish, e.tokens) for e in ends) == [
        (0, "length", 3),
        (1, "length", 3),
    ]
    assert r.text(0) == r.text(1) == text_of(greedy(p, 3))
    assert r.done == Done(10, 0)
    assert not any(isinstance(e, Stopped) for e in r.events)
    assert r.job.state is JobState.DONE and not sched.busy
    assert not any(ctx.held(s) for s in branch_seqs)
    assert ctx.samplers == 0
    # Freed the normal way: its read prompt stays idle, every other id is free.
    assert [len(i.tokens) for i in sched.cache.idle] == [10]
    assert len(sched.cache.free) + len(sched.cache.idle) == ctx.n_seq


def test_a_job_stopped_before_it_produced_anything_ends_stopped() -> None:
    sched, ctx = make(slots=1, prefill=16)
    reading, waiting = chat(prompt(41, 50), 5), chat(prompt(42, 10), 5)
    sched.add(reading.job)
    sched.add(waiting.job)
    sched.step()  # the first chunk of the long prompt; the other waits for the slot
    assert (reading.job.state, waiting.job.state) == (JobState.READING, JobState.WAITING)
    reading.job.stopping = waiting.job.stopping = True
    sched.step()
    assert reading.events == [Stopped()] and waiting.events == [Stopped()]
    assert (reading.job.state, waiting.job.state) == (JobState.DONE, JobState.DONE)
    assert not sched.busy and ctx.used_cells <= 16  # at most the read chunk, kept idle
    assert all(seq != waiting.job.seq for b in ctx.decoded for *_, seqs, _ in b for seq in seqs)


def test_stopping_a_job_that_ended_changes_nothing() -> None:
    sched, _ = make()
    r = chat(prompt(43, 8), 3)
    run_all(sched, r)
    before = list(r.events)
    r.job.stopping = True
    sched.step()
    assert r.events == before and r.job.state is JobState.DONE


# -- scoring ----------------------------------------------------------------------------


CANDIDATES = [[5, 6, 7], [5, 6, 8], [5, 9], [10]]


def test_candidates_are_scored_beside_the_prompts_last_chunk() -> None:
    sched, ctx = make(score_with_prompt=True)
    p = prompt(40, 12)
    r = scoring(p, CANDIDATES)
    run_all(sched, r)
    assert r.scores == pytest.approx([score(p, c) for c in CANDIDATES], abs=1e-5)
    # One decode: the prompt and the trie's decoded nodes (5; 5 6) together.
    assert [len(b) for b in ctx.decoded] == [12 + 2]
    assert r.done == Done(12, 0)


def test_a_long_prompts_trie_goes_beside_its_last_chunk_only() -> None:
    sched, ctx = make(prefill=16, score_with_prompt=True)
    p = prompt(44, 40)
    r = scoring(p, CANDIDATES)
    run_all(sched, r)
    assert r.scores == pytest.approx([score(p, c) for c in CANDIDATES], abs=1e-5)
    assert [len(b) for b in ctx.decoded] == [16, 16, 8 + 2]


def test_a_trie_the_step_has_no_room_for_goes_in_the_next() -> None:
    conts = [[1, 2, 3, 4], [1, 2, 3, 5], [6, 7, 8], [6, 7, 9]]  # nodes: 1, 1 2, 1 2 3, 6, 6 7
    p = prompt(45, 30)
    sched, ctx = make(prefill=16, slots=1, score_with_prompt=True)
    r = scoring(p, conts)
    run_all(sched, r)
    assert r.scores == pytest.approx([score(p, c) for c in conts], abs=1e-5)
    assert [len(b) for b in ctx.decoded] == [16, 14 + 5]
    # A step of 16 tokens: the last chunk's 14 leave no room for the five nodes.
    sched, ctx = make(prefill=16, slots=1)
    ctx.capacity = 16
    r = scoring(p, conts)
    run_all(sched, r)
    assert r.scores == pytest.approx([score(p, c) for c in conts], abs=1e-5)
    assert [len(b) for b in ctx.decoded] == [16, 14, 5]


def test_candidates_can_be_scored_in_a_step_of_their_own() -> None:
    sched, ctx = make(score_with_prompt=False)
    p = prompt(41, 12)
    r = scoring(p, CANDIDATES)
    run_all(sched, r)
    assert r.scores == pytest.approx([score(p, c) for c in CANDIDATES], abs=1e-5)
    assert [len(b) for b in ctx.decoded] == [12, 2]


def test_a_scoring_prompt_the_cache_holds_whole_costs_no_decode() -> None:
    sched, ctx = make()
    p = prompt(42, 12)
    run_all(sched, scoring(p, [[3], [4]]))
    before = len(ctx.decoded)
    again = scoring(p, [[3], [4], [9]])
    run_all(sched, again)
    assert len(ctx.decoded) == before
    assert again.done == Done(12, 12)
    assert again.scores == pytest.approx([score(p, [t]) for t in (3, 4, 9)], abs=1e-5)


def test_a_text_asked_again_gets_its_kept_answer_with_no_decode() -> None:
    sched, ctx = make()
    p = prompt(46, 12)
    first = scoring(p, CANDIDATES)
    run_all(sched, first)
    before = len(ctx.decoded)
    # The same candidates: the answer kept with the prompt, to the last digit.
    again = scoring(p, CANDIDATES)
    run_all(sched, again)
    assert len(ctx.decoded) == before
    assert again.done == Done(12, 12)
    assert again.scores == first.scores
    # Other candidates: the kept row, and their own trie in a step of its own.
    other = scoring(p, [[5, 6, 9], [10, 2]])
    run_all(sched, other)
    assert [len(b) for b in ctx.decoded[before:]] == [3]
    assert other.scores == pytest.approx([score(p, c) for c in ([5, 6, 9], [10, 2])], abs=1e-5)
    assert other.done == Done(12, 12)
    assert not sched.busy and ctx.samplers == 0


def test_a_decision_sets_later_texts_copy_its_opening_and_shelve_their_own_words() -> None:
    sched, _ = make()
    texts = [OPENING + prompt(43 + i, 8) for i in range(3)]
    runs = [scoring(t, CANDIDATES) for t in texts]
    for r in runs:
        run_all(sched, r)
    for t, r in zip(texts, runs, strict=True):
        assert r.scores == pytest.approx([score(t, c) for c in CANDIDATES], abs=1e-5)
    assert runs[1].done.cached == runs[2].done.cached == len(OPENING)
    # What the next text did not share left the cache for the shelf, with its last row:
    # asked again, nothing of the first text is read.
    assert [len(i.tokens) for i in sched.cache.idle] == [len(OPENING), len(texts[2])]
    again = scoring(texts[0], CANDIDATES)
    run_all(sched, again)
    assert again.done.cached == len(texts[0])
    assert again.scores == runs[0].scores


def test_requests_that_start_together_each_read_their_prompt() -> None:
    sched, ctx = make(prefill=64)
    runs = [scoring(OPENING + prompt(50 + i, 6), CANDIDATES) for i in range(3)]
    run_all(sched, *runs)
    for i, r in enumerate(runs):
        want = [score(OPENING + prompt(50 + i, 6), c) for c in CANDIDATES]
        assert r.scores == pytest.approx(want, abs=1e-5)
    # Admitted in one step, none could copy another's opening yet; the next text can.
    assert [r.done.cached for r in runs] == [0, 0, 0]
    later = scoring(OPENING + prompt(53, 6), CANDIDATES)
    run_all(sched, later)
    assert later.done.cached == len(OPENING)
    assert ctx.tokens_decoded() == 3 * (len(OPENING) + 6 + 2) + 6 + 2


# -- adapters ---------------------------------------------------------------------------


def test_adapters_take_turns_and_each_step_serves_one() -> None:
    sched, ctx = make()
    tuned = Adapter("tuned", handle=None)
    base_run, tuned_run = chat(prompt(60, 6), 12), chat(prompt(60, 6), 12, adapter=tuned)
    run_all(sched, base_run, tuned_run)
    assert base_run.text() == text_of(greedy(prompt(60, 6), 12))
    assert tuned_run.text() == text_of(greedy(prompt(60, 6), 12, "tuned"))
    # Each step decodes one adapter's jobs; turns of ADAPTER_TURN steps while both run.
    names = ctx.adapters
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(names)]
    assert max(runs[:-1]) == ADAPTER_TURN
    assert ctx.switches == len(runs) - 1  # the base is set to begin with
    # A prefix read under one adapter is no other's: the tuned job read its own prompt.
    assert tuned_run.done.cached == 0


def test_releasing_an_adapter_fails_its_jobs_and_drops_its_prefixes() -> None:
    sched, _ = make()
    tuned = Adapter("tuned", handle=None)
    run_all(sched, chat(prompt(61, 12), 1, adapter=tuned))
    assert any(i.adapter is tuned for i in sched.cache.idle)
    live, waiting = chat(prompt(62, 6), 20, adapter=tuned), chat(prompt(63, 6), 2)
    sched.add(live.job)
    sched.step()
    sched.add(waiting.job)
    sched.release(tuned)
    assert isinstance(live.events[-1], Failed)
    assert getattr(live.events[-1].error, "code", None) == "model_unloaded"
    assert not any(i.adapter is tuned for i in sched.cache.idle)
    run_all(sched)
    assert waiting.text() == text_of(greedy(prompt(63, 6), 2))


# -- the trie ---------------------------------------------------------------------------


def test_the_trie_decodes_only_nodes_some_candidate_goes_past() -> None:
    trie = Trie([[5, 6, 7], [5, 6, 8], [5, 9], [10]])
    assert [(t, d) for t, d, _ in trie.nodes] == [(5, 0), (6, 1)]
    assert trie.tips == 1 and [tips for *_, tips in trie.nodes] == [[0], [0]]
    assert trie.reads == [[-1, 0, 1], [-1, 0, 1], [-1, 0], [-1]]
    assert Trie([[3], [4]]).nodes == []


def test_an_idle_prefix_belongs_to_its_adapter() -> None:
    sched, _ = make()
    tuned = Adapter("tuned", handle=None)
    run_all(sched, chat(prompt(90, 12), 1))
    r = chat(prompt(90, 12), 1, adapter=tuned)
    run_all(sched, r)
    assert r.done.cached == 0
    assert [i.adapter for i in sched.cache.idle] == [tuned]
    assert [s.adapter for s in sched.cache.shelf] == [None]


# -- the step thread --------------------------------------------------------------------


async def test_the_step_thread_streams_a_job_and_runs_work_between_steps() -> None:
    sched, ctx = make()
    steps = StepThread(sched)
    try:
        r = chat(prompt(95, 8), 5, whole=False)
        events = [e async for e in steps.run(r.job)]
        assert isinstance(events[-1], Done)
        text = "".join(e.text for e in events if isinstance(e, Piece))
        assert text == text_of(greedy(prompt(95, 8), 5))
        assert await steps.call(lambda: len(sched.cache.idle)) == 1
        assert await steps.shelf_state() == (0, 0)
    finally:
        steps.close()
    assert ctx.closed


async def test_the_step_thread_stops_a_job_at_its_next_step() -> None:
    sched, _ = make()
    steps = StepThread(sched)
    try:
        r = chat(prompt(98, 8), 200, whole=False)
        events: list[Event] = []
        async for event in steps.run(r.job):
            events.append(event)
            if isinstance(event, Piece) and event.text and not r.job.stopping:
                steps.stop(r.job)
        assert isinstance(events[-1], Done)
        end = next(e for e in events if isinstance(e, BranchEnded))
        assert end.finish == "length" and 0 < end.tokens < 200
        text = "".join(e.text for e in events if isinstance(e, Piece)) + end.tail
        assert text == text_of(greedy(prompt(98, 8), end.tokens))
        assert not r.job.cancelled and not sched.live
    finally:
        steps.close()


async def test_leaving_a_stream_early_cancels_its_job() -> None:
    sched, _ = make()
    steps = StepThread(sched)
    try:
        r = chat(prompt(96, 8), 200, whole=False)
        stream = steps.run(r.job)
        async for event in stream:
            if isinstance(event, Piece):
                break
        await stream.aclose()  # type: ignore[attr-defined]
        assert r.job.cancelled
        await steps.call(lambda: None)  # calls run before a step: the step after this one
        await steps.call(lambda: None)  # reaped it
        assert r.job.state is JobState.DONE and not sched.live
    finally:
        steps.close()
    with pytest.raises(UpstreamError):
        steps.submit(chat(prompt(97, 4), 2).job)
