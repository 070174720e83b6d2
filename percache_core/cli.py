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
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import PerCacheConfig
from .demo import run_demo
from .document_files import document_files, read_documents
from .errors import PerCacheError
from .pipeline import PerCache

DEFAULT_CACHE = "~/.percache/default"


def _config(args: argparse.Namespace) -> PerCacheConfig:
    changes: dict[str, Any] = {}
    if getattr(args, "model", None):
        changes["model_path"] = args.model
    if getattr(args, "tau", None) is not None:
        changes["similarity_threshold"] = args.tau
    if getattr(args, "max_new_tokens", None):
        changes["max_new_tokens"] = args.max_new_tokens
    if getattr(args, "qa_mode", None):
        changes["qa_mode"] = args.qa_mode
    if getattr(args, "chunk_state_budget", None):
        changes["chunk_state_budget_bytes"] = args.chunk_state_budget
    return PerCacheConfig(**changes)


def byte_size(text: str) -> int:
    """A size such as ``512M``, ``2G`` or ``1500000`` in bytes (K, M, G, T: powers of 1024).

    >>> byte_size("512M"), byte_size("2g"), byte_size("1000")
    (536870912, 2147483648, 1000)
    """
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}
    text = text.strip().upper().removesuffix("B")
    scale = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    return size


def _size(count: float) -> str:
    """*count* bytes, readable.

    >>> _size(1536), _size(0)
    ('1.5 KB', '0 B')
    """
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def stats_text(stats: dict[str, Any], folder: str) -> str:
    """``percache stats``' summary of :meth:`PerCache.stats`."""
    qa, states, idle = stats["qa_bank"], stats["chunk_states"], stats["idle"]
    stored = stats["qa_bank_hits"]
    rounds = sum(v["rounds"] for v in idle.values() if isinstance(v, dict) and "rounds" in v)
    budget = states["budget_bytes"]
    lines = [
        f"PerCache cache {folder}",
        f"  knowledge      {stats['knowledge']['chunks']} chunks",
        f"  answers        {stats['queries']} ({stats['counted']['answers and tokens']})",
        f"                 {stored} answered before ({stats['prompt_answers']} identical prompts, "
        f"{stats['remembered']} remembered), {stats['chunk_state_hits']} restored chunk states, {stats['full']} full",
        f"  tokens         {stats['reused_tokens']:,} reused, {stats['prefilled_tokens']:,} prefilled, "
        f"{stats['generated_tokens']:,} generated",
        f"  QA bank        {qa['entries']} entries, {qa['prompt_answers']} prompt answers, "
        f"{_size(qa['bytes'] + qa['prompt_answer_bytes'])} (budget {_size(qa['budget_bytes'])} each)",
        f"  chunk states   {_size(states.get('bytes_on_disk', states['bytes']))} on disk; "
        f"budget {_size(budget)}, {states['budget']}",
        f"  idle work      {rounds} rounds in this process",
    ]
    return "\n".join(lines)


def run_warm(args: argparse.Namespace) -> int:
    with PerCache.open(args.cache, config=_config(args)) as pc:
        report = pc.warm(max_seconds=args.max_seconds, max_predictions=args.max_predictions)
        for question in report.predicted:
            print(f"predicted: {question}")
        print(json.dumps({k: v for k, v in report.as_dict().items() if k != "predicted"}, indent=2))
    return 0


def run_ingest(args: argparse.Namespace) -> int:
    documents = read_documents(args.paths)
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
    if not Path(args.cache).expanduser().is_dir():  # a read-only verb creates no cache
        raise PerCacheError(f"no cache here: {args.cache}")
    with PerCache.open(args.cache) as pc:  # loads no model: what the folder holds and counted
        stats = pc.stats()
    print(json.dumps(stats, indent=2) if args.json else stats_text(stats, args.cache))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        from .endpoint import EndpointSettings
        from .endpoint.serve import BetweenRequests, checked_api_key, open_server, serve, shared_config
    except ImportError as error:
        raise PerCacheError(f"percache serve needs the serve extra: pip install 'percache-core[serve]' ({error})") from None

    key = checked_api_key(args.host, args.api_key)  # before any work
    if args.wait_upstream < 0:
        raise PerCacheError("--wait-upstream must be 0 or more seconds")
    if args.slots is not None and (args.slots < 1 or args.upstream is not None):
        raise PerCacheError("--slots: 1 or more, for a server this command starts (an --upstream runs its own -np)")
    if args.batch_invariant and args.upstream is not None:
        raise PerCacheError("--batch-invariant: for a server this command starts (an --upstream runs its own flags)")
    for pattern in args.documents or ():
        if not Path(pattern).expanduser().is_dir() and not document_files(pattern):
            raise PerCacheError(f"--documents {pattern}: no folder and no .txt, .md or .jsonl file there")
    config = shared_config(args.shared_url)
    server = open_server(args.upstream, args.model, args.slot_save_path, wait_upstream_s=args.wait_upstream, slots=args.slots,
                         batch_invariant=args.batch_invariant)
    settings = EndpointSettings(api_key=key, max_request_bytes=args.max_request_bytes)
    documents = tuple(args.documents or ())
    between = BetweenRequests(idle=(args.idle or bool(documents)) and not args.no_idle, documents=documents)
    serve(args.cache, server, address=(args.host, args.port), settings=settings, config=config, between=between)
    return 0


