"""``PerCacheLlamaCPP``: a LangChain LLM on PerCache's llama.cpp engine that reuses chunk
states for the documents a ``PerCacheRetriever`` put into the prompt.

The prompt string is laid out as [text before the first document, document 1, ...,
document k, the rest], so any prompt template works unchanged and stored states of the
same template text and documents are reused.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from langchain_core.callbacks import CallbackManagerForLLMRun
from langchain_core.language_models.llms import LLM
from langchain_core.outputs import GenerationChunk
from pydantic import ConfigDict, field_validator

from percache_core import Chunk, PerCache

from .recorder import as_percache, recorder_for
from .retriever import _document_id


class PerCacheLlamaCPP(LLM):
    """Generates with the PerCache's engine; ``max_new_tokens`` defaults to the PerCache's."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    percache: Any
    max_new_tokens: int | None = None

    @field_validator("percache")
    @classmethod
    def _check_percache(cls, value: Any) -> PerCache:
        return as_percache(value)

    @property
    def _llm_type(self) -> str:
        return "percache-llama-cpp"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        config = self.percache.config
        return {
            "model": self.percache.model_id(),
            "max_new_tokens": self.max_new_tokens or config.max_new_tokens,
            "temperature": config.temperature,
            "top_p": config.top_p,
            "seed": config.seed,
        }

    def _layout(self, prompt: str) -> tuple[str, list[Chunk], str]:
        documents = recorder_for(self.percache).documents_in(prompt)
        if not documents:
            return prompt, [], ""
        chunks: list[Chunk] = []
        starts = []
        cursor = 0
        for document in documents:
            start = prompt.find(document.page_content, cursor)
            if start < 0:
                continue
            starts.append((start, document))
            cursor = start + len(document.page_content)
        prefix = prompt[: starts[0][0]]
        for index, (start, document) in enumerate(starts):
            end = starts[index + 1][0] if index + 1 < len(starts) else start + len(document.page_content)
            chunks.append(Chunk(_document_id(document), _document_id(document), prompt[start:end]))
        last_start, last_document = starts[-1]
        return prefix, chunks, prompt[last_start + len(last_document.page_content) :]

    def _stream_answer(self, prompt: str, stop: list[str] | None):
        prefix, chunks, suffix = self._layout(prompt)
        return self.percache.complete_with_documents(
            prefix, chunks, suffix, max_new_tokens=self.max_new_tokens, stop=stop, stream=True
        )

    def _call(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> str:
        prefix, chunks, suffix = self._layout(prompt)
        answer = self.percache.complete_with_documents(
            prefix, chunks, suffix, max_new_tokens=self.max_new_tokens, stop=stop
        )
        return answer.text

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for piece in self._stream_answer(prompt, stop):
            chunk = GenerationChunk(text=piece)
            if run_manager is not None:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
