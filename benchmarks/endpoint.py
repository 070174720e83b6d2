"""``percache serve`` against the llama-server alone, both called through LangChain ``ChatOpenAI``.

What an app that calls a local server runs today is ``llama-server -m model.gguf`` with its
own caches on (``cache_prompt``: the slot reuses the longest common prefix with the previous
prompt; ``--cache-ram``: older prompts' states in RAM, 8 GiB by default) and an OpenAI client
pointed at it. The PerCache side is the same client pointed at the endpoint (``create_app``
over ``LlamaServer.start`` and ``PerCache.open``); only the URL differs. Both servers come
from the same binary, model, threads and the flags that set the model's arithmetic
(``-b 512 -ub 512 --swa-full``, which ``LlamaServer.start`` uses: on Gemma 3 ``--swa-full``
alone changed 4 of 20 fresh replies against the server's defaults, so a server with other
flags is another reference), and each prompt goes to both, one after the other, the order
alternating (this machine's speed drifts). The app's documents (the user's QMSum passages)
are given to the endpoint's cache folder, as ``percache ingest`` does. Both stream; reported per workload: the
total seconds and the time to the first piece on each side, their ratios, and how many texts
equal *the fresh text* (the server alone answering the same request with ``cache_prompt:
false``: nothing reused).

Workloads (``--data``, QMSum passages; ``--workloads`` picks some): ``first asks`` (new
chats' first turns: passages and a question), ``back to back`` (new chats' first turns, no
two sharing a passage, in pairs, each side sending a pair's second right after the first's
reply: what the states taken after a reply cost the next request), ``chat turns`` (one chat's later turns, the conversation so far in each
prompt), ``repeats`` (the whole chat asked again), ``concurrent`` (4 clients at once, each its own questions; errors and texts),
``restart`` (a chat's first turn, then both servers and the endpoint restarted, then the
chat's next turn), ``shared tier`` (the chat asked on a second endpoint, with its own server
and cache folder, that shares one Redis with the first), ``load`` (1, 4 and 8 clients at once,
``--requests`` each, half of the clients asking about passages the others ask about too: a
llama-server started with its defaults alone, against ``percache serve`` in front of one
started the same way with ``--slot-save-path``, fresh servers for each side and count; wall
time, p50/p95 latency, errors).

    .venv/bin/python -m benchmarks.endpoint --data ../shared/data --out benchmarks/results/endpoint.json
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from langchain_openai import ChatOpenAI

from percache_core import LlamaServer, PerCache, PerCacheConfig, ServerLaunch
from percache_core.endpoint.serve import serving_in_thread
from percache_core.engines.llama_server.server import free_port
from percache_core.inspection import internals
from percache_core.knowledge.bert import BertEmbedder

from .output import write_json
from .server import N_CTX, ServerAlone, lc_messages
from .stock import QMSUM_USER, model_paths, rag_chat_turns, user_rows

MAX_TOKENS = 40
ARITHMETIC = ("-b", "512", "-ub", "512", "--swa-full")  # LlamaServer.start's flags that change numbers
Messages = list[tuple[str, str]]
WORKLOADS = ("first asks", "back to back", "chat turns", "repeats", "concurrent", "restart", "shared tier", "load")
LOAD_CLIENTS = (1, 4, 8)


@contextmanager
def endpoint(model_path: Path, cache: Path, threads: int, embedder: Any, documents: list[dict[str, Any]],
             shared_url: str | None = None) -> Iterator[str]:
    """``percache serve`` on *model_path* with the cache folder *cache* holding *documents*
    (and the Redis tier at *shared_url*): its base URL."""
    shared = {"shared_url": shared_url, "shared_secret": "endpoint-benchmark-secret"} if shared_url else {}
    config = PerCacheConfig(n_ctx=N_CTX, prediction=False, **shared)
    server = LlamaServer.start(model_path, ServerLaunch(n_ctx=N_CTX, n_threads=threads))
    pc = PerCache.open(cache, config=config, engine=server, embedder=embedder)
    pc.preload()  # the server's cut rule: measured once per build and model, kept on disk
    if not pc.chunk_count:
        pc.add_documents(documents, split=False)
    try:
        with serving_in_thread(pc, server) as url:
            yield url
    finally:
        pc.close()
        server.close()


def client(url: str, **extra: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=url, api_key="none", model=extra.pop("model", "model"), temperature=0,
                      max_tokens=MAX_TOKENS, max_retries=0, timeout=600, **extra)


def streamed(chat: ChatOpenAI, messages: Messages) -> tuple[str, float, float]:
    """(text, seconds to the first piece, seconds in all) of *messages* streamed."""
    started, first, text = time.perf_counter(), None, ""
    for piece in chat.stream(lc_messages(messages)):
        if piece.content and first is None:
            first = time.perf_counter() - started
        text += str(piece.content)
    total = time.perf_counter() - started
    return text, first if first is not None else total, total


def side_by_side(name: str, prompts: list[Messages], ours: ChatOpenAI, alone: ChatOpenAI, fresh: ChatOpenAI,
                 *, first: int = 0, group: int = 1) -> dict[str, Any]:
    """Each prompt to both sides (alone first on even prompts, counted from *first*), then
    the fresh text (not timed). With *group* > 1 the prompts go in groups, each side sending
    a group's prompts back to back (the order alternating per group), and the row also sums
    the later prompts of each group alone (``back_to_back_*``: each sent as soon as the one
    before it on the same side had its reply)."""
    sums = {"percache_s": 0.0, "server_alone_s": 0.0, "percache_ttft_s": 0.0, "server_alone_ttft_s": 0.0}
    later = {"ours": 0.0, "alone": 0.0}
    same = alone_same = 0
    for index in range(0, len(prompts), group):
        batch = prompts[index : index + group]
        runs: dict[str, list[tuple[str, float, float]]] = {}
        for side in (("alone", "ours") if (index // group + first) % 2 == 0 else ("ours", "alone")):
            runs[side] = [streamed(alone if side == "alone" else ours, messages) for messages in batch]
            later[side] += sum(run[2] for run in runs[side][1:])
        for position, messages in enumerate(batch):
            reference = str(fresh.invoke(lc_messages(messages)).content)
            ours_run, alone_run = runs["ours"][position], runs["alone"][position]
            sums["percache_s"] += ours_run[2]
            sums["server_alone_s"] += alone_run[2]
            sums["percache_ttft_s"] += ours_run[1]
            sums["server_alone_ttft_s"] += alone_run[1]
            same += ours_run[0] == reference
            alone_same += alone_run[0] == reference
    row: dict[str, Any] = {"workload": name, "prompts": len(prompts), **{k: round(v, 3) for k, v in sums.items()}}
    row["ratio"] = round(sums["percache_s"] / sums["server_alone_s"], 4)
    row["ttft_ratio"] = round(sums["percache_ttft_s"] / sums["server_alone_ttft_s"], 4)
    row["percache_identical_to_fresh"] = same
    row["server_alone_identical_to_fresh"] = alone_same
    if group > 1:
        row["back_to_back_percache_s"], row["back_to_back_server_alone_s"] = round(later["ours"], 3), round(later["alone"], 3)
        row["back_to_back_ratio"] = round(later["ours"] / later["alone"], 4)
    print(f"  {name:12s} PerCache {row['percache_s']:7.2f} s  alone {row['server_alone_s']:7.2f} s  ratio {row['ratio']}"
          f"  TTFT ratio {row['ttft_ratio']}  = fresh {same}/{len(prompts)} (alone {alone_same})"
          + (f"  back to back {row['back_to_back_ratio']}" if group > 1 else ""), flush=True)
    return row


def chat_prompts(sessions: list[Messages], fresh: ChatOpenAI) -> list[Messages]:
    """The turns of one chat: turn i holds the earlier questions and their (fresh) replies."""
    history: Messages = []
    prompts = []
    for session in sessions:
        messages = session[:1] + history + session[1:]
        prompts.append(messages)
        history += [session[1], ("assistant", str(fresh.invoke(lc_messages(messages)).content))]
    return prompts


def bench(model_path: Path, data: Path, *, turns: int, restarts: int, clients: int, requests: int,
          threads: int, workloads: set[str], load_clients: tuple[int, ...] = LOAD_CLIENTS,
          invariant: bool = False, load_rounds: int = 2) -> list[dict[str, Any]]:
    chunks, questions = user_rows(data, "qmsum", QMSUM_USER)
    sessions = rag_chat_turns(chunks, questions, turns + 2 * restarts)
    # new chats that share no passage with each other or the chats above (every other turn of
    # a longer chat: its turns share their first passage in twos), so that a pair's second
    # request finds nothing of the first's to reuse, on either side
    pairs = rag_chat_turns(chunks, questions, 4 * turns, seed=8)[::2]
    documents = [{"id": row["doc_id"], "text": row["text"].strip()} for row in chunks]
    embedder = BertEmbedder()
    fresh_extra = {"extra_body": {"cache_prompt": False}}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"
        reference = ServerAlone(model_path, threads, ARITHMETIC)  # the fresh texts (never timed: a server of its own,
        fresh = client(f"http://127.0.0.1:{reference.port}/v1", **fresh_extra)  # so no timed side saw a prompt)
        needs_chat = workloads & {"chat turns", "repeats", "concurrent", "shared tier"}
        prompts = chat_prompts(sessions, fresh) if needs_chat else []  # (a fresh reply per turn: minutes)
        alone_server = ServerAlone(model_path, threads, ARITHMETIC)
        alone = client(f"http://127.0.0.1:{alone_server.port}/v1")
        with endpoint(model_path, cache, threads, embedder, documents) as url:
            ours = client(url, model=str(model_path))
            if "first asks" in workloads:
                rows.append(side_by_side("first asks", [list(s) for s in sessions[:turns]], ours, alone, fresh))
            if "back to back" in workloads:
                rows.append(side_by_side("back to back", [list(s) for s in pairs], ours, alone, fresh, group=2))
            if "chat turns" in workloads:
                rows.append(side_by_side("chat turns", prompts[1:turns], ours, alone, fresh, first=1))
            if "repeats" in workloads:
                rows.append(side_by_side("repeats", prompts[:turns], ours, alone, fresh))
            if "concurrent" in workloads:
                rows.append(concurrent(url, str(model_path), prompts[0], questions, fresh, clients, requests))
        alone_server.close()
        if "restart" in workloads:
            rows.append(restart(model_path, cache, sessions[turns:], fresh, threads, embedder, documents))
        if "shared tier" in workloads:
            rows.append(shared_tier(model_path, Path(folder), prompts[:turns], fresh, threads, embedder, documents))
        if "load" in workloads:
            rows += [load(model_path, Path(folder), sessions, (count, requests), threads, fresh, rounds=load_rounds,
                          invariant=invariant)
                     for count in load_clients]
        reference.close()
    return rows


def restart(model_path: Path, cache: Path, sessions: list[Messages], fresh: ChatOpenAI, threads: int,
            embedder: Any, documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Per session: its first turn on both sides, then both servers and the endpoint
    restarted, then the chat's next turn (the first turn, its reply, a new question)."""
    parts = []
    for index, (system, question) in enumerate(zip(sessions[::2], sessions[1::2])):
        first = [system[0], system[1]]
        reply = str(fresh.invoke(lc_messages(first)).content)
        returning = [*first, ("assistant", reply), question[1]]
        for phase in ("before", "after"):
            alone_server = ServerAlone(model_path, threads, ARITHMETIC)
            alone_url = f"http://127.0.0.1:{alone_server.port}/v1"
            with endpoint(model_path, cache, threads, embedder, documents) as url:
                ours = client(url, model=str(model_path))
                if phase == "before":
                    streamed(ours, first), streamed(client(alone_url), first)
                else:
                    parts.append(side_by_side(f"restart {index + 1}", [returning], ours, client(alone_url), fresh,
                                              first=index))
            alone_server.close()
    return merged("restart", parts)


