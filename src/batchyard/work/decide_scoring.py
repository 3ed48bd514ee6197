"""Decide's per-outcome scoring, calibrated: what the model's scores say once its bias is out.

For a scoring engine, every outcome of every decision is scored in one call:
each decision's answer line as the opening of the reply to the one prompt
(the text once, every question), independent of the other decisions'
answers (``core.decisions.scoring_candidates``). The embedded engine reads
the prompt once and decodes all the candidates together. Calibration
(``batchyard.core.calibration``) adds, per call:

- the decision set's prior: the content-free estimate, made once per
  organisation and set by the first call that needs it (and paid by it),
  refined by the running mean of the raw probabilities of the texts of the
  set answered before (``batch`` mode). Each answer's probabilities are
  divided by that prior. The set lists its outcomes one way, so its prior
  holds the pull of the outcome listed first too, and the call reads the one
  prompt an uncalibrated call reads.

Every prompt the model reads is usage: ``input_tokens`` counts the call's
prompt and any content-free prompts, ``calibration_input_tokens`` says
how many of them calibration added, and ``cached_input_tokens`` how many the
engine read from its prompt cache (everything before the text: the decision
set's instructions, questions and answer format, once a text of the set has
been read), which settle at the route's cached-input price.

The state lives in the store (``batchyard.store.calibration``), so every
process of a deployment shares one running mean, but a call never waits on
it: ``Calibrations`` keeps each set's prior and running sums in memory (read
from the store once per set and process), folds each answered text in at
once, and writes what it added in the background, one write for whatever
accumulated since the last (``_persist``), reading back the store's sums,
which hold the other processes' texts too. The composition root builds the
one ``Calibrations`` of a deployment; ``Service.stop`` writes what is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from batchyard.core import calibration as cal
from batchyard.core import decisions as rules
from batchyard.core.catalog import RouteSpec
from batchyard.engines.protocol import Usage
from batchyard.store import calibration as store
from batchyard.work.dispatcher import Dispatcher

__all__ = [
    "CalibrationInfo",
    "Calibrations",
    "ScoredAnswers",
    "content_free_requests",
]

log = logging.getLogger(__name__)


def content_free_requests(req: rules.DecideRequest) -> list[rules.DecideRequest]:
    """The same questions about texts that say nothing: what the model answers by bias."""
    return [
        rules.DecideRequest(req.model, rules.DecideInput(text=t), req.decisions, None, "base")
        for t in cal.CONTENT_FREE_TEXTS
    ]


# The text of the prompt that stands for every text in a set's fingerprint.
_PLACEHOLDER = "\x00text\x00"


def fingerprint(model_id: str, req: rules.DecideRequest) -> str:
    """The name of ``req``'s decision set, under the prompt layout it is asked in.

    The layout (the messages around a placeholder text, and the candidates
    scored after them) is part of the name, so a change of the prompt starts
    new estimates instead of dividing new scores by priors made under the old
    one.
    """
    shape = rules.DecideRequest(
        req.model, rules.DecideInput(text=_PLACEHOLDER), req.decisions, None, "base"
    )
    layout = json.dumps(
        [rules.build_messages(shape, "lines"), rules.scoring_candidates(req.decisions)],
        ensure_ascii=False,
    )
    return cal.set_fingerprint(
        model_id,
        [(d.id, d.question, [(o.id, o.description) for o in d.outcomes]) for d in req.decisions],
        layout,
    )


@dataclass(frozen=True, slots=True)
class CalibrationInfo:
    """What calibrated this call, for the response."""

    mode: cal.CalibrationMode
    texts: int
    content_free_estimated: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            # One listing of the outcomes is scored; the field stays for callers that read it.
            "orders": 1,
            "texts": self.texts,
            "content_free_estimated": self.content_free_estimated,
        }


@dataclass(frozen=True, slots=True)
class ScoredAnswers:
    """Decide's answers, however they were reached: scored here, or read from a generation."""

    chosen: list[str]
    probabilities: Sequence[dict[str, float] | None]
    usage: Usage
    raw: list[dict[str, float]] | None = None
    calibration_input_tokens: int = 0
    calibration: CalibrationInfo | None = None


def _write_sums(
    taken: list[tuple[tuple[str, str], tuple[int, list[list[float]]]]], conn: Any
) -> list[store.SetState | None]:
    """Add each set's pending texts to the store, and read back its sums (everyone's)."""
    for (org_id, fp), (n, sums) in taken:
        store.add_texts(conn, org_id, fp, sums, texts=n)
    return [store.load_state(conn, org_id, fp) for (org_id, fp), _ in taken]


