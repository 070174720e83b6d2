"""An exactness sweep no fixed test set can hide from: generated prompts of the shapes apps
send, every state PerCache restores for each, against one fresh prefill.

Prompts are made from ``--data`` (QMSum and SQuAD users' documents): passages of 100-1,500
tokens (cut from a user's documents by tokens), 1-6 of them, in the templates of LlamaIndex
(its QA and refine templates, as the library defines them), LangChain's RAG tutorial (the
question before the context) and PerCache's own, with prompt lengths up to ``n_ctx``. For
each prompt and model:

- the reference: stock ``llama_cpp.Llama`` from an empty context, greedy, ``--tokens``
  tokens, no stop string (what the app's pipeline gives);
- for each kind of stored state (slices, whole states), PerCache's runner runs the prompt
  once (restoring what earlier prompts stored, keeping new states), then again restoring at
  most 1, 2, ... of its segments (``RunOptions.restore_depth``: every state point it
  stored), each decoded the same way; every run that restored a state is a (prompt, state)
  pair, and its text must equal the reference.

Prints how many pairs it tried and how many differed; writes JSON. ``--merge A.json
B.json`` writes one result of several runs instead (each run's models, the pairs summed):
a sweep stopped for time (its ``.partial.json``) and one continued at another seed.

    .venv/bin/python -m benchmarks.exactness_sweep --data ../shared/data --models bundled,smollm2 \\
        --prompts 40 --out benchmarks/results/exactness_sweep.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.apps import LANGCHAIN_TUTORIAL
from benchmarks.data_sets import read_jsonl
from benchmarks.output import write_json
from benchmarks.stock import model_paths, stock_llama
from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.kv.engine import Sampling
from percache_core.serving.prompting import TextPrompt
from percache_core.serving.state_runner import RunOptions
from percache_core.types import Chunk

CHUNK_TOKENS = (100, 180, 250, 400, 600, 800, 1024, 1200, 1500)
TEMPLATES = ("llamaindex_qa", "llamaindex_refine", "langchain_tutorial", "percache")


@dataclass
class Prompt:
    """One generated prompt: its template, passages, question and text."""

    template: str
    passages: list[str]
    question: str
    text: str = ""
    chunks: list[Chunk] = field(default_factory=list)


def framework_templates() -> dict[str, str]:
    """LlamaIndex's default QA and refine templates, read from the installed library."""
    from llama_index.core.prompts.default_prompts import (
        DEFAULT_REFINE_PROMPT_TMPL,
        DEFAULT_TEXT_QA_PROMPT_TMPL,
    )

    return {"llamaindex_qa": DEFAULT_TEXT_QA_PROMPT_TMPL, "llamaindex_refine": DEFAULT_REFINE_PROMPT_TMPL}


def user_material(data: Path) -> list[tuple[str, list[str]]]:
    """(document text, questions) of the first users of each data set."""
    material = []
    for dataset, users in (("qmsum", 3), ("squad11-dev", 3)):
        documents = read_jsonl(data / dataset / "documents.jsonl")
        queries = read_jsonl(data / dataset / "queries.jsonl")
        names = list(dict.fromkeys(row["user"] for row in documents))[:users]
        for name in names:
            text = "\n".join(row["text"].strip() for row in documents if row["user"] == name)
            questions = list(dict.fromkeys(row["question"] for row in queries if row["user"] == name))
            material.append((text, questions))
    return material