def shared_tier(model_path: Path, folder: Path, prompts: list[Messages], fresh: ChatOpenAI, threads: int,
                embedder: Any, documents: list[dict[str, Any]]) -> dict[str, Any]:
    """Two endpoints (two servers, two cache folders) sharing one Redis: the chat asked on
    the first, then on the second, side by side with a server alone that has not seen it."""
    port = free_port("127.0.0.1")
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shared_url = f"redis://127.0.0.1:{port}/0"
    time.sleep(0.5)
    try:
        with endpoint(model_path, folder / "first", threads, embedder, documents, shared_url) as url:
            first = client(url, model=str(model_path))
            for messages in prompts:
                streamed(first, messages)
        alone_server = ServerAlone(model_path, threads, ARITHMETIC)
        try:
            with endpoint(model_path, folder / "second", threads, embedder, documents, shared_url) as url:
                return side_by_side("shared tier", prompts, client(url, model=str(model_path)),
                                    client(f"http://127.0.0.1:{alone_server.port}/v1"), fresh)
        finally:
            alone_server.close()
    finally:
        redis.terminate()
        redis.wait(timeout=30)


def merged(name: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    row: dict[str, Any] = {"workload": name, "prompts": sum(r["prompts"] for r in parts)}
    for key in ("percache_s", "server_alone_s", "percache_ttft_s", "server_alone_ttft_s",
                "percache_identical_to_fresh", "server_alone_identical_to_fresh"):
        row[key] = round(sum(r[key] for r in parts), 3)
    row["ratio"] = round(row["percache_s"] / row["server_alone_s"], 4)
    row["ttft_ratio"] = round(row["percache_ttft_s"] / row["server_alone_ttft_s"], 4)
    row["runs"] = parts
    return row


def concurrent(url: str, model: str, first_turn: Messages, questions: list[str], fresh: ChatOpenAI,
               clients: int, requests: int) -> dict[str, Any]:
    """*clients* clients at once, *requests* each (their questions cycle, so later ones are
    repeats): errors, and texts other than the fresh text."""
    def asks(index: int) -> list[Messages]:
        own = questions[index::clients][:5] or questions[:1]
        return [first_turn[:1] + [("user", own[n % len(own)])] for n in range(requests)]

    def run(index: int) -> list[str | BaseException]:
        chat = client(url, model=model)
        out: list[str | BaseException] = []
        for messages in asks(index):
            try:
                out.append(streamed(chat, messages)[0] if len(out) % 2 else str(chat.invoke(lc_messages(messages)).content))
            except Exception as error:  # counted, not raised: the row reports errors
                out.append(error)
        return out

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(run, range(clients)))
    seconds = time.perf_counter() - started
    references: dict[str, str] = {}
    errors = different = 0
    for index, texts in enumerate(results):
        for messages, text in zip(asks(index), texts):
            if isinstance(text, BaseException):
                errors += 1
                continue
            key = repr(messages)
            if key not in references:
                references[key] = str(fresh.invoke(lc_messages(messages)).content)
            different += text != references[key]
    row = {"workload": "concurrent", "clients": clients, "requests": clients * requests, "seconds": round(seconds, 2),
           "errors": errors, "different_from_fresh": different}
    print(f"  concurrent   {clients} clients x {requests}: {seconds:.1f} s, {errors} errors, "
          f"{different} different from fresh", flush=True)
    return row