@dataclass
class _Raw:
    chosen: list[str]
    raw: list[list[float]]
    final: list[list[float]]
    # The prompt tokens the model read (and of them, from its cache); no output.
    read: Usage


@dataclass
class _Running:
    """One set's running sums as this process knows them: the store's, and its own not yet written.

    ``texts`` and ``sums`` already include the ``pending`` texts (and their
    ``pending_sums``), which ``Calibrations._persist`` has still to write.
    """

    texts: list[int]
    sums: list[list[float]]
    pending: int = 0
    pending_sums: list[list[float]] = field(default_factory=list)

    @classmethod
    def of(cls, state: store.SetState | None, shape: list[int]) -> _Running:
        if state is None:
            return cls([0] * len(shape), [[0.0] * n for n in shape])
        return cls(list(state.texts), [list(s) for s in state.prob_sums])

    def add(self, raw: list[list[float]]) -> None:
        if not self.pending:
            self.pending_sums = [[0.0] * len(r) for r in raw]
        self.pending += 1
        for k, probs in enumerate(raw):
            self.texts[k] += 1
            for j, p in enumerate(probs):
                self.sums[k][j] += p
                self.pending_sums[k][j] += p

    def take(self) -> tuple[int, list[list[float]]]:
        """The pending texts and their sums, to be written; none are pending after."""
        got = (self.pending, self.pending_sums)
        self.pending, self.pending_sums = 0, []
        return got

    def give_back(self, n: int, sums: list[list[float]]) -> None:
        """Texts a failed write took: pending again, before any added since."""
        if self.pending:
            sums = [
                [a + b for a, b in zip(x, y, strict=True)]
                for x, y in zip(sums, self.pending_sums, strict=True)
            ]
        self.pending, self.pending_sums = self.pending + n, sums

    def rebase(self, state: store.SetState) -> None:
        """The store's sums (everyone's written texts) plus what is still pending here."""
        self.texts = [n + self.pending for n in state.texts]
        self.sums = [list(s) for s in state.prob_sums]
        if self.pending:
            for k, probs in enumerate(self.pending_sums):
                for j, p in enumerate(probs):
                    self.sums[k][j] += p


