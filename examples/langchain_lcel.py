"""A LangChain LCEL chain (retriever | prompt | llm | parser) with PerCache's three parts.

Run: .venv/bin/python examples/langchain_lcel.py [cache folder]

The second question is the first asked again: the LLM cache (PerCacheLLMCache) answers it
from the generation stored the first time, without the model. The third shares the first
one's retrieved notes, so its prompt restores the chunk states the first one stored.
"""

from __future__ import annotations

import sys
import tempfile
import time

from langchain_core.documents import Document
from langchain_core.embeddings import Embeddings
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import PromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore

from percache_core import PerCache, PerCacheConfig
from percache_core.demo import demo_corpus
from percache_langchain import PerCacheLLM, PerCacheLLMCache, PerCacheRetriever


class BundledEmbeddings(Embeddings):
    """LangChain embeddings over PerCache's bundled all-MiniLM-L6-v2."""

    def __init__(self, percache: PerCache) -> None:
        self.percache = percache

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.percache.embedder.embed(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]


def main(folder: str) -> list[dict]:
    results = []
    with PerCache.open(folder, config=PerCacheConfig(max_new_tokens=32)) as pc:
        documents = [Document(page_content=d["text"], id=d["id"]) for d in demo_corpus()["documents"]]
        store = InMemoryVectorStore.from_documents(documents, BundledEmbeddings(pc))
        retriever = PerCacheRetriever(inner=store.as_retriever(search_kwargs={"k": 2}), percache=pc)
        prompt = PromptTemplate.from_template(
            "Use the notes to answer briefly.\n\n{context}\n\nQuestion: {question}\nAnswer:"
        )
        llm = PerCacheLLM(percache=pc, cache=PerCacheLLMCache(pc))
        chain = (
            {
                "context": retriever | (lambda docs: "\n\n".join(d.page_content for d in docs)),
                "question": RunnablePassthrough(),
            }
            | prompt
            | llm
            | StrOutputParser()
        )
        for question in (
            "When is the presentation rehearsal for the launch talk?",
            "When is the presentation rehearsal for the launch talk?",  # asked again: the cache answers
            "Which room is the launch talk rehearsal in?",
        ):
            before = pc.stats()
            started = time.perf_counter()
            text = chain.invoke(question)
            after = pc.stats()
            source = (
                "qa_bank"
                if after["qa_bank_hits"] > before["qa_bank_hits"]
                else "chunk_states"
                if after["chunk_state_hits"] > before["chunk_state_hits"]
                else "full"
            )
            results.append(
                {
                    "question": question,
                    "answer": text,
                    "source": source,
                    "seconds": time.perf_counter() - started,
                }
            )
            print(
                f"[{source:>12}] {time.perf_counter() - started:6.3f} s  {question}\n               -> {text}"
            )
    return results


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="percache-langchain-"))