def _add_serve_parser(commands: Any) -> None:
    """``percache serve``'s options."""
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible endpoint with PerCache in front of a llama-server"
    )
    serve.add_argument("--cache", default=DEFAULT_CACHE, help=f"cache folder (default {DEFAULT_CACHE})")
    serve.add_argument("--upstream", help="URL of a running llama-server (e.g. http://127.0.0.1:8081) or another OpenAI-compatible server (stored replies only)")
    serve.add_argument("--model", help="a GGUF file: start a llama-server on it (neither: the bundled model)")
    serve.add_argument("--wait-upstream", type=float, default=60.0, metavar="SECONDS",
                       help="how long to wait for --upstream to answer at start (default 60: one started "
                            "beside this command may still be loading its model)")
    serve.add_argument("--slot-save-path", help="the upstream server's --slot-save-path folder (chunk states)")
    serve.add_argument("--slots", type=int, metavar="N",
                       help="slots of the server this command starts (default 4, as llama-server's; each its own "
                            "KV cache of the context size)")
    serve.add_argument("--batch-invariant", action="store_true",
                       help="start the build whose llamafile kernels take every batch size (make llama-server-invariant) "
                            "so that a request computes as alone beside others (-nr; flash attention and the tiled matmul "
                            "as the model runs faster, measured at its first start): batched runs' states and answers are kept, "
                            "and requests sharing a prefix compute it once; it costs speed alone, by model (docs/engines.md)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    serve.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    serve.add_argument("--api-key", help="key clients must send (required off loopback; or $PERCACHE_API_KEY)")
    serve.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024, help="largest request body")
    serve.add_argument("--shared-url", help="Redis tier shared with other endpoints ($PERCACHE_SHARED_SECRET signs)")
    serve.add_argument("--idle", action="store_true", help="run idle prediction between requests (on with --documents)")
    serve.add_argument("--no-idle", action="store_true", help="no idle prediction, even with --documents")
    serve.add_argument(
        "--documents", action="append", metavar="DIR_OR_GLOB",
        help="documents (.txt, .md, .jsonl) ingested at start and watched (repeatable)",
    )
    serve.set_defaults(handler=run_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="percache", description="Predictive two-tier cache for local RAG.")
    parser.add_argument("--verbose", action="store_true", help="show llama.cpp and cache logs")
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub: argparse.ArgumentParser, cache_default: str | None) -> None:
        sub.add_argument("--cache", default=cache_default, help=f"cache folder (default {cache_default})")
        sub.add_argument("--model", help="a GGUF model file (default: bundled Gemma 3 270M)")
        sub.add_argument("--tau", type=float, help="QA-bank similarity threshold (default 0.85)")
        sub.add_argument("--max-new-tokens", type=int, help="longest answer in tokens (default 128)")
        sub.add_argument(
            "--qa-mode", choices=["exact", "semantic"],
            help="stored answers: exact (default: the model's own answers only) or semantic (approximate)",
        )  # fmt: skip
        sub.add_argument(
            "--chunk-state-budget", type=byte_size, metavar="SIZE",
            help="disk for chunk states, e.g. 512M or 2G (default: sized from the knowledge)",
        )  # fmt: skip

    demo = commands.add_parser("demo", help="scripted tour on the bundled corpus")
    common(demo, None)
    demo.set_defaults(handler=lambda args: run_demo(args, _config(args)))
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
    stats = commands.add_parser("stats", help="what the cache answered and holds (loads no model)")
    stats.add_argument("--cache", default=DEFAULT_CACHE, help=f"cache folder (default {DEFAULT_CACHE})")
    stats.add_argument("--json", action="store_true", help="every counter, as JSON")
    stats.set_defaults(handler=run_stats)
    _add_serve_parser(commands)
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
