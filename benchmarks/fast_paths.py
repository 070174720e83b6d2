"""Exact and fast on every path: repeats, framework prompts, chats and drafts, side by side.

Four measurements in one run (alone on the machine), every answer checked against its
reference:

- ``repeat``: ``PerCache.answer`` on SQuAD and QMSum questions of ``--data``, asked once
  (miss) and again (an identical prompt: served from the prompt answers without the
  model); p50 latency of the repeat as a ratio of its miss, texts identical.
- ``llamaindex``: a LlamaIndex ``VectorStoreIndex`` over one SQuAD and one QMSum user,
  queried through ``index.as_query_engine`` with stock ``llama_cpp.Llama`` (wrapped as a
  LlamaIndex LLM, same GGUF, greedy, same stop and token limit, same threads) and through
  ``PerCacheQueryEngine`` with ``PerCacheLlamaCPP``: first-ask time ratio and identical
  texts; then the same questions again (repeats) and the time of questions whose nodes
  earlier questions shared (states restored).
- ``chat``: ``PerCacheChatModel`` with a ~300-token system message, one session of four
  turns and three new sessions on the same cache: time to first token of each new
  session's first answer as a ratio of the first session's, tokens restored per turn, and
  every answer against the same chat with every cache off.
- ``drafts``: tokens/s of decoding with and without draft verification (QA-bank answers of
  the same questions as drafts, and prompt lookup), tokens identical, and whether this
  engine's self-check switches drafts on by default.

    .venv/bin/python -m benchmarks.fast_paths --data ../shared/data --out benchmarks/results/fast_paths.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from percache_core import PerCache, PerCacheConfig
from percache_core.engines.llama_cpp.drafting import known_bound, known_drafts_pay
from percache_core.engines.llama_cpp.engine import LlamaEngine
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder
from percache_core.kv.cuts import measure_cut_rule
from percache_core.models import resolve_model_path
from percache_core.types import ANSWERED_BEFORE

from .data_sets import read_jsonl
from .output import write_json
from .stock import stock_llama

SQUAD_USER = "Construction"
QMSUM_USER = "ami-ES2011"
SYSTEM_MESSAGE = (
    "You are Maya's assistant on her laptop. You know her calendar, her team and her projects. "
    "Maya leads the field-study team at a small research institute; her colleagues are Lena "
    "Okafor (travel and budgets), Priya Natarajan (hiring), Tom Weiss (finance) and Sam Ito "
    "(logistics). The quarterly review is on Thursday at 10 am in room 4. The field study in "
    "Porto starts on the 12th and needs the van, which Sam books. Finance approved 18,500 "
    "euros for it; invoices go to Tom by Friday. The rehearsal of the launch talk is on "
    "Saturday at 4 pm in the Birch room. Maya prefers short answers, names and times first, "
    "and never more than two sentences. When you do not know, say so in one sentence and "
    "suggest whom to ask. Reply in English. Do not invent meetings, numbers or people. "
    "Keep private details (salaries, health) out of group messages. Today is Tuesday. "
    "This week: Monday was the budget call with Tom; Wednesday has the hiring panel with "
    "Priya at 2 pm in room 2; Friday is the deadline for the Porto travel forms, which Lena "
    "collects. The team channel is for logistics only; personal questions go to Maya "
    "directly. Meetings run in Central European Time. Room 4 is on the third floor, the "
    "Birch room on the ground floor next to the kitchen."
)
CHAT_TURNS = (
    "When is the quarterly review?",
    "Who books the van?",
    "And where is the rehearsal?",
    "Who should get the invoices?",
)
NEW_SESSIONS = ("Where does the field study happen?", "Who handles hiring?", "How much did finance approve?")



def user_data(data: Path, dataset: str, user: str, questions: int) -> tuple[list[dict], list[str]]:
    documents = [
        {"id": r["doc_id"], "text": r["text"]}
        for r in read_jsonl(data / dataset / "documents.jsonl")
        if r["user"] == user
    ]
    asked: list[str] = []
    for row in read_jsonl(data / dataset / "queries.jsonl"):
        if row["user"] == user and row["question"] not in asked:
            asked.append(row["question"])
    if not documents or not asked:
        raise SystemExit(f"no documents or questions of user {user!r} in {data / dataset}")
    rng = np.random.default_rng(0)
    picked = sorted(rng.choice(len(asked), size=min(questions, len(asked)), replace=False))
    return documents, [asked[i] for i in picked]


def p50(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


# -- repeats ----------------------------------------------------------------------------------


def bench_repeat(engine: LlamaEngine, embedder: Any, users: list[tuple[str, list[dict], list[str]]]) -> dict:
    rows = []
    for name, documents, questions in users:
        with tempfile.TemporaryDirectory() as folder:
            pc = PerCache.open(folder, config=PerCacheConfig(max_new_tokens=64), engine=engine, embedder=embedder)
            pc.add_documents(documents)
            for question in questions:
                miss = pc.answer(question)
                repeat = pc.answer(question)
                rows.append(
                    {
                        "user": name,
                        "miss_s": miss.latency_s,
                        "repeat_s": repeat.latency_s,
                        "repeat_source": repeat.source,
                        "identical": repeat.text == miss.text,
                        "repeat_timings": repeat.timings,
                    }
                )
            pc.close()
    miss, again = [r["miss_s"] for r in rows], [r["repeat_s"] for r in rows]
    return {
        "questions": len(rows),
        "miss_p50_s": p50(miss),
        "repeat_p50_s": p50(again),
        "repeat_over_miss_p50": p50(again) / p50(miss),
        "served_without_model": sum(r["repeat_source"] in ANSWERED_BEFORE for r in rows),
        "identical": sum(r["identical"] for r in rows),
        "rows": rows,
    }


# -- LlamaIndex against stock llama.cpp ------------------------------------------------------


def stock_llm(model_path: Path, max_tokens: int, threads: int) -> tuple[Any, Any]:
    """``llama_cpp.Llama`` as two LlamaIndex LLMs on one model, greedy, with the same stop
    and token limit: one prefills each prompt in one call (reset first), the other as
    ``Llama`` does by default (it keeps the previous prompt's longest common prefix)."""
    from llama_index.core.base.llms.types import CompletionResponse, LLMMetadata
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.llms.custom import CustomLLM

    model = stock_llama(model_path, 2048, threads)

    class StockLlamaCPP(CustomLLM):
        reset: bool = True

        @property
        def metadata(self) -> LLMMetadata:
            return LLMMetadata(context_window=2048, num_output=max_tokens, model_name=model_path.name)

        @llm_completion_callback()
        def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
            if self.reset:
                model.reset()  # one call for the whole prompt (Llama otherwise keeps the last prompt's prefix)
            out = model.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stop=["\n"])
            return CompletionResponse(text=out["choices"][0]["text"])

        @llm_completion_callback()
        def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any):
            raise NotImplementedError

    return StockLlamaCPP(), StockLlamaCPP(reset=False)


