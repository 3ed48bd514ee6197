"""The embedded engine against llama.cpp's own ``llama-server``: same GGUF, same cores, same run.

The baseline is what the model file and the cores allow a real server to do.
``llama-server`` and ``llama-batched-bench`` are built by ``bench/llama_build.py``
from the llama.cpp source that the installed llama-cpp-python vendors (its
sdist, fetched with pip on first use), with the flags the project builds the
wheel with (``-DGGML_NATIVE=OFF``), and cached in
``~/.cache/batchyard/llama.cpp-<version>/``, so only the first run pays for
the build (``build.json`` there records how long it took). The wheel's and
the build's ``system_info`` lines are printed, to show they use the same
instructions.

Three servers start on loopback, all on the cores this process may use:

- ``batchyard serve`` as a newcomer runs it: the embedded default (no config
  file, a temporary ``BATCHYARD_HOME``, SQLite), an organisation whose key
  and credit are made with the CLI; $5,000 of credit lifts it to the top
  default tier, whose limits these loads never reach;
- ``llama-server -np 8 --cont-batching -t <cores>`` on the same GGUF;
- ``llama-server --embedding --pooling mean`` for ``/embedding`` (the flag
  restricts a server to embeddings, hence a second one).

Then, in rounds, each measurement runs on one contender and then the other
(the order flips every round, so neither always runs first), on the same
inputs, at temperature 0 and the same ``max_tokens``. No input is asked twice in
a run while its pool lasts (``Deck``): llama-server keeps every prompt it has read
in host memory (``--cache-ram``, 8 GiB by default) and answers a prompt it has
seen from there, so a prompt drawn again would measure the two servers' caches,
not their batching. Where a pool is smaller than the run, the end says how many
inputs were drawn a second time.

- chat: output tokens/s at 1, 4, 8 and 16 concurrent clients,
  ``/v1/chat/completions`` on both, as each server's usage counts them (the
  targets' measure); llama-server's counts the end-of-generation token of a
  reply that stops, batchyard's does not, so the end also prints the ratios
  with every reply counted alike;
- decide: texts/s of ``POST /v1/decide`` (two decisions, of 3 and 4
  outcomes, on ~32-token texts) against llama-server's ``/completion`` with
  ``n_predict`` 1 and ``cache_prompt`` given the same questions as a llama.cpp
  user lays them out: batchyard's system prompt, questions and answer format,
  then the text last (``Prompts.baseline``: batchyard's own prompt with the
  text's paragraph moved to the end, through the GGUF's chat template), so the
  server's prompt cache serves everything but the text; the bench prints whether
  batchyard's rendered prompt is that same prompt, and both one's token counts;
- embeddings: inputs/s, ``/v1/embeddings`` against ``/embedding``, 4 inputs
  a request;
- output tokens per CPU-second of each serving process and its children
  (``/proc/<pid>/stat``, over the chat measurements), and each server's peak
  resident memory (``VmHWM``).

Each is printed as batchyard / llama-server per round and as the median of
the rounds, beside its target (chat ≥ 1.0 at every client count, decide ≥
1.0). ``llama-batched-bench`` runs once first, with no server busy, to show
what the cores allow. Every server is stopped on exit, Ctrl-C and SIGTERM
included; nothing listens beyond 127.0.0.1.

The same comparison on other inputs: ``--chat-prompts`` and ``--texts`` (one a
line; a line that is a JSON string may hold newlines), ``--system`` (a file whose
text is every chat's system prompt) and ``--decisions`` (a JSON list of decisions as
``POST /v1/decide`` takes them). llama-server's slots grow to fit the longest prompt.

    python bench/engine.py [--quick] [--rounds N] [--clients 1,4,8,16] [--max-tokens 64]
        [--chat-prompts FILE] [--system FILE] [--texts FILE] [--decisions FILE] [--no-chat]
        [--threads N]

``--no-chat`` measures decide (and embeddings) alone, for a change that touches only them
(and skips ``llama-batched-bench``, which shows what the cores allow for chat).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
#: The environment as the bench was started, before importing batchyard's engines sets
#: its OpenMP waiting (``batchyard.engines``): llama.cpp's own tools run with their own
#: defaults, as a user of llama-server runs them, and batchyard's server with its own.
OUTSIDE_ENV = dict(os.environ)

from bench.llama_build import DISTRIBUTION, Build, build_llama_cpp  # noqa: E402

from batchyard.core import decisions as rules  # noqa: E402
from batchyard.core.tokens import text_messages  # noqa: E402
from batchyard.engines.model_files import default_model_path  # noqa: E402
from batchyard.engines.tokenizers import ChatTemplate  # noqa: E402
from batchyard.errors import BatchyardError  # noqa: E402

console = Console()

MODEL = "kettei-core"
TARGETS = {"chat": 1.0, "decide": 1.0}
# llama-server's slots: the configuration of issue 19's comparison.
SLOTS = 8
# Context per llama-server slot: room for the generated prompts and their replies
# (``fit_slot`` raises it for longer prompts of a user's own).
SLOT_CTX = 1024
EMBED_INPUTS_PER_REQUEST = 4
#: Where the text goes in the prompt ``Prompts.baseline`` rearranges.
TEXT_MARK = "<<the text>>"
#: The decks' shuffle: every run of the same inputs asks them in the same order.
SEED = 1000

# -- processes --------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(pid: int) -> list[int]:
    """``pid`` and every live descendant (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU of ``pid``, its live descendants and the children it reaped."""
    total = 0
    for p in process_tree(pid):
        fields = _stat(p)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])
            if p == pid:
                total += int(fields[13]) + int(fields[14])
    return total / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    """Peak resident memory (VmHWM) of ``pid`` and its descendants, in MB."""
    total = 0
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    base: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _die_with_parent() -> None:
    """In the child: SIGTERM when the bench dies, even by SIGKILL (Linux prctl)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(name: str, cmd: list[str], env: dict[str, str], base: str, tmp: Path) -> Server:
    log = tmp / f"{name}.log"
    with log.open("wb") as out:
        # A session of its own: Ctrl-C reaches the bench, which stops each server in order.
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    return Server(name, proc, base, log)


def wait_healthy(server: Server, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise SystemExit(f"{server.name} exited before it was healthy:\n{server.tail()}")
        try:
            if httpx.get(f"{server.base}{path}", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{server.name} did not become healthy in {timeout:.0f}s:\n{server.tail()}")


def cli(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "batchyard", *args],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    # The key alone on stdout; what an operator reads (the tier reached) on stderr.
    lines = (out.stdout.strip() or out.stderr.strip()).splitlines()
    return lines[-1] if lines else ""


# -- the work ---------------------------------------------------------------------

TASKS = (
    "Write a short story about",
    "Explain to a child",
    "Give three tips about",
    "Describe a day spent with",
    "Write a letter to a friend about",
    "List the pros and cons of",
    "Write a poem about",
    "Tell me a fun fact about",
)
TOPICS = (
    "a lighthouse keeper",
    "growing tomatoes",
    "the moon",
    "a lost umbrella",
    "learning to swim",
    "a busy train station",
    "baking bread",
    "a friendly robot",
    "winter mornings",
    "a small bookshop",
    "the ocean",
    "riding a bicycle",
    "an old clock",
    "a rainy festival",
    "mountain hiking",
    "a cat that loves boxes",
)

PRODUCTS = (
    "blender",
    "rain jacket",
    "desk lamp",
    "pair of running shoes",
    "coffee grinder",
    "phone case",
    "backpack",
    "electric kettle",
    "office chair",
    "set of headphones",
)
OPENINGS = (
    "I bought this {p} two weeks ago for my sister.",
    "We ordered the {p} after reading a few reviews online.",
    "My old {p} broke last month, so I tried this one.",
    "The {p} arrived on a Tuesday in a plain brown box.",
    "I have used this {p} every day since the spring.",
)
VERDICTS = (
    "It works much better than I expected and feels solid.",
    "Sadly it stopped working after three days of normal use.",
    "It does the job, nothing more and nothing less.",
    "The price was fair for what you get, I think.",
    "Delivery took almost a month and nobody answered my emails.",
    "The support team replaced a missing part within a day.",
    "Honestly it looks cheap and the paint already peels off.",
)
CLOSINGS = (
    "I would buy it again.",
    "I am sending it back.",
    "Not sure yet.",
    "My sister likes it.",
    "Avoid this seller.",
    "Five stars from me.",
)

DECISIONS = [
    {
        "id": "sentiment",
        "question": "How does the writer feel about the product?",
        "outcomes": [
            {"id": "positive", "description": "likes it"},
            {"id": "negative", "description": "dislikes it"},
            {"id": "neutral", "description": "neither"},
        ],
    },
    {
        "id": "topic",
        "question": "What is the text mostly about?",
        "outcomes": [
            {"id": "quality", "description": "how well it is made or works"},
            {"id": "price", "description": "what it costs"},
            {"id": "delivery", "description": "shipping and arrival"},
            {"id": "service", "description": "the seller or support"},
        ],
    },
]


STYLES = ("", " Keep it simple.", " Be cheerful.", " Use plain words.", " Make it vivid.")


def chat_pool() -> list[str]:
    return [f"{t} {p}.{s}" for t in TASKS for p in TOPICS for s in STYLES]


def chat_prompts(seed: int, n: int) -> list[str]:
    """``n`` of the generated chat prompts, drawn with ``seed``."""
    return _draw(chat_pool(), seed, n)


def review_pool() -> list[str]:
    """Every generated review text (decide's and embeddings' default inputs)."""
    return [
        " ".join((o.format(p=p), v, c))
        for p in PRODUCTS
        for o in OPENINGS
        for v in VERDICTS
        for c in CLOSINGS
    ]


def review_texts(seed: int, n: int) -> list[str]:
    """``n`` distinct generated review texts, drawn with ``seed``."""
    return _draw(review_pool(), seed, n)


def read_text(path: Path, what: str) -> str:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SystemExit(f"{what} file {path}: {exc}; give a UTF-8 text file") from None
    if not raw.strip():
        raise SystemExit(f"{what} file {path} is empty")
    return raw


def read_lines(path: Path, what: str) -> list[str]:
    """One entry a line; a line that is a JSON string is decoded (so an entry may hold newlines)."""
    raw = read_text(path, what)
    out: list[str] = []
    for line in raw.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith('"'):
            with contextlib.suppress(ValueError):
                decoded = json.loads(line)
                if isinstance(decoded, str):
                    line = decoded
        out.append(line)
    return out


def read_decisions(path: Path) -> list[dict[str, Any]]:
    """A JSON list of decisions as ``POST /v1/decide`` takes them, or a body holding one."""
    try:
        data = json.loads(read_text(path, "decisions"))
    except ValueError as exc:
        raise SystemExit(f"decisions file {path}: {exc}; give a JSON list of decisions") from None
    decisions = data.get("decisions") if isinstance(data, dict) else data
    if not isinstance(decisions, list):
        raise SystemExit(f"decisions file {path}: give a JSON list of decisions") from None
    try:
        rules.parse_request({"model": MODEL, "input": {"text": "x"}, "decisions": decisions})
    except BatchyardError as exc:  # the API's own validation, as one line
        raise SystemExit(f"decisions file {path}: {exc}".splitlines()[0]) from None
    return decisions


@dataclass(frozen=True)
class Workload:
    """What both contenders are asked: chat prompts, decide and embedding texts, decisions.

    The defaults are generated; ``--chat-prompts``, ``--system``, ``--texts`` and
    ``--decisions`` replace them with a user's own, so the comparison can be rerun on
    other inputs. The measurements draw from them through ``decks``.
    """

    prompts: list[str]
    texts: list[str] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=lambda: DECISIONS)
    system: str | None = None

    def chat_prompts(self, seed: int, n: int) -> list[str]:
        """``n`` requests; a seed of their own per round and client count."""
        return _draw(self.prompts, seed, n)

    def text_pool(self) -> list[str]:
        """Decide's and embeddings' texts: the user's, or every generated review."""
        return review_pool() if self.texts is None else self.texts

    def decks(self, seed: int) -> dict[str, Deck]:
        """One deck per kind of work, each shuffled by ``seed`` alone."""
        texts = self.text_pool()
        return {
            "chat": Deck("chat prompts", self.prompts, random.Random(seed)),
            "decide": Deck("decide texts", texts, random.Random(seed + 1)),
            "embed": Deck("embedding texts", texts, random.Random(seed + 2)),
        }

    def messages(self, prompt: str) -> list[dict[str, str]]:
        head = [] if self.system is None else [{"role": "system", "content": self.system}]
        return [*head, {"role": "user", "content": prompt}]

    def decide_body(self, text: str) -> dict[str, Any]:
        return {"model": MODEL, "input": {"text": text}, "decisions": self.decisions}


@dataclass
class Deck:
    """A pool's inputs dealt in a shuffled order, none twice until all are dealt.

    Both contenders of a measurement get the same hand. An input dealt again (the
    pool ran out: it is shuffled anew) could be answered from a cache an earlier
    measurement filled (llama-server's ``--cache-ram`` keeps every prompt it read),
    so ``repeats`` counts them and the run prints it.
    """

    name: str
    pool: list[str]
    rng: random.Random
    dealt: int = 0
    _left: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pool = list(dict.fromkeys(self.pool))

    def take(self, n: int) -> list[str]:
        hand: list[str] = []
        while len(hand) < n:
            if not self._left:
                self._left = self.pool[:]
                self.rng.shuffle(self._left)
            hand.append(self._left.pop())
        self.dealt += n
        return hand

    @property
    def repeats(self) -> int:
        return max(0, self.dealt - len(self.pool))

    def summary(self) -> str:
        said = f"{self.name}: {self.dealt} drawn of {len(self.pool)}"
        if self.repeats:
            return f"{said}, {self.repeats} of them again (the pool is smaller than the run)"
        return f"{said}, none twice"


def _draw(pool: list[str], seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]


class Prompts:
    """Decide's prompt as the embedded engine renders it: the GGUF's own chat template."""

    def __init__(self, model_path: Path, work: Workload) -> None:
        import llama_cpp
        from llama_cpp._utils import suppress_stdout_stderr

        with suppress_stdout_stderr(disable=False):
            self.llama = llama_cpp.Llama(str(model_path), vocab_only=True, verbose=False)
        template = ChatTemplate.from_llama(self.llama)
        if template is None:
            raise SystemExit(f"{model_path} has no chat template")
        self.template = template
        self.work = work

    def decide(self, text: str) -> str:
        """The prompt batchyard's engine reads for ``text``."""
        req = rules.parse_request(self.work.decide_body(text))
        plain, _ = text_messages(rules.build_messages(req, "lines"))
        return self.template.prompt(plain)

    def baseline(self, text: str) -> str:
        """llama-server's prompt for ``text``: the same words, the text last.

        What a llama.cpp user asking these questions sends: the instructions
        first and the text at the end, so ``cache_prompt`` serves all but the
        text. It is batchyard's own prompt with the text's paragraph moved to the
        end, so it holds the same system prompt, questions and answer format
        whatever order batchyard lays them out in.
        """
        req = rules.parse_request(self.work.decide_body(TEXT_MARK))
        plain, _ = text_messages(rules.build_messages(req, "lines"))
        *head, user = plain
        paragraphs = [p for p in user["content"].split("\n\n") if p != f"Text:\n{TEXT_MARK}"]
        content = "\n\n".join([*paragraphs, f"Text:\n{text}"])
        return self.template.prompt([*head, {"role": "user", "content": content}])

    def chat(self, prompt: str) -> str:
        return self.template.prompt(self.work.messages(prompt))

    def count(self, prompt: str) -> int:
        return len(self.llama.tokenize(prompt.encode("utf-8"), add_bos=False, special=True))

    def close(self) -> None:
        self.llama.close()


@dataclass
class Load:
    """One measurement: requests at a concurrency, what came back, how long it took."""

    seconds: float = 0.0
    ok: int = 0
    failed: int = 0
    units: float = 0.0
    cpu: float = 0.0
    replies: list[Any] = field(default_factory=list)

    def rate(self) -> float:
        return self.units / self.seconds if self.seconds else 0.0


async def drive(
    url: str,
    bodies: list[dict[str, Any]],
    clients: int,
    headers: dict[str, str],
    units: Any,
    pid: int,
) -> Load:
    """POST every body, ``clients`` at a time; ``units(reply)`` is what one reply counts for."""
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    load = Load(replies=[None] * len(bodies))
    todo = iter(range(len(bodies)))
    async with httpx.AsyncClient(limits=limits, timeout=600, headers=headers) as client:

        async def worker() -> None:
            for i in todo:
                try:
                    r = await client.post(url, json=bodies[i])
                except httpx.HTTPError as exc:
                    load.failed += 1
                    console.print(f"[red]{url}: {type(exc).__name__}[/] {exc}")
                    continue
                if r.status_code != 200:
                    load.failed += 1
                    if load.failed <= 3:
                        console.print(f"[red]{url}: {r.status_code}[/] {r.text[:300]}")
                    continue
                reply = r.json()
                load.ok += 1
                load.units += units(reply)
                load.replies[i] = reply

        cpu0 = cpu_seconds(pid)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        load.seconds = time.perf_counter() - started
        load.cpu = cpu_seconds(pid) - cpu0
    return load


def chat_tokens(reply: dict[str, Any]) -> int:
    return int(reply["usage"]["completion_tokens"])


def eog_counted(who: str, reply: dict[str, Any] | None) -> int:
    """1 where the reply's usage counts the end-of-generation token that stopped it.

    llama-server's ``completion_tokens`` counts every token it sampled, the one
    that ended the reply included (a reply that stops after 12 tokens of text
    says 13); batchyard's counts the reply's own tokens. Counted alike, the two
    replies of the same text weigh the same.
    """
    if who != "llama-server" or reply is None:
        return 0
    return int(reply["choices"][0].get("finish_reason") == "stop")


def chat_text(reply: dict[str, Any] | None) -> str | None:
    return None if reply is None else reply["choices"][0]["message"]["content"]


@dataclass
class Contender:
    name: str
    server: Server
    headers: dict[str, str]
    chat_url: str
    decide_url: str
    embed_url: str
    embed_pid: int
    work: Workload

    def chat_body(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        return {
            "model": MODEL,
            "messages": self.work.messages(prompt),
            "max_tokens": max_tokens,
            "temperature": 0,
        }


def decide_bodies(who: str, prompts: Prompts, texts: list[str]) -> list[dict[str, Any]]:
    if who == "batchyard":
        return [prompts.work.decide_body(t) for t in texts]
    return [
        {"prompt": prompts.baseline(t), "n_predict": 1, "cache_prompt": True, "temperature": 0}
        for t in texts
    ]


def embed_bodies(who: str, texts: list[str]) -> list[dict[str, Any]]:
    step = EMBED_INPUTS_PER_REQUEST
    chunks = [texts[i : i + step] for i in range(0, len(texts), step)]
    if who == "batchyard":
        return [{"model": MODEL, "input": c} for c in chunks]
    return [{"content": c} for c in chunks]


def embed_count(reply: Any) -> int:
    # batchyard: an OpenAI list; llama-server: one entry per input.
    return len(reply["data"]) if isinstance(reply, dict) else len(reply)


# -- the rounds -------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    clients: list[int]
    max_tokens: int
    per_client: int
    decide_texts: int
    decide_clients: int
    embed_inputs: int
    #: Chat requests of one measurement at least: one client's two requests were
    #: too few to measure (one reply that stops early swung its ratio by 0.2).
    min_chat: int = 2


@dataclass
class Tally:
    """Everything one round measured, per contender."""

    rates: dict[str, dict[str, float]] = field(default_factory=dict)
    chat_tokens: dict[str, float] = field(default_factory=dict)
    chat_cpu: dict[str, float] = field(default_factory=dict)
    #: Chat output tokens/s with every reply counted alike: its end-of-generation
    #: token left out (llama-server's usage counts it, batchyard's does not).
    alike: dict[str, dict[str, float]] = field(default_factory=dict)


def wanted(plan: Plan, what: str, clients: int) -> int:
    """How many inputs one measurement of ``what`` asks."""
    if what == "chat":
        return max(plan.min_chat, clients * plan.per_client)
    return plan.decide_texts if what == "decide" else plan.embed_inputs


def measure(
    who: Contender, what: str, plan: Plan, inputs: list[str], prompts: Prompts, clients: int
) -> Load:
    if what == "chat":
        bodies = [who.chat_body(p, plan.max_tokens) for p in inputs]
        return asyncio.run(
            drive(who.chat_url, bodies, clients, who.headers, chat_tokens, who.server.proc.pid)
        )
    if what == "decide":
        bodies = decide_bodies(who.name, prompts, inputs)
        return asyncio.run(
            drive(
                who.decide_url,
                bodies,
                plan.decide_clients,
                who.headers,
                lambda _r: 1,
                who.server.proc.pid,
            )
        )
    bodies = embed_bodies(who.name, inputs)
    return asyncio.run(
        drive(who.embed_url, bodies, plan.decide_clients, who.headers, embed_count, who.embed_pid)
    )


def run_rounds(
    plan: Plan,
    by: Contender,
    ls: Contender,
    prompts: Prompts,
    embeddings: bool,
    decks: dict[str, Deck],
) -> tuple[list[Tally], int, list[tuple[int, int]]]:
    """Each measurement on both contenders back to back; who goes first flips each round."""
    tallies: list[Tally] = []
    failed = 0
    agree: list[tuple[int, int]] = []
    works = [("chat", c) for c in plan.clients] + [("decide", plan.decide_clients)]
    if embeddings:
        works.append(("embed", plan.decide_clients))
    for r in range(plan.rounds):
        order = [by, ls] if r % 2 == 0 else [ls, by]
        tally = Tally()
        for who in order:
            tally.rates[who.name] = {}
            tally.chat_tokens[who.name] = 0.0
            tally.chat_cpu[who.name] = 0.0
            tally.alike[who.name] = {}
        for what, clients in works:
            inputs = decks[what].take(wanted(plan, what, clients))
            loads = {}
            for who in order:
                load = measure(who, what, plan, inputs, prompts, clients)
                failed += load.failed
                loads[who.name] = load
                key = f"chat, {clients} client{'s' * (clients > 1)}" if what == "chat" else what
                tally.rates[who.name][key] = load.rate()
                if what == "chat":
                    tally.chat_tokens[who.name] += load.units
                    tally.chat_cpu[who.name] += load.cpu
                    eog = sum(eog_counted(who.name, x) for x in load.replies)
                    tally.alike[who.name][key] = (load.units - eog) / load.seconds
            if what == "chat":
                a = [chat_text(x) for x in loads[by.name].replies]
                b = [chat_text(x) for x in loads[ls.name].replies]
                agree.append(
                    (sum(x == y and x is not None for x, y in zip(a, b, strict=True)), len(a))
                )
        tallies.append(tally)
        print_round(r, order, tally, by.name, ls.name)
    return tallies, failed, agree


def per_cpu(t: Tally, name: str) -> float:
    return t.chat_tokens[name] / t.chat_cpu[name] if t.chat_cpu[name] else 0.0


def ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def unit_of(key: str) -> str:
    return {"decide": "texts/s", "embed": "inputs/s"}.get(key, "tok/s")


def print_round(r: int, order: list[Contender], t: Tally, by: str, ls: str) -> None:
    table = Table(title=f"round {r + 1} ({' then '.join(c.name for c in order)})")
    for col in ("work", "batchyard", "llama-server", "ratio"):
        table.add_column(col, justify="left" if col == "work" else "right")
    for key in t.rates[by]:
        a, b = t.rates[by][key], t.rates[ls][key]
        table.add_row(key, f"{a:.1f} {unit_of(key)}", f"{b:.1f}", f"{ratio(a, b):.2f}")
    if t.chat_cpu[by]:
        a, b = per_cpu(t, by), per_cpu(t, ls)
        table.add_row("chat tokens / CPU-s", f"{a:.1f}", f"{b:.1f}", f"{ratio(a, b):.2f}")
    console.print(table)


def print_summary(tallies: list[Tally], by: str, ls: str) -> list[tuple[str, float, float]]:
    table = Table(title=f"batchyard / llama-server, {len(tallies)} rounds")
    for col in (
        "work",
        "batchyard (median)",
        "llama-server (median)",
        "ratios",
        "median",
        "target",
    ):
        table.add_column(col, justify="left" if col == "work" else "right")
    verdicts: list[tuple[str, float, float]] = []
    keys = list(tallies[0].rates[by])
    chat = ["chat tokens / CPU-s"] if tallies[0].chat_cpu[by] else []
    for key in [*keys, *chat]:
        if key in keys:
            a_s = [t.rates[by][key] for t in tallies]
            b_s = [t.rates[ls][key] for t in tallies]
        else:
            a_s = [per_cpu(t, by) for t in tallies]
            b_s = [per_cpu(t, ls) for t in tallies]
        ratios = [ratio(a, b) for a, b in zip(a_s, b_s, strict=True)]
        med = statistics.median(ratios)
        target = TARGETS.get(key.split(",")[0]) if key in keys else None
        mark = ""
        if target is not None:
            verdicts.append((key, med, target))
            mark = "[green]✓[/]" if med >= target else "[red]✗[/]"
        table.add_row(
            key,
            f"{statistics.median(a_s):.1f} {unit_of(key) if key in keys else ''}".rstrip(),
            f"{statistics.median(b_s):.1f}",
            " ".join(f"{x:.2f}" for x in ratios),
            f"[bold]{med:.2f}[/]",
            f"≥ {target:.1f} {mark}" if target is not None else "",
        )
    console.print(table)
    alike = [
        statistics.median(ratio(t.alike[by][key], t.alike[ls][key]) for t in tallies)
        for key in keys
        if key in tallies[0].alike[by]
    ]
    if alike:
        console.print(
            "chat counted alike (each reply's end-of-generation token left out; "
            "llama-server's usage counts it, batchyard's does not), median ratios: "
            + " / ".join(f"{x:.2f}" for x in alike)
        )
    return verdicts


# -- llama-batched-bench ----------------------------------------------------------


def batched_bench(build: Build, model: Path, threads: int, quick: bool) -> None:
    npl = "1,8" if quick else "1,4,8,16"
    cmd = [
        str(build.binary("llama-batched-bench")),
        *("-m", str(model), "-c", "4096", "-b", "2048", "-ub", "512"),
        *("-npp", "64", "-ntg", "64", "-npl", npl, "-t", str(threads)),
        *("--output-format", "jsonl"),
    ]
    try:
        done = subprocess.run(
            cmd, env=OUTSIDE_ENV, capture_output=True, text=True, timeout=600, check=False
        )
    except subprocess.TimeoutExpired:
        console.print("[yellow]llama-batched-bench took over 600 s; skipped[/]")
        return
    rows = []
    for line in done.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    if done.returncode != 0 or not rows:
        console.print(f"[yellow]llama-batched-bench failed ({done.returncode})[/]")
        console.print(done.stderr[-1500:])
        return
    table = Table(title=f"llama-batched-bench: what {threads} threads allow (64-token prompts)")
    for col in ("sequences", "prompt tok/s", "generation tok/s", "all tok/s"):
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(
            str(row["pl"]),
            f"{row['speed_pp']:.0f}",
            f"{row['speed_tg']:.0f}",
            f"{row['speed']:.0f}",
        )
    console.print(table)


# -- main -------------------------------------------------------------------------


def fit_slot(prompts: Prompts, plan: Plan) -> int:
    """llama-server's context per slot: ``SLOT_CTX``, or room for the longest prompt and reply.

    batchyard's embedded default gives each sequence 2,048 tokens; a slot too small
    for a user's own prompts would make llama-server refuse them, not measure them.
    """
    work = prompts.work
    longest = max(
        [prompts.count(prompts.chat(p)) for p in work.prompts]
        + [prompts.count(prompts.baseline(t)) for t in work.text_pool()]
    )
    need = longest + max(plan.max_tokens, 8) + 16
    return max(SLOT_CTX, -(-need // 256) * 256)


def _terminate(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def servers_stopped(started: list[Server]) -> Iterator[None]:
    """Stop every server however the run ends (Ctrl-C and SIGTERM included)."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        # A second Ctrl-C while stopping must not leave a server behind.
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        for s in reversed(started):
            s.stop()
        signal.signal(signal.SIGINT, old_int)
        signal.signal(signal.SIGTERM, previous)


def check_prompts(
    by: Contender,
    ls: Contender,
    prompts: Prompts,
    text: str,
    chat: str | None,
    max_tokens: int,
) -> None:
    """What both read: decide's prompts (and whether they are one), and chat's template."""
    b = httpx.post(by.decide_url, json=by.work.decide_body(text), headers=by.headers, timeout=600)
    b.raise_for_status()
    rendered, baseline = prompts.decide(text), prompts.baseline(text)
    body = {"prompt": baseline, "n_predict": 1, "cache_prompt": True, "temperature": 0}
    lr = httpx.post(ls.decide_url, json=body, timeout=600).json()
    fallback = b.json().get("fallback")
    same = "the same prompt" if rendered == baseline else "[yellow]another prompt[/]"
    console.print(
        f"decide prompt: batchyard read {b.json()['usage']['input_tokens']} input tokens "
        f"(its rendered prompt is {prompts.count(rendered)}), llama-server evaluated "
        f"{lr.get('tokens_evaluated')} (text last: {prompts.count(baseline)}), {same}; "
        f"fallback {fallback}"
    )
    if chat is None:
        return
    got = [
        httpx.post(c.chat_url, json=c.chat_body(chat, max_tokens), headers=c.headers, timeout=600)
        .raise_for_status()
        .json()["usage"]
        for c in (by, ls)
    ]
    console.print(
        f"chat prompt: batchyard {got[0]['prompt_tokens']} prompt tokens, "
        f"llama-server {got[1]['prompt_tokens']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer requests")
    ap.add_argument("--rounds", type=int, default=None, help="default 4 (--quick: 2)")
    ap.add_argument("--clients", default="1,4,8,16", help="chat client counts")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--decide-clients", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=2, help="parallel jobs of the first build")
    ap.add_argument("--rebuild", action="store_true", help="build llama.cpp again")
    ap.add_argument("--no-embeddings", action="store_true")
    ap.add_argument("--no-chat", action="store_true", help="measure decide (and embeddings) only")
    ap.add_argument(
        "--threads", type=int, default=None, help="threads of each server (default: every core)"
    )
    ap.add_argument(
        "--chat-prompts", type=Path, help="chat prompts, one a line (default: generated)"
    )
    ap.add_argument("--system", type=Path, help="a file whose text is every chat's system prompt")
    ap.add_argument(
        "--texts", type=Path, help="decide and embedding texts, one a line (default: generated)"
    )
    ap.add_argument(
        "--decisions", type=Path, help="a JSON list of decisions as POST /v1/decide takes them"
    )
    args = ap.parse_args()
    work = Workload(
        prompts=chat_pool() if args.chat_prompts is None else read_lines(args.chat_prompts, "chat"),
        texts=None if args.texts is None else read_lines(args.texts, "texts"),
        decisions=DECISIONS if args.decisions is None else read_decisions(args.decisions),
        system=None if args.system is None else read_text(args.system, "system").strip(),
    )
    quick = args.quick
    plan = Plan(
        rounds=args.rounds or (2 if quick else 4),
        clients=[] if args.no_chat else [int(c) for c in args.clients.split(",")],
        max_tokens=args.max_tokens,
        per_client=1 if quick else 2,
        decide_texts=16 if quick else 48,
        decide_clients=args.decide_clients,
        embed_inputs=32 if quick else 96,
        min_chat=4 if quick else 8,
    )
    cores = sorted(os.sched_getaffinity(0))
    # Both servers use the same number of threads: every core this process may use, or
    # --threads (on a machine others load, one thread each avoids llama.cpp's threads
    # spinning at their barriers for a core another process holds).
    threads = args.threads or len(cores)
    version = importlib.metadata.version(DISTRIBUTION)
    model = default_model_path()

    build = build_llama_cpp(version, args.jobs, args.rebuild)
    how = "built now" if build.fresh else "cached"
    console.print(
        f"llama.cpp {version} ({how}, the first build took {build.seconds / 60:.1f} min): "
        f"{build.folder}"
    )
    console.print(f"model {model.name}; {threads} threads on cores {cores}; {plan}")
    import llama_cpp

    console.print(f"llama-cpp-python: {llama_cpp.llama_print_system_info().decode().strip()}")
    if plan.clients:
        batched_bench(build, model, threads, quick)

    tmp = Path(tempfile.mkdtemp(prefix="batchyard-engine-bench-"))
    env = {
        **OUTSIDE_ENV,
        "BATCHYARD_HOME": str(tmp / "home"),
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
        "BATCHYARD_EMBEDDED_THREADS": str(threads),
    }
    for name in ("BATCHYARD_DATABASE_URL", "BATCHYARD_CONFIG", "BATCHYARD_LIMITER_URL"):
        env.pop(name, None)
    key = cli(env, "keys", "create", "--org", "bench", "--scope", "inference")
    # Cumulative credit bought sets the tier: $5,000 is the top default tier's threshold.
    console.print(cli(env, "credit", "add", "--org", "bench", "5000"))

    started: list[Server] = []
    prompts = Prompts(model, work)
    slot_ctx = fit_slot(prompts, plan)
    failed = 0
    try:
        with servers_stopped(started):
            ports = [free_port() for _ in range(3)]
            server_bin = str(build.binary("llama-server"))
            common = ["-m", str(model), "--host", "127.0.0.1", "-t", str(threads)]
            common += ["-tb", str(threads), "-np", str(SLOTS), "--cont-batching"]
            started.append(
                start(
                    "llama-server",
                    [server_bin, *common, "--port", str(ports[0]), "-c", str(SLOTS * slot_ctx)],
                    dict(OUTSIDE_ENV),
                    f"http://127.0.0.1:{ports[0]}",
                    tmp,
                )
            )
            embeddings = not args.no_embeddings
            if embeddings:
                started.append(
                    start(
                        "llama-server-embedding",
                        [
                            *(server_bin, *common, "--port", str(ports[1])),
                            *("-c", str(SLOTS * 512), "--embedding", "--pooling", "mean"),
                        ],
                        dict(OUTSIDE_ENV),
                        f"http://127.0.0.1:{ports[1]}",
                        tmp,
                    )
                )
            serve_cmd = [sys.executable, "-m", "batchyard", "serve", "--port", str(ports[2])]
            started.append(
                start(
                    "batchyard",
                    [*serve_cmd, "--log-level", "warning"],
                    env,
                    f"http://127.0.0.1:{ports[2]}",
                    tmp,
                )
            )
            for s in started:
                wait_healthy(s, "/healthz" if s.name == "batchyard" else "/health", 180)
            by_server, ls_server = started[-1], started[0]
            info = [x for x in ls_server.tail(400).splitlines() if "system_info" in x]
            console.print(f"llama-server: {info[0].strip() if info else '(no system_info line)'}")
            embed_server = started[1] if embeddings else ls_server
            by = Contender(
                "batchyard",
                by_server,
                {"Authorization": f"Bearer {key}"},
                f"{by_server.base}/v1/chat/completions",
                f"{by_server.base}/v1/decide",
                f"{by_server.base}/v1/embeddings",
                by_server.proc.pid,
                work,
            )
            ls = Contender(
                "llama-server",
                ls_server,
                {},
                f"{ls_server.base}/v1/chat/completions",
                f"{ls_server.base}/completion",
                f"{embed_server.base}/embedding",
                embed_server.proc.pid,
                work,
            )
            # Warm both (the embedded model loads on first use, decide's set
            # estimates its content-free prior once): not measured.
            warm = Plan(1, [1], 8, 1, 2, 2, 4)
            decks = work.decks(SEED)
            for what in ("chat", "decide", *(("embed",) if embeddings else ())):
                inputs = decks[what].take(wanted(warm, what, 1))
                for who in (by, ls):
                    load = measure(who, what, warm, inputs, prompts, 1)
                    if load.failed:
                        raise SystemExit(f"{who.name} failed its warm-up {what}")
            if not embeddings:
                console.print("embeddings skipped (--no-embeddings)")
            text, prompt = decks["decide"].take(1)[0], decks["chat"].take(1)[0]
            check_prompts(by, ls, prompts, text, prompt if plan.clients else None, plan.max_tokens)
            tallies, failed, agree = run_rounds(plan, by, ls, prompts, embeddings, decks)
            rss = {s.name: peak_rss_mb(s.proc.pid) for s in started}
    finally:
        prompts.close()
        shutil.rmtree(tmp, ignore_errors=True)

    verdicts = print_summary(tallies, by.name, ls.name)
    same = sum(a for a, _ in agree)
    total = sum(n for _, n in agree)
    console.print(f"chat replies identical on both at temperature 0: {same} of {total}")
    console.print(
        "inputs (warm-up included): " + "; ".join(d.summary() for d in decks.values() if d.dealt)
    )
    console.print(
        "peak resident memory: "
        + ", ".join(f"{name} {mb:.0f} MB" for name, mb in rss.items())
        + " (batchyard serve holds its embedder too)"
    )
    missed = [f"{k} {m:.2f} < {t:.1f}" for k, m, t in verdicts if m < t]
    if missed:
        console.print(f"[yellow]below target: {', '.join(missed)}[/]")
    else:
        console.print("[green]every target met[/]")
    if failed:
        console.print(f"[red]{failed} requests failed[/]")
        sys.exit(1)


if __name__ == "__main__":
    main()
