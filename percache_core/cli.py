"""The ``percache`` command: ``demo``, ``ingest``, ``ask``, ``warm``, ``stats`` and ``serve``.

percache demo                          # scripted tour on the bundled corpus
percache ingest notes/*.txt --cache ~/.percache/me
percache ask "When is the rehearsal?" --cache ~/.percache/me --stream
percache warm --cache ~/.percache/me --max-seconds 60
percache stats --cache ~/.percache/me
percache serve --upstream http://127.0.0.1:8081 --cache ~/.percache/me   # OpenAI endpoint

Measurements live in the repository's ``benchmarks/`` (not installed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from .config import PerCacheConfig
from .errors import PerCacheError
from .pipeline import PerCache
from .types import Answer

DEFAULT_CACHE = "~/.percache/default"
TABLE_HEADER = ["#", "source", "TTFT ms", "total ms", "reused/prompt tok", "QA sim"]


def demo_corpus() -> dict[str, Any]:
    """The small personal corpus (e-mails, meeting notes) bundled for the demo and tests."""
    text = resources.files("percache_core").joinpath("data/demo_corpus.json").read_text("utf-8")
    return json.loads(text)


def _config(args: argparse.Namespace) -> PerCacheConfig:
    changes: dict[str, Any] = {}
    if getattr(args, "model", None):
        changes["model_path"] = args.model
    if getattr(args, "tau", None) is not None:
        changes["similarity_threshold"] = args.tau
    if getattr(args, "max_new_tokens", None):
        changes["max_new_tokens"] = args.max_new_tokens
    return PerCacheConfig(**changes)


def _read_documents(paths: Sequence[str]) -> list[dict[str, Any]]:
    documents: list[dict[str, Any]] = []
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise PerCacheError(f"not a file: {path}")
        if path.suffix == ".jsonl":
            for line_number, line in enumerate(path.read_text("utf-8").splitlines(), 1):
                if line.strip():
                    record = json.loads(line)
                    record.setdefault("id", record.get("doc_id") or f"{path.stem}-{line_number}")
                    documents.append(record)
        else:
            documents.append(
                {"id": path.stem, "text": path.read_text("utf-8"), "metadata": {"path": str(path)}}
            )
    return documents


def _row(answer: Answer, label: str) -> list[str]:
    return [
        label,
        answer.source,
        f"{answer.ttft_s * 1000:7.0f}",
        f"{answer.latency_s * 1000:7.0f}",
        f"{answer.reused_tokens}/{answer.reused_tokens + answer.prefilled_tokens}",
        "" if answer.similarity is None else f"{answer.similarity:.2f}",
    ]


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line)
    print("-" * len(line))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))


def run_demo(args: argparse.Namespace) -> int:
    corpus = demo_corpus()
    folder = args.cache or tempfile.mkdtemp(prefix="percache-demo-")
    print(f"PerCache demo: {len(corpus['documents'])} personal e-mails and meeting notes; cache in {folder}")
    print("Loading the bundled Gemma 3 270M (llama.cpp) and all-MiniLM-L6-v2 ...")
    rows: list[list[str]] = []
    answers: list[Answer] = []
    with PerCache.open(folder, config=_config(args)) as pc:
        pc.preload()
        pc.add_documents(corpus["documents"], progress=True)
        for number, item in enumerate(corpus["demo_questions"], 1):
            answer = pc.answer(item["question"])
            answers.append(answer)
            rows.append(_row(answer, f"Q{number}"))
            print(f"\nQ{number}: {item['question']}\n    -> [{answer.source}] {answer.text}")
            if answer.matched_question:
                print(f"       (stored answer of: {answer.matched_question!r})")
        print()
        _print_table(TABLE_HEADER, rows)
        _summarise_sources(answers)
        _demo_prediction(pc)
        stats = pc.stats()
    print(
        f"\nQA bank: {stats['qa_bank']['entries']} entries, {stats['qa_bank']['bytes']:,} bytes; "
        f"chunk states: {stats['chunk_states']['nodes']} nodes, {stats['chunk_states']['bytes']:,} bytes"
    )
    return 0


def _summarise_sources(answers: list[Answer]) -> None:
    """Mean TTFT and total time per source against full runs (a prompt answer is an
    identical prompt's stored answer, a QA-bank answer a stored answer the model verified
    as a draft)."""
    full = [a for a in answers if a.source == "full"]
    if not full:
        return
    base_ttft = sum(a.ttft_s for a in full) / len(full)
    base_total = sum(a.latency_s for a in full) / len(full)
    for source in ("chunk_states", "qa_bank", "prompt_answer"):
        chosen = [a for a in answers if a.source == source]
        if chosen:
            ttft = sum(a.ttft_s for a in chosen) / len(chosen)
            total = sum(a.latency_s for a in chosen) / len(chosen)
            print(
                f"{source:>12}: mean TTFT {ttft * 1000:6.0f} ms = {ttft / base_ttft:5.1%}, "
                f"total {total * 1000:6.0f} ms = {total / base_total:5.1%} of a full run"
            )


def _demo_prediction(pc: PerCache) -> None:
    """Part two of the demo: an idle round predicts questions; asking them hits the cache."""
    print("\nIdle time: one warm round predicts likely questions and populates both tiers ...")
    report = pc.warm(progress=True)
    print(
        f"  {report.seconds:.1f} s idle compute ({report.strategy}): {report.chunks_summarised} chunks "
        f"summarised, {len(report.predicted)} questions predicted and populated, "
        f"{report.prefill_tokens} tokens prefilled, {report.decode_tokens} decoded"
    )
    for question in report.predicted:
        print(f"  predicted: {question}")
    rows = []
    for number, question in enumerate(report.predicted[:3], 1):
        answer = pc.answer(question)
        rows.append(_row(answer, f"P{number}"))
        print(f"\nP{number}: {question}\n    -> [{answer.source}] {answer.text}")
    if rows:
        print()
        _print_table(TABLE_HEADER, rows)


def run_warm(args: argparse.Namespace) -> int:
    with PerCache.open(args.cache, config=_config(args)) as pc:
        report = pc.warm(max_seconds=args.max_seconds, max_predictions=args.max_predictions)
        for question in report.predicted:
            print(f"predicted: {question}")
        print(json.dumps({k: v for k, v in report.as_dict().items() if k != "predicted"}, indent=2))
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    documents = _read_documents(args.paths)
    with PerCache.open(args.cache, config=_config(args)) as pc:
        chunks = pc.add_documents(documents, split=not args.no_split, progress=True)
        total = pc.stats()["knowledge"]["chunks"]
        print(f"added {len(chunks)} chunks from {len(documents)} documents; {total} in total")
    return 0


def run_ask(args: argparse.Namespace) -> int:
    with PerCache.open(args.cache, config=_config(args)) as pc:
        if args.stream:
            stream = pc.answer_stream(args.question)
            for piece in stream:
                print(piece, end="", flush=True)
            print()
            answer = stream.answer
        else:
            answer = pc.answer(args.question)
            print(answer.text)
        assert answer is not None
        print(
            f"[{answer.source}] TTFT {answer.ttft_s * 1000:.0f} ms, total {answer.latency_s * 1000:.0f} ms, "
            f"reused {answer.reused_tokens} tokens, prefilled {answer.prefilled_tokens}",
            file=sys.stderr,
        )
    return 0


def run_stats(args: argparse.Namespace) -> int:
    with PerCache.open(args.cache, config=_config(args)) as pc:
        pc.preload()  # load the chunk-state tier so its size is reported
        print(json.dumps(pc.stats(), indent=2))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        from .endpoint import EndpointSettings
        from .endpoint.serve import checked_api_key, open_server, serve, shared_config
    except ImportError as error:
        raise PerCacheError(f"percache serve needs the serve extra: pip install 'percache-core[serve]' ({error})") from None

    key = checked_api_key(args.host, args.api_key)  # before any work
    config = shared_config(args.shared_url)
    server = open_server(args.upstream, args.model, args.slot_save_path)
    settings = EndpointSettings(api_key=key, max_request_bytes=args.max_request_bytes)
    serve(args.cache, server, address=(args.host, args.port), settings=settings, config=config, idle=args.idle)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="percache", description="Predictive two-tier cache for local RAG.")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp and cache logs")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser, cache_default: str | None) -> None:
        sub.add_argument("--cache", default=cache_default, help=f"cache folder (default {cache_default})")
        sub.add_argument("--model", help="a GGUF model file (default: bundled Gemma 3 270M)")
        sub.add_argument("--tau", type=float, help="QA-bank similarity threshold (default 0.85)")
        sub.add_argument("--max-new-tokens", type=int, help="longest answer in tokens (default 128)")

    demo = commands.add_parser("demo", help="scripted tour on the bundled corpus")
    common(demo, None)
    demo.set_defaults(handler=run_demo)
    ingest = commands.add_parser("ingest", help="add .txt/.md files or .jsonl records")
    common(ingest, DEFAULT_CACHE)
    ingest.add_argument("paths", nargs="+")
    ingest.add_argument("--no-split", action="store_true", help="keep each document as one chunk")
    ingest.set_defaults(handler=run_ingest)
    ask = commands.add_parser("ask", help="answer one question")
    common(ask, DEFAULT_CACHE)
    ask.add_argument("question")
    ask.add_argument("--stream", action="store_true")
    ask.set_defaults(handler=run_ask)
    warm = commands.add_parser("warm", help="run one idle round: predict questions and populate the cache")
    common(warm, DEFAULT_CACHE)
    warm.add_argument("--max-seconds", type=float, help="stop the round after this long")
    warm.add_argument("--max-predictions", type=int, help="questions predicted per view (default 5)")
    warm.set_defaults(handler=run_warm)
    stats = commands.add_parser("stats", help="print hit rates and tier sizes as JSON")
    common(stats, DEFAULT_CACHE)
    stats.set_defaults(handler=run_stats)
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible endpoint with PerCache in front of a llama-server"
    )
    serve.add_argument("--cache", default=DEFAULT_CACHE, help=f"cache folder (default {DEFAULT_CACHE})")
    serve.add_argument("--upstream", help="URL of a running llama-server (e.g. http://127.0.0.1:8081)")
    serve.add_argument("--model", help="a GGUF file: start a llama-server on it (instead of --upstream)")
    serve.add_argument("--slot-save-path", help="the upstream server's --slot-save-path folder (chunk states)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    serve.add_argument("--api-key", help="key clients must send (required off loopback; or $PERCACHE_API_KEY)")
    serve.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, help="largest request body")
    serve.add_argument("--shared-url", help="Redis tier shared with other endpoints ($PERCACHE_SHARED_SECRET signs)")
    serve.add_argument("--idle", action="store_true", help="run idle prediction between requests")
    serve.set_defaults(handler=run_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        warnings.simplefilter("ignore", FutureWarning)
    try:
        return args.handler(args)
    except PerCacheError as error:
        print(f"percache: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
