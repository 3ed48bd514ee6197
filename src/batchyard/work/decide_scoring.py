"""Decide's per-outcome scoring, calibrated: what the model's scores say once its bias is out.

For a scoring engine, each decision's outcomes are scored as the reply to
the one prompt (the text once, every question). Calibration
(``batchyard.core.calibration``) adds, per call:

- the decision set's prior: the content-free estimate, made once per
  organisation and set by the first call that needs it (and paid by it),
  refined by the running mean of the raw probabilities of the texts of the
  set answered before (``batch`` mode). Each answer's probabilities are
  divided by that prior. The set lists its outcomes one way, so its prior
  holds the pull of the outcome listed first too, and the call reads the one
  prompt an uncalibrated call reads.

Decision *k* is still scored after the answers chosen for decisions 1 to
*k*−1, and those are the calibrated choices. Every prompt the model reads is
usage: ``input_tokens`` counts the call's prompt and any content-free
prompts, and ``calibration_input_tokens`` says how many of them calibration
added.

The state lives in the store (``batchyard.store.calibration``), so every
process of a deployment shares one running mean; what a process learns of a
prior that is already stored is kept in memory, since it never changes.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchyard.core import calibration as cal
from batchyard.core import decisions as rules
from batchyard.core.catalog import RouteSpec
from batchyard.engines.base import Usage
from batchyard.store import calibration as store
from batchyard.work.dispatcher import Dispatcher

__all__ = [
    "CalibrationInfo",
    "Calibrations",
    "ScoredAnswers",
    "calibrations_for",
    "content_free_requests",
]


def content_free_requests(req: rules.DecideRequest) -> list[rules.DecideRequest]:
    """The same questions about texts that say nothing: what the model answers by bias."""
    return [
        rules.DecideRequest(req.model, rules.DecideInput(text=t), req.decisions, None, "base")
        for t in cal.CONTENT_FREE_TEXTS
    ]


def fingerprint(model_id: str, req: rules.DecideRequest) -> str:
    return cal.set_fingerprint(
        model_id,
        [(d.id, d.question, [(o.id, o.description) for o in d.outcomes]) for d in req.decisions],
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
    chosen: list[str]
    probabilities: list[dict[str, float]]
    raw: list[dict[str, float]] | None
    usage: Usage
    calibration_input_tokens: int
    calibration: CalibrationInfo | None


@dataclass
class _Raw:
    chosen: list[str]
    raw: list[list[float]]
    final: list[list[float]]
    # Prompt tokens the model read.
    input_tokens: int


@dataclass
class Calibrations:
    """One deployment's calibration: the store's shared state and this process's memory of it."""

    dispatcher: Dispatcher
    _priors: dict[tuple[str, str], list[list[float]]] = field(default_factory=dict)
    _locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)

    async def prior_known(self, org_id: str, model_id: str, req: rules.DecideRequest) -> bool:
        """Whether the set's content-free prior is stored (a call then needn't estimate it)."""
        key = (org_id, fingerprint(model_id, req))
        if key in self._priors:
            return True
        state = await self.dispatcher.db.read(lambda c: store.load_state(c, *key))
        if state is not None:
            self._priors[key] = state.content_free
        return state is not None

    async def _score(
        self,
        route: RouteSpec,
        upstream_model: str,
        req: rules.DecideRequest,
        prompt_tokens: int,
        prior_of: Callable[[int], list[float] | None],
    ) -> _Raw:
        messages = rules.build_messages(req, "lines")
        decisions = req.decisions
        chosen: list[str] = []
        raws: list[list[float]] = []
        finals: list[list[float]] = []
        read: int | None = None
        for k, decision in enumerate(decisions):
            candidates = rules.scoring_candidates(decisions, k, chosen)
            scores, usage = await self.dispatcher.score(
                route=route,
                model=upstream_model,
                messages=messages,
                candidates=candidates,
                input_tokens=prompt_tokens,
            )
            # Every decision reads the same prompt; it is paid once.
            read = usage.input_tokens if read is None else read
            raw = rules.softmax(scores)
            prior = prior_of(k)
            final = cal.calibrate(raw, prior) if prior is not None else raw
            best = max(range(len(final)), key=final.__getitem__)
            chosen.append(decision.outcomes[best].id)
            raws.append(raw)
            finals.append(final)
        return _Raw(chosen, raws, finals, read or 0)

    async def _content_free(
        self,
        key: tuple[str, str],
        route: RouteSpec,
        upstream_model: str,
        req: rules.DecideRequest,
        count: Callable[[list[dict[str, Any]]], int],
    ) -> tuple[list[list[float]], int]:
        """The set's content-free prior and the prompt tokens spent estimating it (0: known)."""
        async with self._locks.setdefault(key, asyncio.Lock()):
            known = self._priors.get(key)
            if known is None:
                state = await self.dispatcher.db.read(lambda c: store.load_state(c, *key))
                known = state.content_free if state is not None else None
            if known is not None:
                self._priors[key] = known
                return known, 0
            samples: list[list[list[float]]] = []
            spent = 0
            for cf in content_free_requests(req):
                tokens = count(rules.build_messages(cf, "lines"))
                got = await self._score(route, upstream_model, cf, tokens, lambda _k: None)
                samples.append(got.raw)
                spent += got.input_tokens
            prior = [
                cal.mean_probabilities([s[k] for s in samples]) for k in range(len(req.decisions))
            ]
            await self.dispatcher.db.write(lambda c: store.save_content_free(c, *key, prior))
            # Another process may have stored its estimate first: use the stored one.
            state = await self.dispatcher.db.read(lambda c: store.load_state(c, *key))
            self._priors[key] = state.content_free if state is not None else prior
            return self._priors[key], spent

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
            usage = Usage(got.input_tokens, count_text(answer))
            return ScoredAnswers(got.chosen, by_id(got.final), None, usage, 0, None)
        key = (org_id, fingerprint(model_id, req))
        content_free, cf_tokens = await self._content_free(key, route, upstream_model, req, count)
        texts = [0] * len(req.decisions)
        sums = [[0.0] * len(o) for o in ids]
        if mode == "batch":
            state = await self.dispatcher.db.read(lambda c: store.load_state(c, *key))
            if state is not None:
                texts, sums = state.texts, state.prob_sums

        def prior_of(k: int) -> list[float]:
            return cal.blend_prior(content_free[k], sums[k], texts[k])

        got = await self._score(route, upstream_model, req, prompt_tokens, prior_of)
        if mode == "batch" and retain:
            await self.dispatcher.db.write(lambda c: store.add_texts(c, *key, got.raw))
        answer = rules.answer_text(req.decisions, got.chosen, "lines")
        return ScoredAnswers(
            got.chosen,
            by_id(got.final),
            by_id(got.raw),
            Usage(got.input_tokens + cf_tokens, count_text(answer)),
            # What calibration added: the content-free prompts, on the call that made them.
            cf_tokens,
            CalibrationInfo(mode, min(texts), cf_tokens > 0),
        )


_registry: weakref.WeakKeyDictionary[Dispatcher, Calibrations] = weakref.WeakKeyDictionary()


def calibrations_for(dispatcher: Dispatcher) -> Calibrations:
    """The deployment's calibration state (made on first use), one per dispatcher."""
    found = _registry.get(dispatcher)
    if found is None:
        found = _registry[dispatcher] = Calibrations(dispatcher)
    return found