def make_prompts(engine: Any, material: list[tuple[str, list[str]]], count: int, *, seed: int) -> list[Prompt]:
    """*count* prompts that fit ``engine.n_ctx`` with room to decode; families of three
    share their first passages (as a retriever's top passages do across questions)."""
    rng = np.random.default_rng(seed)
    templates = {**framework_templates(), "langchain_tutorial": LANGCHAIN_TUTORIAL, "percache": ""}
    prompts: list[Prompt] = []
    budget = engine.n_ctx - 160
    tokenized = [(engine.tokenize(text), questions) for text, questions in material]
    while len(prompts) < count:
        tokens, questions = tokenized[int(rng.integers(len(tokenized)))]
        size = int(rng.choice(CHUNK_TOKENS))
        most = max(1, min(6, budget // size))
        passages = []
        many = most if rng.random() < 0.5 else int(rng.integers(1, most + 1))  # every state point is a pair
        for _ in range(many):
            start = int(rng.integers(0, max(1, len(tokens) - size)))
            passages.append(detokenize(engine, tokens[start : start + size]))
        template = TEMPLATES[len(prompts) // 3 % len(TEMPLATES)]
        for member in range(3):  # a family: the same leading passages, other questions and last passages
            if member and len(passages) > 1:
                start = int(rng.integers(0, max(1, len(tokens) - size)))
                passages = passages[:-1] + [detokenize(engine, tokens[start : start + size])]
            prompt = Prompt(template, list(passages), str(rng.choice(questions)))
            prompt.text = fill(prompt, templates[template])
            if len(engine.tokenize(prompt.text, True)) <= budget:
                prompts.append(prompt)
    return prompts[:count]


def detokenize(engine: Any, tokens: list[int]) -> str:
    """The text of *tokens* (a passage cut from a document by tokens)."""
    return b"".join(engine.token_bytes(t) for t in tokens).decode("utf-8", "replace").strip()


def fill(prompt: Prompt, template: str) -> str:
    """*prompt*'s text in *template* (PerCache's own: empty; laid out by the runner)."""
    context = "\n\n".join(prompt.passages)
    if prompt.template == "llamaindex_qa":
        return template.format(context_str=context, query_str=prompt.question)
    if prompt.template == "llamaindex_refine":
        return template.format(query_str=prompt.question, existing_answer="I do not know yet.", context_msg=context)
    if prompt.template == "langchain_tutorial":
        return template.format(question=prompt.question, context=context)
    prompt.chunks = [Chunk(f"sweep#c{i}", "sweep", text) for i, text in enumerate(prompt.passages)]
    return ""


def stock_text(stock: Any, prompt: Prompt, runner: Any, tokens: int) -> str:
    """The reference: stock's greedy text from an empty context."""
    stock.reset()
    if prompt.template == "percache":
        layout = runner.lay_out(prompt.question, prompt.chunks, max_new_tokens=tokens)
        ids = [t for segment in layout.segments for t in segment.tokens]
        return stock(ids, max_tokens=tokens, temperature=0.0)["choices"][0]["text"]
    return stock(prompt.text, max_tokens=tokens, temperature=0.0)["choices"][0]["text"]


def run_pairs(pc: PerCache, prompt: Prompt, reference: str, tokens: int) -> list[dict]:
    """Run *prompt* through *pc*'s runner once, then restoring at most 1, 2, ... segments:
    each run that restored a state, and whether its text is the reference."""
    runner = internals(pc).runner
    if prompt.template == "percache":
        layout = runner.lay_out(prompt.question, prompt.chunks, max_new_tokens=tokens)
    else:
        spec = TextPrompt(prompt.text, tuple(prompt.passages))
        layout = runner.lay_out("", [], spec=spec, max_new_tokens=tokens)
    options = RunOptions(max_new_tokens=tokens, stop=(), sampling=Sampling(), trim=False)
    pairs = []
    seen: set[int] = set()
    for depth in [None, *range(len(layout.segments) - 1, 0, -1)]:
        result = _run(runner, layout, options if depth is None else RunOptions(**{**options.__dict__, "restore_depth": depth}))
        runner.flush()  # the states this run took are stored before the next looks
        if result.reused_tokens and result.reused_tokens not in seen:
            seen.add(result.reused_tokens)
            pairs.append({"reused": result.reused_tokens, "live": result.live_tokens, "identical": result.text == reference})
    return pairs


def _run(runner: Any, layout: Any, options: RunOptions) -> Any:
    generator = runner.run(layout, options)
    while True:
        try:
            next(generator)
        except StopIteration as done:
            return done.value


def sweep_model(model: Path, material: list, args: argparse.Namespace, folder: Path) -> dict:
    engine = LlamaEngine(model, n_ctx=args.n_ctx, n_batch=512, n_threads=args.threads)
    caches = {
        kind: PerCache.open(folder / f"{model.stem}-{kind}", engine=engine,
                            config=PerCacheConfig(model_path=str(model), n_ctx=args.n_ctx, qa_bank=False,
                                                  prediction=False, chunk_state_slices=kind == "slices"))
        for kind in ("slices", "whole")
    }  # fmt: skip
    stock = stock_llama(model, args.n_ctx, args.threads)  # on the compute thread: one OpenMP team
    prompts = make_prompts(engine, material, args.prompts, seed=args.seed)
    rows, started = [], time.perf_counter()
    for index, prompt in enumerate(prompts):
        reference = stock_text(stock, prompt, internals(caches["slices"]).runner, args.tokens)
        row = {"template": prompt.template, "passages": len(prompt.passages), "question": prompt.question}
        row["prompt_tokens"] = len(engine.tokenize(prompt.text, True)) if prompt.text else None
        row["kinds"] = {kind: run_pairs(pc, prompt, reference, args.tokens) for kind, pc in caches.items()}
        rows.append(row)
        pairs = sum(len(p) for r in rows for p in r["kinds"].values())
        differed = sum(1 for r in rows for p in r["kinds"].values() for x in p if not x["identical"])
        partial = Path(args.out).with_suffix(f".{model.stem}.partial.json")  # kept while it runs
        write_json({"model": model.name, "prompts": len(rows), "pairs": pairs, "differed": differed, "rows": rows}, partial)
        print(f"{model.stem}: prompt {index + 1}/{len(prompts)}, {pairs} pairs, {differed} differed "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    stock.close()
    layout = internals(caches["slices"]).parts.runtime.self_check_report()
    for pc in caches.values():
        pc.close()
    engine.close()
    pairs = [x for r in rows for p in r["kinds"].values() for x in p]
    return {
        "model": model.name,
        "prompts": len(rows),
        "pairs": len(pairs),
        "differed": sum(1 for x in pairs if not x["identical"]),
        "past_window_pairs": sum(1 for x in pairs if x["reused"] > (engine.n_swa or 10**9)),
        "longest_restored": max((x["reused"] for x in pairs), default=0),
        "self_check": layout,
        "rows": rows,
    }


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of several runs: every run's models (a partial file is one model's),
    their pairs and differences summed.

    >>> merged = merge([{"model": "a", "prompts": 2, "pairs": 5, "differed": 0, "rows": []},
    ...                 {"models": [{"model": "b", "pairs": 7, "differed": 0}], "pairs": 7, "differed": 0}])
    >>> merged["pairs"], merged["differed"], [m["model"] for m in merged["models"]]
    (12, 0, ['a', 'b'])
    """
    models = [model for result in results for model in result.get("models") or [result]]
    return {"merged_from": len(results), "models": models,
            "pairs": sum(m["pairs"] for m in models), "differed": sum(m["differed"] for m in models)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge", nargs="+", type=Path, help="write one result of these runs' JSON instead")
    parser.add_argument("--data", type=Path, help="the folder with qmsum/ and squad11-dev/")
    parser.add_argument("--models", default="bundled,smollm2", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--prompts", type=int, default=30, help="prompts per model")
    parser.add_argument("--tokens", type=int, default=32, help="tokens generated per run")
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", default="benchmarks/results/exactness_sweep.json")
    args = parser.parse_args(argv)
    if args.merge:
        merged = merge([json.loads(path.read_text()) for path in args.merge])
        print(f"{merged['pairs']} (prompt, state) pairs in {len(args.merge)} runs, {merged['differed']} differed")
        write_json(merged, args.out)
        return 1 if merged["differed"] else 0
    if args.data is None or not (args.data / "qmsum" / "documents.jsonl").is_file():
        parser.error(f"no qmsum/documents.jsonl under {args.data}")
    if args.prompts < 1 or args.tokens < 1:
        parser.error("--prompts and --tokens must be positive")
    models = model_paths(args.models)
    material = user_material(args.data)
    results = {"machine": platform.processor() or platform.machine(), "tokens": args.tokens, "n_ctx": args.n_ctx}
    with tempfile.TemporaryDirectory() as folder:
        results["models"] = [sweep_model(model, material, args, Path(folder)) for model in models]
    results["pairs"] = sum(m["pairs"] for m in results["models"])
    results["differed"] = sum(m["differed"] for m in results["models"])
    print(f"{results['pairs']} (prompt, state) pairs tried, {results['differed']} differed from the fresh text")
    for m in results["models"]:
        print(f"  {m['model']}: {m['prompts']} prompts, {m['pairs']} pairs ({m['past_window_pairs']} past the window, "
              f"longest {m['longest_restored']} tokens restored), {m['differed']} differed")  # fmt: skip
    write_json(results, args.out)
    return 1 if results["differed"] else 0


if __name__ == "__main__":
    sys.exit(main())
