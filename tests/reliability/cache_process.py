"""A process that works on a cache folder, for the reliability tests (run as
``python -m tests.reliability.cache_process FOLDER ACTION [ARGS...]``).

With ``--fake`` it uses the FakeEngine and the hashing embedder (storage and control
flow); otherwise the bundled model and embedder. It prints one JSON line per result.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from percache_core import PerCache, PerCacheConfig


def open_cache(folder: str, fake: bool, **config: object) -> PerCache:
    config.setdefault("max_new_tokens", 16)
    if fake:
        from tests.fake_engine import FakeEngine
        from tests.fakes import HashingEmbedder

        return PerCache.open(folder, config=PerCacheConfig(**config), engine=FakeEngine(), embedder=HashingEmbedder())
    return PerCache.open(folder, config=PerCacheConfig(**config))


def main(argv: list[str]) -> None:
    fake = "--fake" in argv
    argv = [a for a in argv if a != "--fake"]
    folder, action, *rest = argv
    if action == "answer":  # answer each question given on the command line
        with open_cache(folder, fake) as pc:
            for question in rest:
                answer = pc.answer(question)
                print(json.dumps({"question": question, "text": answer.text, "source": answer.source}), flush=True)
    elif action == "remember-many":  # prefix count budget: remember count entries
        prefix, count, budget = rest[0], int(rest[1]), int(rest[2])
        with open_cache(folder, fake, qa_bank_budget_bytes=budget) as pc:
            for i in range(count):
                pc.caller.remember(f"{prefix} question number {i}?", f"answer {i} " + "x" * 200)
        print(json.dumps({"done": count}), flush=True)
    elif action == "churn":  # documents and answers in a loop until killed
        with open_cache(folder, fake) as pc:
            for i in range(10**6):
                pc.add_documents([{"id": f"doc-{i % 7}", "text": f"Version {i} of note {i % 7}: the code is {i}."}])
                pc.answer(f"What is the code of note {i % 7}?")
                print(json.dumps({"round": i}), flush=True)
    elif action == "wait-then-answer":  # open, wait for a file to appear, then answer
        with open_cache(folder, fake) as pc:
            print(json.dumps({"opened": True}), flush=True)
            signal = Path(rest[0])
            while not signal.exists():
                time.sleep(0.05)
            answer = pc.answer(rest[1])
            print(json.dumps({"text": answer.text, "source": answer.source}), flush=True)
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main(sys.argv[1:])
