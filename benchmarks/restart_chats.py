"""Chats that last: LangChain chats on ``LlamaServer.start``, then the server and the cache
restarted, then each chat's next turn, against the same llama-server alone.

An app with a LangChain chat model on a local server keeps several conversations; each
turn sends the conversation so far (a system message with the app's passages, the earlier
questions and replies, the new question). Per model (``--models``), ``--conversations``
chats of ``--turns`` turns are asked first (not timed) through ``PerCacheChatModel`` on two
caches with default settings but for the state layout: *slices* (the default: each state
only the cells after its parent's) and *whole* (``chunk_state_slices=False``: each state
the whole slot file of its prefix). Then every server and cache is closed and started
again, and each chat's next turn is asked on three sides, one after the other with the
order rotating (this machine's speed drifts): the server alone (``llama-server`` with its
defaults and PerCache's arithmetic flags, started cold as after a restart), PerCache with
slices and PerCache with whole states. Reported: time to the first token on each side and
the ratios, whether each text is the server's fresh text (nothing reused), and each cache's
``stats()["chunk_states"]`` before the restart (budget and where it came from, evictions,
bytes, bytes per stored token against the slot's bytes per token: the duplication).

    .venv/bin/python -m benchmarks.restart_chats --data ../shared/data --models smollm2,bundled \\
        --out benchmarks/results/restart_chats.json
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from percache_core import LlamaServer, PerCache, PerCacheConfig, ServerLaunch
from percache_core.knowledge.bert import BertEmbedder
from percache_langchain import PerCacheChatModel

from .endpoint import ARITHMETIC
from .output import write_json
from .server import N_CTX, ServerAlone, fresh_chat, lc_messages, streamed_first_token_s
from .stock import QMSUM_USER, model_paths, user_rows

MAX_TOKENS = 40
LAYOUTS = ("slices", "whole")
Messages = list[tuple[str, str]]


def conversations(chunks: list[dict], questions: list[str], count: int, turns: int) -> list[list[str]]:
    """Per chat: its system message (the app's instruction and 3 passages) and its
    ``turns + 1`` questions (the last asked after the restart)."""
    chats = []
    for index in range(count):
        rng = np.random.default_rng(100 + index)
        passages = [chunks[int(i)]["text"].strip()[:900] for i in rng.choice(len(chunks), size=3, replace=False)]
        asked = [questions[int(i)] for i in rng.choice(len(questions), size=turns + 1, replace=len(questions) <= turns)]
        chats.append(["Answer the question from these meeting notes, briefly.\n\n" + "\n\n".join(passages), *asked])
    return chats


class Side:
    """PerCache on a started llama-server with one state layout, and its chat model."""

    def __init__(self, model_path: Path, folder: Path, layout: str, embedder: Any, threads: int) -> None:
        config = PerCacheConfig(
            n_ctx=N_CTX, max_new_tokens=MAX_TOKENS, prediction=False, chunk_state_slices=layout == "slices"
        )
        self.server = LlamaServer.start(model_path, ServerLaunch(n_ctx=N_CTX, n_threads=threads))
        self.pc = PerCache.open(folder / layout, config=config, engine=self.server, embedder=embedder)
        self.pc.preload()  # the cut rule and the slice check: measured once, kept on disk
        self.chat = PerCacheChatModel(percache=self.pc, max_new_tokens=MAX_TOKENS, cache=False)

    def close(self) -> None:
        self.pc.close()
        self.server.close()


def first_session(model_path: Path, folder: Path, chats: list[list[str]], embedder: Any, threads: int,
                  ) -> tuple[list[Messages], dict[str, Any]]:
    """Each chat's turns on both layouts (the replies are the fresh text, the same on
    both); the conversations so far and each cache's state statistics."""
    histories: list[Messages] = [[("system", chat[0])] for chat in chats]
    stats = {}
    for layout in LAYOUTS:
        side = Side(model_path, folder, layout, embedder, threads)
        try:
            for turn in range(len(chats[0]) - 2):
                for history, chat in zip(histories, chats):
                    messages = [*history[: 1 + 2 * turn], ("user", chat[1 + turn])]
                    reply = str(side.chat.invoke(lc_messages(messages)).content)
                    if layout == LAYOUTS[0]:
                        history += [("user", chat[1 + turn]), ("assistant", reply)]
                    elif reply != history[2 + 2 * turn][1]:
                        raise SystemExit(f"the {layout} layout's reply differs from the {LAYOUTS[0]} one's")
            stats[layout] = side.pc.stats()["chunk_states"]
        finally:
            side.close()
    return histories, stats