def bench_llamaindex(
    engine: LlamaEngine, embedder: Any, model_path: Path, users: list[tuple[str, list[dict], list[str]]]
) -> dict:
    from llama_index.core import Document, VectorStoreIndex

    from percache_llamaindex import PerCacheEmbedding, PerCacheLlamaCPP, PerCacheQueryEngine

    max_tokens = 64
    stock, stock_reusing = stock_llm(model_path, max_tokens, os.cpu_count() or 1)  # PerCache's engine uses every core
    ours = PerCacheLlamaCPP(engine=engine, max_new_tokens=max_tokens)
    rows = []
    for name, documents, questions in users:
        index = VectorStoreIndex.from_documents(
            [Document(text=d["text"], doc_id=d["id"]) for d in documents], embed_model=PerCacheEmbedding(embedder)
        )
        plain = index.as_query_engine(llm=stock)
        reusing = index.as_query_engine(llm=stock_reusing)
        with tempfile.TemporaryDirectory() as folder:
            cached = PerCacheQueryEngine.from_index(index, cache_dir=folder, llm=ours)
            seen: set[str] = set()
            for rounds in ("first", "repeat"):
                for question in questions:
                    # stock llama.cpp as users run it: the previous prompt's prefix kept
                    default_text = reusing.query(question).response if rounds == "first" else None
                    started = time.perf_counter()
                    reference = plain.query(question)
                    stock_s = time.perf_counter() - started
                    started = time.perf_counter()
                    response = cached.query(question)
                    ours_s = time.perf_counter() - started
                    nodes = {n.node.node_id for n in response.source_nodes}
                    info = response.metadata["percache"]
                    rows.append(
                        {
                            "user": name,
                            "round": rounds,
                            "stock_s": stock_s,
                            "percache_s": ours_s,
                            "identical": response.response == reference.response,
                            "stock_text": reference.response,
                            "percache_text": response.response,
                            "source": info["source"],
                            "reused_tokens": info.get("reused_tokens", 0),
                            "shares_nodes": rounds == "first" and bool(nodes & seen),
                            "stock_default_identical": default_text == reference.response,
                        }
                    )
                    seen |= nodes
            cached.close()
    first = [r for r in rows if r["round"] == "first"]
    repeat = [r for r in rows if r["round"] == "repeat"]
    sharing = [r for r in first if r["shares_nodes"]]
    new = [r for r in first if not r["shares_nodes"]]

    def ratio(subset: list[dict]) -> float:
        return sum(r["percache_s"] for r in subset) / max(1e-9, sum(r["stock_s"] for r in subset))

    return {
        "stock": "llama_cpp.Llama (defaults: weights repacked), reset before each prompt (one call), "
        "n_threads as PerCache's, greedy, stop ['\\n']",
        "questions": len(first),
        "first_ask_time_ratio": ratio(first),
        "first_ask_identical": sum(r["identical"] for r in first),
        "stock_with_prefix_reuse_identical_to_one_call": sum(r["stock_default_identical"] for r in first),
        "new_nodes_time_ratio": ratio(new),
        "shared_nodes_time_ratio": ratio(sharing),
        "shared_nodes_questions": len(sharing),
        "repeat_time_ratio": ratio(repeat),
        "repeat_identical": sum(r["identical"] for r in repeat),
        "rows": rows,
    }


