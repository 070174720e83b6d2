"""New processes: PerCache's answers against stock llama.cpp's, each in a process of its own.

What a user meets first is a new process: a CLI call, an app restart, a notebook kernel.
Stock ``llama_cpp.Llama`` in a new process imports llama.cpp, loads the GGUF and answers.
This benchmark times whole new processes (wall clock, from start to exit, and their peak
memory), side by side per question with the order alternating:

- ``stock``: import ``llama_cpp``, load the bundled GGUF, complete the prompt PerCache lays
  out for the question (greedy, the same token budget);
- ``percache ask (first)``: ``percache ask`` on a cache with the knowledge ingested and the
  question never asked (a full answer);
- ``percache ask (again)``: the same question again in a new process (a stored answer);
- ``PerCache.open + answer``: the Python API, the first answer of a new process;
- ``LangChain PerCacheLLM.invoke`` and ``LlamaIndex PerCacheLlamaCPP.complete``: the two
  quick starts' LLMs completing the same prompt string in a new process.

PerCache's packages are byte-compiled first, as installing a wheel does (``pip install``
writes every module's ``.pyc``; an editable checkout under ``PYTHONDONTWRITEBYTECODE=1``,
as on this machine, has none, and compiling its ~150 modules took 0.2 s of every new
process). Each process of PerCache runs with the self-checks' verdicts already on disk (as after a
first ``preload()`` or idle round on this machine); ``--fresh-verdicts`` runs them in a
PERCACHE_HOME without them, as the very first process on a machine.

    .venv/bin/python -m benchmarks.cold_start --out benchmarks/results/cold_start.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from percache_core.demo import demo_corpus
from percache_core.models import percache_home, resolve_model_path

from .output import write_json

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 16

STOCK = """
import importlib, sys, llama_cpp
if sys.argv[1].startswith("--import="):  # a framework app on stock llama.cpp imports its framework too
    importlib.import_module(sys.argv.pop(1).split("=", 1)[1])
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=2048, n_batch=512, verbose=False)
out = llm.create_completion(sys.argv[2], max_tokens=int(sys.argv[3]), temperature=0.0, stop=sys.argv[4:])
print(out["choices"][0]["text"].strip())
"""

API = """
import sys
from percache_core import PerCache, PerCacheConfig
with PerCache.open(sys.argv[1], config=PerCacheConfig(max_new_tokens=int(sys.argv[3]))) as pc:
    answer = pc.answer(sys.argv[2])
print(answer.text)
print(answer.source, file=sys.stderr)
"""

LANGCHAIN = """
import sys
from percache_core import PerCache, PerCacheConfig
from percache_langchain import PerCacheLLM
with PerCache.open(sys.argv[1], config=PerCacheConfig(max_new_tokens=int(sys.argv[3]))) as pc:
    print(PerCacheLLM(percache=pc, stop=sys.argv[4:]).invoke(sys.argv[2]).strip())
"""

LLAMAINDEX = """
import sys
from percache_llamaindex import PerCacheLlamaCPP
llm = PerCacheLlamaCPP(max_new_tokens=int(sys.argv[3]), stop=sys.argv[4:])
print(llm.complete(sys.argv[2]).text.strip())
"""

PREPARE = """
import json, sys
from percache_core import PerCache, PerCacheConfig
from percache_core.inspection import internals
corpus = json.loads(open(sys.argv[2]).read())
with PerCache.open(sys.argv[1], config=PerCacheConfig(max_new_tokens=int(sys.argv[3]))) as pc:
    pc.add_documents(corpus["documents"])
    pc.preload()  # the self-checks' verdicts go to disk, as after a first run on this machine
    runner = internals(pc).runner
    prompts = [runner.lay_out(q, [r.chunk for r in pc.retrieve(q)], max_new_tokens=int(sys.argv[3])).text
               for q in corpus["questions"]]
    print(json.dumps({"prompts": prompts, "stop": list(pc.config.engine.stop)}))
"""


def run_process(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run *args* as a new process; its wall time, peak memory (MiB), output and status."""
    started = time.perf_counter()
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO, text=True)
    stdout, stderr = process.communicate()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "stdout": stdout.strip(), "stderr": stderr.strip(), "rc": process.returncode}