def load(model_path: Path, folder: Path, sessions: list[Messages], shape: tuple[int, int], threads: int,
         fresh: ChatOpenAI, rounds: int = 2, invariant: bool = False) -> dict[str, Any]:
    """*shape* = (clients, requests each) at once (client i asks session i // 2's passages
    with its own questions: pairs share passages), on a default server alone and through
    ``percache serve`` in front of one (*invariant*: in front of a 4-slot server it starts
    batch-invariant, ``ServerLaunch(batch_invariant=True)``), each on fresh servers, *rounds*
    times with the order of the sides alternating (alone first, then PerCache first: this
    machine's speed drifts); the sides' wall times summed. With one client (every request
    alone) the replies are compared with the fresh text (and, on the invariant launch, with
    that launch's own: a one-slot server of it, nothing reused)."""
    clients, requests = shape
    asks = load_asks(sessions, clients, requests)
    row: dict[str, Any] = {"workload": "load", "clients": clients, "requests": clients * requests, "rounds": rounds,
                           "batch_invariant": invariant}
    measured: dict[str, list[tuple[float, list[float], int, list[list[str]]]]] = {"server_alone": [], "percache": []}
    for index in range(rounds):
        for side in (("alone", "percache") if index % 2 == 0 else ("percache", "alone")):
            slot_folder = folder / f"slots-{side}-{clients}-{index}"
            slot_folder.mkdir()
            slots = ("--slot-save-path", str(slot_folder)) if side == "percache" else ()
            server: ServerAlone | LlamaServer
            if side == "percache" and invariant:
                server = attached = LlamaServer.start(model_path, ServerLaunch(
                    n_slots=4, n_threads=threads, slot_save_path=slot_folder, batch_invariant=True))
            else:
                server = ServerAlone(model_path, threads, slots, server_defaults=True)
                attached = LlamaServer(url=f"http://127.0.0.1:{server.port}", slot_save_path=slot_folder)
            try:
                if side == "alone":
                    measured["server_alone"].append(load_side(attached.url + "/v1", asks))
                else:
                    with PerCache.open(folder / f"cache-{clients}-{index}", config=PerCacheConfig(prediction=False),
                                       engine=attached) as pc, serving_in_thread(pc, attached) as url:
                        pc.preload()
                        measured["percache"].append(load_side(url, asks))
                        row["slots_used"] = attached.leases.count
                        runner = internals(pc).runtime.runner
                        row["batched_runs"] = row.get("batched_runs", 0) + runner.batched_runs
                        row["prefix_waits"] = row.get("prefix_waits", 0) + runner.prefix_waits
                        row["company_waits"] = row.get("company_waits", 0) + runner.company_waits
            finally:
                server.close()
    for name, runs in measured.items():
        latencies = sorted(t for _, times, _, _ in runs for t in times) or [0.0]
        row.update({f"{name}_s": round(sum(seconds for seconds, *_ in runs), 2),
                    f"{name}_p50_s": round(latencies[len(latencies) // 2], 3),
                    f"{name}_p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 3),
                    f"{name}_errors": sum(errors for _, _, errors, _ in runs)})
    row["ratio"] = round(row["percache_s"] / row["server_alone_s"], 4)
    row["round_ratios"] = [round(ours[0] / alone[0], 4) for ours, alone in zip(measured["percache"], measured["server_alone"])]
    if clients == 1:
        references = [str(fresh.invoke(lc_messages(m)).content) for m in asks[0]]
        for name, runs in measured.items():
            row[f"{name}_identical_to_fresh"] = sum(a == b for _, _, _, texts in runs for a, b in zip(texts[0], references))
        if invariant:  # that launch's own fresh text: a one-slot server of it, nothing reused
            with LlamaServer.start(model_path, ServerLaunch(n_slots=1, n_threads=threads, batch_invariant=True)) as own:
                own_fresh = client(own.url + "/v1", extra_body={"cache_prompt": False})
                references = [str(own_fresh.invoke(lc_messages(m)).content) for m in asks[0]]
            row["percache_identical_to_launch_fresh"] = sum(
                a == b for _, _, _, texts in measured["percache"] for a, b in zip(texts[0], references))
    print(f"  load {clients} clients: PerCache {row['percache_s']:.1f} s, alone {row['server_alone_s']:.1f} s, "
          f"ratio {row['ratio']} (rounds {row['round_ratios']}), errors {row['percache_errors']}/{row['server_alone_errors']}", flush=True)
    return row


def load_asks(sessions: list[Messages], clients: int, requests: int) -> list[list[Messages]]:
    """Each of *clients*' *requests*: client i asks session i // 2's passages (pairs of
    clients share passages, and the passages come again every few rounds) with its own
    questions."""
    return [[list(sessions[(c // 2 + n * clients) % len(sessions)][:1])
             + [("user", sessions[(c + n) % len(sessions)][1][1])] for n in range(requests)] for c in range(clients)]


def load_side(url: str, asks: list[list[Messages]]) -> tuple[float, list[float], int, list[list[str]]]:
    """The clients' *asks* at once against *url*: (wall seconds, each request's latency,
    errors, each client's texts)."""
    latencies: list[float] = []
    errors = 0

    def run(own: list[Messages]) -> list[str]:
        nonlocal errors
        chat, texts = client(url), []
        for messages in own:
            started = time.perf_counter()
            try:
                texts.append(str(chat.invoke(lc_messages(messages)).content))
                latencies.append(time.perf_counter() - started)
            except Exception:  # counted: the row reports errors
                errors += 1
                texts.append("")
        return texts

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(asks)) as pool:
        texts = list(pool.map(run, asks))
    return time.perf_counter() - started, latencies, errors, texts


def plot(results: dict[str, Any], path: Path) -> None:
    """Bars: PerCache's time over the server alone's per workload (total and first piece)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = results["models"]
    figure, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 3.6), squeeze=False)
    for axis, (name, rows) in zip(axes[0], models.items()):
        timed = [r for r in rows if "ttft_ratio" in r]
        x = range(len(timed))
        axis.bar([i - 0.2 for i in x], [r["ratio"] for r in timed], 0.4, label="total")
        axis.bar([i + 0.2 for i in x], [r["ttft_ratio"] for r in timed], 0.4, label="first piece")
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set_xticks(list(x), [r["workload"] for r in timed])
        axis.set_ylabel("PerCache endpoint / llama-server alone")
        axis.set_title(name, fontsize=9)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/endpoint.json"))
    parser.add_argument("--models", default="bundled", help="bundled, smollm2 or GGUF paths, comma-separated")
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=50, help="requests per concurrent client")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--load-clients", default=",".join(map(str, LOAD_CLIENTS)),
                        help="the load workload's client counts, comma-separated")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the load workload's PerCache side on a server it starts batch-invariant "
                             "(make llama-server-invariant)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    parser.add_argument("--load-rounds", type=int, default=2,
                        help="rounds of the load workload, each on fresh servers, the sides' order alternating")
    args = parser.parse_args()
    if args.load_rounds < 1:
        parser.error(f"--load-rounds takes 1 or more (got {args.load_rounds})")
    workloads = {name.strip() for name in args.workloads.split(",")}
    if workloads - set(WORKLOADS):
        parser.error(f"unknown workloads: {', '.join(sorted(workloads - set(WORKLOADS)))}")
    try:
        load_clients = tuple(int(count) for count in args.load_clients.split(","))
    except ValueError:
        load_clients = ()
    if not load_clients or min(load_clients) < 1:
        parser.error(f"--load-clients takes client counts of 1 or more, e.g. 1,4,8 (got {args.load_clients!r})")
    results: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                               "models": {}}
    for path in model_paths(args.models):
        print(f"model {path.name}", flush=True)
        results["models"][path.name] = bench(path, args.data, turns=args.turns, restarts=args.restarts,
                                             clients=args.clients, requests=args.requests, threads=args.threads,
                                             workloads=workloads, load_clients=load_clients,
                                             invariant=args.batch_invariant, load_rounds=args.load_rounds)
    write_json(results, args.out)
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