def next_turns(model_path: Path, folder: Path, histories: list[Messages], chats: list[list[str]], embedder: Any,
               threads: int) -> dict[str, Any]:
    """After the restart: each chat's next turn on the three sides, order rotating."""
    alone = ServerAlone(model_path, threads, ARITHMETIC)
    sides = {layout: Side(model_path, folder, layout, embedder, threads) for layout in LAYOUTS}
    ttft: dict[str, list[float]] = {name: [] for name in ("alone", *LAYOUTS)}
    identical = {layout: 0 for layout in LAYOUTS}
    reused: dict[str, list[int]] = {layout: [] for layout in LAYOUTS}
    prompt_tokens: list[int] = []
    try:
        for index, (history, chat) in enumerate(zip(histories, chats)):
            messages = [*history, ("user", chat[-1])]
            order = ["alone", *LAYOUTS]
            order = order[index % 3 :] + order[: index % 3]
            texts = {}
            for name in order:
                if name == "alone":
                    texts[name], seconds = alone.chat_first_token_s(messages, MAX_TOKENS)
                else:
                    before = sides[name].pc.stats()["reused_tokens"]
                    texts[name], seconds = streamed_first_token_s(sides[name].chat, messages)
                    reused[name].append(sides[name].pc.stats()["reused_tokens"] - before)
                ttft[name].append(seconds)
            server = sides[LAYOUTS[0]].server
            prompt_tokens.append(len(server.tokenize(server.stock_chat(messages).text, True, special=True)))
            fresh = fresh_chat(server, messages, MAX_TOKENS)
            for layout in LAYOUTS:
                identical[layout] += texts[layout] == fresh
            print(f"  chat {index + 1}: TTFT alone {ttft['alone'][-1]:.3f} s, slices {ttft['slices'][-1]:.3f} s, "
                  f"whole {ttft['whole'][-1]:.3f} s; reused {reused['slices'][-1]}/{reused['whole'][-1]}", flush=True)
    finally:
        for side in sides.values():
            side.close()
        alone.close()
    total = sum(ttft["alone"])
    return {
        "chats": len(histories),
        "ttft_s": {name: [round(s, 4) for s in values] for name, values in ttft.items()},
        "ttft_ratio": {layout: round(sum(ttft[layout]) / total, 4) for layout in LAYOUTS},
        "median_ttft_ratio": {
            layout: round(float(np.median([o / a for o, a in zip(ttft[layout], ttft["alone"])])), 4) for layout in LAYOUTS
        },
        "prompt_tokens": prompt_tokens,
        "reused_prompt_tokens": reused,
        "identical_to_fresh": identical,
    }


def bench(model_path: Path, data: Path, user: str, *, count: int, turns: int, threads: int) -> dict[str, Any]:
    chunks, questions = user_rows(data, "qmsum", user)
    chats = conversations(chunks, questions, count, turns)
    embedder = BertEmbedder()
    with tempfile.TemporaryDirectory() as folder:
        histories, stats = first_session(model_path, Path(folder), chats, embedder, threads)
        for layout, held in stats.items():
            print(f"  before the restart, {layout}: {held['nodes']} states, {held['bytes'] / 2**20:.1f} MiB, "
                  f"{held['evictions']} evictions, duplication {held['duplication']}", flush=True)
        after = next_turns(model_path, Path(folder), histories, chats, embedder, threads)
    print(f"  next turn after the restart: TTFT ratio {after['ttft_ratio']} (median {after['median_ttft_ratio']}), "
          f"identical {after['identical_to_fresh']}/{len(chats)}", flush=True)
    return {"conversations": count, "turns_before_restart": turns, "chunk_states_before_restart": stats, **after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/restart_chats.json"))
    parser.add_argument("--models", default="smollm2", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--user", default=QMSUM_USER, help="the QMSum user whose passages and questions make the chats")
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--turns", type=int, default=4, help="turns of each chat before the restart")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    if args.conversations < 1 or args.turns < 1:
        parser.error("--conversations and --turns must be at least 1")
    results: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": args.threads, "models": {}}
    for path in model_paths(args.models):
        print(f"model {path.name}", flush=True)
        results["models"][path.name] = bench(
            path, args.data, args.user, count=args.conversations, turns=args.turns, threads=args.threads
        )
    write_json(results, args.out)


if __name__ == "__main__":
    main()
