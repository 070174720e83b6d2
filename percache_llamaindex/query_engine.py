"""``PerCacheQueryEngine``: ``index.as_query_engine()`` with PerCache in front.

Each question is retrieved with the index's own retriever (and node postprocessors)
first. A stored answer is returned without calling the LLM only when it is bound to the
same LLM, response mode and retrieved nodes (ids and texts): in the default exact mode
for the same question text, in semantic mode (opt-in, approximate) for a similar one.
Otherwise the answer is generated through the chunk-state tree when the LLM is a
llama.cpp model (``PerCacheLlamaCPP``, or ``llama-index-llms-llama-cpp``'s ``LlamaCPP``,
whose GGUF file PerCache loads itself), or through LlamaIndex's response synthesizer with
any other LLM. ``response.metadata["percache"]`` says what happened.

Idle-time prediction answers with the model that answers the user: with an LLM that is
not llama.cpp, ``warm()`` and ``start_worker()`` do nothing (and say so in the log).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Generator
from typing import Any

from llama_index.core import Settings
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response, StreamingResponse
from llama_index.core.indices.base import BaseIndex
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle

from percache_core import Answer, PerCache, PerCacheConfig
from percache_core.binding import chunk_sources
from percache_core.scheduler import WarmReport

from .embedding import PerCacheEmbedding
from .llm import PerCacheLlamaCPP
from .nodes import node_chunks, record_nodes

logger = logging.getLogger(__name__)


def llm_identity(llm: Any) -> str:
    """A text that tells LLMs (class and settings) apart, for binding stored answers."""
    try:
        settings = llm.to_json()
    except Exception:  # not a serialisable LlamaIndex component
        settings = repr(getattr(llm, "metadata", llm))
    return f"{type(llm).__module__}.{type(llm).__qualname__}:{settings}"


def _default_llm() -> Any:
    """``Settings.llm`` when one was set, else None (LlamaIndex's default needs OpenAI)."""
    return getattr(Settings, "_llm", None)


def _llama_cpp_model_path(llm: Any) -> str | None:
    """The GGUF file of ``llama-index-llms-llama-cpp``'s ``LlamaCPP``, else None."""
    if type(llm).__name__ == "LlamaCPP" and isinstance(getattr(llm, "model_path", None), str):
        return llm.model_path
    return None


def supports_chunk_states(llm: Any) -> bool:
    """Whether answers from *llm* can go through PerCache's chunk-state tree."""
    return isinstance(llm, PerCacheLlamaCPP) or _llama_cpp_model_path(llm) is not None


def _metadata(answer: Answer) -> dict[str, Any]:
    return {
        "source": answer.source,
        "similarity": answer.similarity,
        "matched_question": answer.matched_question,
        "reused_tokens": answer.reused_tokens,
        "prefilled_tokens": answer.prefilled_tokens,
        "ttft_s": answer.ttft_s,
        "latency_s": answer.latency_s,
    }


class PerCacheQueryEngine(BaseQueryEngine):
    """A query engine that answers from PerCache first.

    Build it with :meth:`from_index`, which takes the keyword arguments of
    ``index.as_query_engine()``.
    """

    def __init__(
        self,
        *,
        inner: RetrieverQueryEngine,
        percache: PerCache,
        llm: Any,
        streaming: bool = False,
        response_mode: str = "compact",
    ) -> None:
        super().__init__(callback_manager=inner.callback_manager)
        self._inner = inner
        self._percache = percache
        self._llm = llm
        self._uses_states = supports_chunk_states(llm)
        self._streaming = streaming
        self._answer_key = f"{llm_identity(llm)}|{response_mode}"

    @classmethod
    def from_index(
        cls,
        index: BaseIndex,
        *,
        cache_dir: str | os.PathLike[str],
        llm: Any = None,
        config: PerCacheConfig | None = None,
        **kwargs: Any,
    ) -> PerCacheQueryEngine:
        """Like ``index.as_query_engine(llm=llm, **kwargs)`` (``similarity_top_k``,
        ``response_mode``, ``streaming``, ``node_postprocessors``, ...), with a PerCache
        in *cache_dir*. Without an LLM (and no ``Settings.llm``), the bundled Gemma 3 270M
        is used through :class:`PerCacheLlamaCPP`.
        """
        if not isinstance(index, BaseIndex):
            raise TypeError(f"index must be a LlamaIndex index, got {type(index).__name__}")
        llm = llm or _default_llm() or PerCacheLlamaCPP()
        model_path = _llama_cpp_model_path(llm)
        config = config or PerCacheConfig()
        if "similarity_top_k" in kwargs:
            config = config.replace(top_k=kwargs["similarity_top_k"])
        embed_model = getattr(index, "_embed_model", None)
        embedder = embed_model.embedder if isinstance(embed_model, PerCacheEmbedding) else None
        if isinstance(llm, PerCacheLlamaCPP):
            percache = PerCache.open(cache_dir, config=config, embedder=embedder, engine=llm.engine)
        elif model_path is not None:
            percache = PerCache.open(
                cache_dir, config=config.replace(model_path=model_path), embedder=embedder
            )
        else:
            percache = PerCache.open(cache_dir, config=config.replace(chunk_states=False), embedder=embedder)
        inner = index.as_query_engine(llm=llm, **kwargs)
        return cls(
            inner=inner,
            percache=percache,
            llm=llm,
            streaming=bool(kwargs.get("streaming")),
            response_mode=str(kwargs.get("response_mode", "compact")),
        )

    @property
    def percache(self) -> PerCache:
        """The cache behind this engine (for ``stats()``, ``close()``, ...)."""
        return self._percache

    def warm(self, **kwargs: Any) -> WarmReport:
        """One idle round of prediction and population (see ``PerCache.warm``); nothing
        with an LLM that is not llama.cpp (its answers would come from another model)."""
        if not self._uses_states:
            logger.warning(
                "idle prediction needs the llama.cpp model that answers: %s is not one",
                type(self._llm).__name__,
            )
            return WarmReport(strategy="none")
        return self._percache.warm(**kwargs)

    def start_worker(self, **kwargs: Any):
        """Start PerCache's background idle worker (see ``PerCache.start_worker``); None
        with an LLM that is not llama.cpp."""
        if not self._uses_states:
            logger.warning(
                "idle prediction needs the llama.cpp model that answers: %s is not one",
                type(self._llm).__name__,
            )
            return None
        return self._percache.start_worker(**kwargs)

    def _binding(self, nodes: list[NodeWithScore]) -> str:
        """What decides this engine's answer besides the question: LLM, response mode and
        the retrieved nodes' ids and texts (a changed or new node changes it)."""
        sources = chunk_sources(node_chunks(nodes))
        payload = f"{self._answer_key}|{sources}"
        return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:32]

    def _get_prompt_modules(self) -> dict[str, Any]:
        return {"inner": self._inner}

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._inner.retrieve(query_bundle)

    def _query(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        question = query_bundle.query_str
        nodes = self._inner.retrieve(query_bundle)
        binding = self._binding(nodes)
        hit = self._percache.lookup(question, binding=binding) if nodes else None
        if hit is not None:
            if self._streaming:
                return StreamingResponse(
                    response_gen=iter([hit.text]), source_nodes=nodes, metadata={"percache": _metadata(hit)}
                )
            return Response(hit.text, source_nodes=nodes, metadata={"percache": _metadata(hit)})
        record_nodes(self._percache, nodes)
        if self._uses_states and nodes:
            return self._generate(question, nodes, binding)
        return self._synthesize(query_bundle, nodes, binding)

    def _generate(self, question: str, nodes: list[NodeWithScore], binding: str) -> RESPONSE_TYPE:
        if not self._streaming:
            answer = self._percache.generate(question, node_chunks(nodes), binding=binding)
            return Response(answer.text, source_nodes=nodes, metadata={"percache": _metadata(answer)})
        stream = self._percache.generate(question, node_chunks(nodes), binding=binding, stream=True)
        metadata: dict[str, Any] = {}

        def pieces() -> Generator[str, None, None]:
            yield from stream
            answer = stream.answer
            assert answer is not None
            metadata.update(_metadata(answer))

        return StreamingResponse(response_gen=pieces(), source_nodes=nodes, metadata={"percache": metadata})

    def _synthesize(
        self, query_bundle: QueryBundle, nodes: list[NodeWithScore], binding: str
    ) -> RESPONSE_TYPE:
        response = self._inner.synthesize(query_bundle, nodes)
        question = query_bundle.query_str
        info = {"source": "full", "similarity": None, "reused_tokens": 0}
        if isinstance(response, StreamingResponse):
            original = response.response_gen

            def pieces() -> Generator[str, None, None]:
                text = ""
                for piece in original:
                    text += piece
                    yield piece
                if text.strip() and nodes:
                    self._remember_text(question, text.strip(), nodes, binding)

            response.response_gen = pieces()
            response.metadata = {**(response.metadata or {}), "percache": info}
            return response
        text = str(response)
        if text.strip() and nodes:
            self._remember_text(question, text.strip(), nodes, binding)
        response.metadata = {**(response.metadata or {}), "percache": info}
        return response

    def _remember_text(self, question: str, text: str, nodes: list[NodeWithScore], binding: str) -> None:
        if self._percache.config.qa_bank:
            ids = [n.node.node_id for n in nodes]
            self._percache.remember(question, text, chunk_ids=ids, binding=binding)

    async def _aquery(self, query_bundle: QueryBundle) -> RESPONSE_TYPE:
        return await asyncio.to_thread(self._query, query_bundle)

    def close(self) -> None:
        """Close the cache (the engine can no longer answer)."""
        self._percache.close()


__all__ = ["PerCacheQueryEngine"]