# -- chat ---------------------------------------------------------------------------------------


def bench_chat(engine: LlamaEngine, embedder: Any) -> dict:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    from percache_langchain import PerCacheChatModel

    def session_turns(chat: Any, pc: PerCache, turns: tuple[str, ...]) -> list[dict]:
        messages: list[Any] = [SystemMessage(SYSTEM_MESSAGE)]
        out = []
        for turn in turns:
            messages.append(HumanMessage(turn))
            before = pc.stats()
            started = time.perf_counter()
            first_token = None
            text = ""
            for chunk in chat.stream(messages):
                if chunk.content and first_token is None:
                    first_token = time.perf_counter() - started
                text += chunk.content
            after = pc.stats()
            messages.append(AIMessage(text))
            out.append(
                {
                    "turn": turn,
                    "text": text,
                    "ttft_s": first_token if first_token is not None else time.perf_counter() - started,
                    "reused_tokens": after["reused_tokens"] - before["reused_tokens"],
                    "prefilled_tokens": after["prefilled_tokens"] - before["prefilled_tokens"],
                }
            )
        return out

    with tempfile.TemporaryDirectory() as folder:
        off = PerCache.open(
            Path(folder) / "off",
            config=PerCacheConfig(qa_bank=False, chunk_states=False),
            engine=engine,
            embedder=embedder,
        )
        on = PerCache.open(Path(folder) / "on", config=PerCacheConfig(), engine=engine, embedder=embedder)
        reference_chat = PerCacheChatModel(percache=off, max_new_tokens=32, stop=["\n"])
        chat = PerCacheChatModel(percache=on, max_new_tokens=32, stop=["\n"])
        sessions = [session_turns(chat, on, CHAT_TURNS)]
        references = [session_turns(reference_chat, off, CHAT_TURNS)]
        for question in NEW_SESSIONS:
            sessions.append(session_turns(chat, on, (question, "Thanks. Anything else I should know?")))
            references.append(session_turns(reference_chat, off, (question, "Thanks. Anything else I should know?")))
        system_tokens = len(engine.tokenize(SYSTEM_MESSAGE))
        on.close()
        off.close()
    identical = sum(
        a["text"] == b["text"] for got, want in zip(sessions, references) for a, b in zip(got, want)
    )
    first_ttft = sessions[0][0]["ttft_s"]
    new_ttfts = [s[0]["ttft_s"] for s in sessions[1:]]
    return {
        "system_message_tokens": system_tokens,
        "first_session_first_ttft_s": first_ttft,
        "cache_off_first_ttft_s": [s[0]["ttft_s"] for s in references],
        "new_session_first_ttft_s": new_ttfts,
        "new_session_ttft_ratio_p50": p50(new_ttfts) / first_ttft,
        "later_turns_reused_tokens": [t["reused_tokens"] for t in sessions[0][1:]],
        "answers": sum(len(s) for s in sessions),
        "identical_to_cache_off": identical,
        "sessions": sessions,
    }