def peak_memory_mib(args: list[str], env: dict[str, str]) -> float:
    """The peak resident memory of one run of *args* (MiB)."""
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    _, _, usage = os.wait4(process.pid, 0)
    return usage.ru_maxrss / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--fresh-verdicts", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/cold_start.json")
    args = parser.parse_args()

    python = sys.executable
    cli = str(Path(python).parent / "percache")
    packages = [str(REPO / name) for name in ("percache_core", "percache_langchain", "percache_llamaindex")]
    subprocess.run([python, "-m", "compileall", "-q", *packages], check=True)  # as a wheel install does
    model = str(resolve_model_path(None))
    corpus = demo_corpus()
    questions = [item["question"] for item in corpus["demo_questions"]][: args.questions]
    work = Path(tempfile.mkdtemp(prefix="percache-cold-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if args.fresh_verdicts:  # a home with the model but no memos
        home = work / "home"
        (home / "models").mkdir(parents=True)
        os.symlink(model, home / "models" / Path(model).name)
        env["PERCACHE_HOME"] = str(home)
    corpus_file = work / "corpus.json"
    corpus_file.write_text(json.dumps({"documents": corpus["documents"], "questions": questions}))
    base = work / "base"
    prepared = subprocess.run(
        [python, "-c", PREPARE, str(base), str(corpus_file), str(MAX_NEW_TOKENS)],
        capture_output=True, text=True, check=True, env={**os.environ}, cwd=REPO,
    )
    layout = json.loads(prepared.stdout.strip().splitlines()[-1])
    if args.fresh_verdicts:
        shutil.rmtree(home)
        (home / "models").mkdir(parents=True)
        os.symlink(model, home / "models" / Path(model).name)

    rows: list[dict[str, Any]] = []
    for number, (question, prompt) in enumerate(zip(questions, layout["prompts"])):
        folder = work / f"q{number}"
        shutil.copytree(base, folder)
        runs = {
            "stock": [python, "-c", STOCK, model, prompt, str(MAX_NEW_TOKENS), *layout["stop"]],
            "percache ask (first)": [cli, "ask", question, "--cache", str(folder), "--max-new-tokens", str(MAX_NEW_TOKENS)],
            "percache ask (again)": [cli, "ask", question, "--cache", str(folder), "--max-new-tokens", str(MAX_NEW_TOKENS)],
        }
        api_folder = work / f"api{number}"
        shutil.copytree(base, api_folder)
        runs["PerCache.open + answer"] = [python, "-c", API, str(api_folder), question, str(MAX_NEW_TOKENS)]
        chain_folder = work / f"langchain{number}"
        shutil.copytree(base, chain_folder)
        runs["LangChain PerCacheLLM.invoke"] = [
            python, "-c", LANGCHAIN, str(chain_folder), prompt, str(MAX_NEW_TOKENS), *layout["stop"]
        ]
        stock_run = runs["stock"]
        runs["stock in a LangChain app"] = stock_run[:3] + ["--import=langchain_core.language_models.llms"] + stock_run[3:]
        runs["stock in a LlamaIndex app"] = stock_run[:3] + ["--import=llama_index.core.llms"] + stock_run[3:]
        runs["LlamaIndex PerCacheLlamaCPP.complete"] = [
            python, "-c", LLAMAINDEX, str(work / "unused"), prompt, str(MAX_NEW_TOKENS), *layout["stop"]
        ]
        order = list(runs)
        if number % 2:  # alternate: stock last on odd questions (the two asks keep their order)
            order = order[1:] + order[:1]
        row: dict[str, Any] = {"question": question}
        for name in order:
            result = run_process(runs[name], env)
            if result["rc"] != 0:
                raise SystemExit(f"{name} failed: {result['stderr'][-2000:]}")
            key = name
            row[key] = {"wall_s": round(result["wall_s"], 3), "text": result["stdout"].splitlines()[0] if result["stdout"] else "",
                        "source": result["stderr"].splitlines()[-1] if result["stderr"] else ""}
        rows.append(row)
        print(json.dumps({k: (v["wall_s"], v["source"]) if isinstance(v, dict) else v for k, v in row.items()}))

    baseline = {  # what each would run instead: stock llama.cpp in a process of the same kind
        "LangChain PerCacheLLM.invoke": "stock in a LangChain app",
        "LlamaIndex PerCacheLlamaCPP.complete": "stock in a LlamaIndex app",
    }
    summary: dict[str, Any] = {}
    for name in list(rows[0])[1:]:
        walls = [row[name]["wall_s"] for row in rows]
        summary[name] = {"mean_wall_s": round(sum(walls) / len(walls), 3), "max_wall_s": max(walls)}
    for name in summary:
        if name.startswith("stock"):
            continue
        against = baseline.get(name, "stock")
        ratios = [row[name]["wall_s"] / row[against]["wall_s"] for row in rows]
        summary[name]["against"] = against
        summary[name]["ratio_mean"] = round(sum(ratios) / len(ratios), 3)
        summary[name]["ratio_of_means"] = round(summary[name]["mean_wall_s"] / summary[against]["mean_wall_s"], 3)
    for name in ("PerCache.open + answer", "LangChain PerCacheLLM.invoke", "LlamaIndex PerCacheLlamaCPP.complete"):
        same = sum(row["stock"]["text"] == row[name]["text"] for row in rows)
        summary[name]["identical to stock"] = f"{same}/{len(rows)}"
    folder = work / "memory"
    shutil.copytree(base, folder)
    summary["peak_memory_mib"] = {
        "stock": round(peak_memory_mib([python, "-c", STOCK, model, layout["prompts"][0], str(MAX_NEW_TOKENS)], env), 1),
        "percache ask (first)": round(peak_memory_mib([cli, "ask", questions[0], "--cache", str(folder)], env), 1),
        "percache ask (again)": round(peak_memory_mib([cli, "ask", questions[0], "--cache", str(folder)], env), 1),
    }
    result = {
        "machine": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "max_new_tokens": MAX_NEW_TOKENS,
        "fresh_verdicts": args.fresh_verdicts,
        "home": str(env.get("PERCACHE_HOME") or percache_home()),
        "summary": summary,
        "rows": rows,
    }
    print(json.dumps(summary, indent=2))
    write_json(result, args.out)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
