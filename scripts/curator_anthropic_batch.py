"""Drive a Message Batch through Bespoke Curator's Anthropic batch mode, against batchyard.

Curator is not a dev dependency: its pins (``litellm==1.83.7``, ``pandas==2.2.2``)
conflict with the project's own. Run it from a virtual environment of its own::

    python3.11 -m venv /tmp/curator
    /tmp/curator/bin/pip install bespokelabs-curator==0.1.31 "instructor<1.9"
    /tmp/curator/bin/python scripts/curator_anthropic_batch.py \\
        --base-url http://127.0.0.1:8000 --api-key "$KEY" --model kettei-core

Curator's Anthropic batch mode takes a ``base_url``; two lines on the user's side make
it work with a model LiteLLM does not know (marked below): it asks LiteLLM's model table
for ``max_tokens`` before anything else, so the model is registered there, and the
request's own ``max_tokens`` (a generation parameter, applied after) keeps the answer
within what the catalog's model allows.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", default="kettei-core")
    parser.add_argument("--rows", type=int, default=6)
    args = parser.parse_args()

    os.environ["ANTHROPIC_API_KEY"] = args.api_key
    os.environ.setdefault("CURATOR_CACHE_DIR", tempfile.mkdtemp(prefix="curator-"))
    os.environ.setdefault("CURATOR_DISABLE_CACHE", "true")

    import litellm
    from bespokelabs import curator

    # User-side line 1: LiteLLM's model table must know the name curator asks about.
    litellm.register_model(
        {
            args.model: {
                "max_tokens": 64,
                "litellm_provider": "anthropic",
                "mode": "chat",
                # Curator's cost tracker reads these; batchyard's own charge is what counts.
                "input_cost_per_token": 0.0,
                "output_cost_per_token": 0.0,
            }
        }
    )
    llm = curator.LLM(
        model_name=args.model,
        backend="anthropic",
        batch=True,
        # User-side line 2: the request's own max_tokens, within the model's limit; curator
        # counts an answer that ends at max_tokens as failed, so end it at a sentence.
        generation_params={"max_tokens": 64, "temperature": 0, "stop_sequences": ["."]},
        backend_params={
            "base_url": args.base_url,
            "api_key": args.api_key,
            "batch_check_interval": 1,
            "max_retries": 1,
        },
    )
    topics = ["paperclips", "rivers", "bread", "chess", "rain", "lanterns"][: args.rows]
    out = llm([f"One sentence about {t}." for t in topics])
    rows = out.to_list() if hasattr(out, "to_list") else list(out.dataset)  # curator 0.1.x
    for row in rows:
        print(row)
    answered = sum(1 for row in rows if str(row.get("response", "")).strip())
    print(f"curator anthropic batch: {answered}/{len(topics)} rows answered")
    return 0 if answered == len(topics) else 1


if __name__ == "__main__":
    sys.exit(main())