# -- drafts -------------------------------------------------------------------------------------


def bench_drafts(engine: LlamaEngine, embedder: Any, documents: list[dict], questions: list[str]) -> dict:
    results: dict[str, Any] = {
        "self_check_drafts_pay": known_drafts_pay(engine),
        "deviation_bound_logits": known_bound(engine),
    }
    with tempfile.TemporaryDirectory() as folder:
        runs: dict[str, list[Any]] = {}
        for name, settings in {
            "plain": {"draft_decoding": "off"},
            "answer_drafts": {"draft_decoding": "on"},
            "prompt_lookup": {"draft_decoding": "on", "prompt_lookup": True, "qa_bank": False},
        }.items():
            pc = PerCache.open(
                Path(folder) / name,
                config=PerCacheConfig(max_new_tokens=64, chunk_states=False, **settings),
                engine=engine,
                embedder=embedder,
            )
            pc.add_documents(documents)
            if name == "answer_drafts":
                for question in questions:  # the stored answers become drafts of the same questions
                    pc.answer(question)
            answers = []
            for question in questions:
                internals(pc).parts.prompt_answers.clear()  # no prompt answer: the model runs with the drafts
                answers.append(pc.answer(question))
            runs[name] = answers
            pc.close()
    plain = runs["plain"]
    for name in ("plain", "answer_drafts", "prompt_lookup"):
        answers = runs[name]
        decode_s = sum(a.timings.get("decode", 0.0) for a in answers)
        tokens = sum(a.generated_tokens for a in answers)
        results[name] = {
            "decode_tokens_per_s": tokens / max(1e-9, decode_s),
            "draft_tokens_accepted": sum(a.draft_tokens_accepted for a in answers),
            "tokens": tokens,
            "identical_to_plain": sum(a.text == b.text for a, b in zip(answers, plain)),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--questions", type=int, default=12, help="questions per user")
    parser.add_argument("--parts", default="repeat,llamaindex,chat,drafts")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fast_paths.json"))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    model_path = resolve_model_path(None)
    engine = LlamaEngine(model_path)
    embedder = BertEmbedder()
    embedder.embed(["warm-up"])
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:  # the engine's self-checks, as preload() runs them
        PerCache.open(folder, engine=engine, embedder=embedder).preload()
    result: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "model": model_path.name,
        "cut_rule": str(measure_cut_rule(engine)),
        "self_check_s": time.perf_counter() - started,
    }
    squad = user_data(args.data, "squad11-dev", SQUAD_USER, args.questions)
    qmsum = user_data(args.data, "qmsum", QMSUM_USER, args.questions)
    users = [("squad/" + SQUAD_USER, *squad), ("qmsum/" + QMSUM_USER, *qmsum)]
    if "repeat" in parts:
        result["repeat"] = bench_repeat(engine, embedder, users)
        print("repeat", json.dumps({k: v for k, v in result["repeat"].items() if k != "rows"}))
    if "llamaindex" in parts:
        result["llamaindex"] = bench_llamaindex(engine, embedder, model_path, users)
        print("llamaindex", json.dumps({k: v for k, v in result["llamaindex"].items() if k != "rows"}))
    if "chat" in parts:
        result["chat"] = bench_chat(engine, embedder)
        print("chat", json.dumps({k: v for k, v in result["chat"].items() if k != "sessions"}))
    if "drafts" in parts:
        result["drafts"] = bench_drafts(engine, embedder, *squad)
        print("drafts", json.dumps(result["drafts"]))
    print("written to", write_json(result, args.out))


if __name__ == "__main__":
    main()