@dataclass
class Calibrations:
    """One deployment's calibration: the store's shared state and this process's memory of it."""

    dispatcher: Dispatcher
    _priors: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    _running: dict[tuple[str, str], _Running] = field(default_factory=dict)
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    _writer: asyncio.Task[None] | None = None

    async def prior_known(self, org_id: str, model_id: str, req: rules.DecideRequest) -> bool:
        """Whether the set's content-free prior is stored (a call then needn't estimate it)."""
        key = (org_id, fingerprint(model_id, req))
        if key in self._priors:
            return True
        return await self._load(key, req) is not None

    async def _load(
        self, key: tuple[str, str], req: rules.DecideRequest
    ) -> list[list[float]] | None:
        """The stored prior, kept with the stored running sums: one read a set and process."""
        state = await self.dispatcher.db.read(lambda c: store.load_state(c, *key))
        if state is None:
            return None
        self._priors[key] = state.content_free
        if key not in self._running:
            self._running[key] = _Running.of(state, [len(d.outcomes) for d in req.decisions])
        return state.content_free

    async def _score(
        self,
        route: RouteSpec,
        upstream_model: str,
        req: rules.DecideRequest,
        prompt_tokens: int,
        prior_of: Callable[[int], list[float] | None],
    ) -> _Raw:
        """Every outcome of every decision in one scoring call, each decision on its own."""
        groups = rules.scoring_candidates(req.decisions)
        scores, usage = await self.dispatcher.score(
            route=route,
            model=upstream_model,
            messages=rules.build_messages(req, "lines"),
            candidates=[c for group in groups for c in group],
            input_tokens=prompt_tokens,
        )
        chosen: list[str] = []
        raws: list[list[float]] = []
        finals: list[list[float]] = []
        at = 0
        for k, decision in enumerate(req.decisions):
            raw = rules.softmax(scores[at : at + len(groups[k])])
            at += len(groups[k])
            prior = prior_of(k)
            final = cal.calibrate(raw, prior) if prior is not None else raw
            best = max(range(len(final)), key=final.__getitem__)
            chosen.append(decision.outcomes[best].id)
            raws.append(raw)
            finals.append(final)
        return _Raw(chosen, raws, finals, Usage(usage.input_tokens, 0, usage.cached_input_tokens))

    async def _content_free(
        self,
        key: tuple[str, str],
        route: RouteSpec,
        upstream_model: str,
        req: rules.DecideRequest,
        count: Callable[[list[dict[str, Any]]], int],
    ) -> tuple[list[list[float]], Usage]:
        """The set's content-free prior and the prompts read estimating it (none: known)."""
        known = self._priors.get(key)
        if known is not None:
            return known, Usage(0, 0)
        async with self._locks.setdefault(key, asyncio.Lock()):
            known = self._priors.get(key) or await self._load(key, req)
            if known is not None:
                return known, Usage(0, 0)
            # One after another: the set's prior is then the same however busy the engine is.
            got = [
                await self._score(
                    route,
                    upstream_model,
                    cf,
                    count(rules.build_messages(cf, "lines")),
                    lambda _k: None,
                )
                for cf in content_free_requests(req)
            ]
            spent = sum((g.read for g in got), Usage(0, 0))
            prior = [
                cal.mean_probabilities([g.raw[k] for g in got]) for k in range(len(req.decisions))
            ]
            await self.dispatcher.db.write(lambda c: store.save_content_free(c, *key, prior))
            # Another process may have stored its estimate first: use the stored one.
            return await self._load(key, req) or prior, spent

    async def score(
        self,
        *,
        org_id: str,
        model_id: str,
        route: RouteSpec,
        upstream_model: str,
        req: rules.DecideRequest,
        mode: cal.CalibrationMode,
        prompt_tokens: int,
        count: Callable[[list[dict[str, Any]]], int],
        count_text: Callable[[str], int],
        retain: bool,
    ) -> ScoredAnswers:
        """Answer every decision of ``req``; calibrated unless ``mode`` is ``none``.

        ``retain`` is false for organisations with zero data retention: their
        texts are calibrated but never added to the running mean.
        """
        ids = [d.outcome_ids for d in req.decisions]

        def by_id(vectors: list[list[float]]) -> list[dict[str, float]]:
            return [dict(zip(o, v, strict=True)) for o, v in zip(ids, vectors, strict=True)]

        if mode == "none":
            got = await self._score(route, upstream_model, req, prompt_tokens, lambda _k: None)
            answer = rules.answer_text(req.decisions, got.chosen, "lines")
            usage = got.read + Usage(0, count_text(answer))
            return ScoredAnswers(got.chosen, by_id(got.final), usage)
        key = (org_id, fingerprint(model_id, req))
        content_free, cf = await self._content_free(key, route, upstream_model, req, count)
        shape = [len(o) for o in ids]
        running = self._running.setdefault(key, _Running.of(None, shape))
        texts = list(running.texts) if mode == "batch" else [0] * len(shape)
        sums = [list(s) for s in running.sums] if mode == "batch" else [[0.0] * n for n in shape]

        def prior_of(k: int) -> list[float]:
            return cal.blend_prior(content_free[k], sums[k], texts[k])

        got = await self._score(route, upstream_model, req, prompt_tokens, prior_of)
        if mode == "batch" and retain:
            running.add(got.raw)
            self._persist_soon()
        answer = rules.answer_text(req.decisions, got.chosen, "lines")
        return ScoredAnswers(
            got.chosen,
            by_id(got.final),
            got.read + cf + Usage(0, count_text(answer)),
            by_id(got.raw),
            # What calibration added: the content-free prompts, on the call that made them.
            cf.input_tokens,
            CalibrationInfo(mode, min(texts), cf.input_tokens > 0),
        )

    # -- writing the running sums, off the call's path ------------------------------

    def _persist_soon(self) -> None:
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._persist())

    async def _persist(self) -> None:
        """Write every set's pending texts, one write a round, until none are pending.

        Texts answered while a write is in flight go in the next round, so a
        burst of calls costs a write or two, not one each. After each write
        the store's sums (which hold other processes' texts too) replace this
        process's, plus what is pending here. A failed write keeps the texts
        pending for the next round, started by the next answered text or by
        ``flush``.
        """
        while True:
            taken = [(key, r.take()) for key, r in self._running.items() if r.pending]
            if not taken:
                return

            try:
                states = await self.dispatcher.db.write(partial(_write_sums, taken))
            except Exception as exc:
                log.warning(
                    "could not write decide's running calibration sums (kept for later): %s", exc
                )
                for key, (n, sums) in taken:
                    self._running[key].give_back(n, sums)
                return
            for (key, _), state in zip(taken, states, strict=True):
                if state is not None:
                    self._running[key].rebase(state)

    async def flush(self) -> None:
        """Write whatever is pending now (at shutdown, and in tests)."""
        if self._writer is not None and not self._writer.done():
            await self._writer
        await self._persist()
