"""``PerCacheLlamaCPP``: a LlamaIndex LLM on PerCache's llama.cpp engine.

Used alone it completes prompts like any LlamaIndex LLM; given to
``PerCacheQueryEngine`` it lets answers reuse chunk states.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from pydantic import Field, PrivateAttr

from percache_core.config import DEFAULT_STOP
from percache_core.generation import stream_text
from percache_core.kv.llama_cpp import LlamaEngine
from percache_core.models import resolve_model_path
from percache_core.streaming import BackgroundStream


class PerCacheLlamaCPP(CustomLLM):
    """A GGUF model (default: the bundled Gemma 3 270M) on PerCache's engine.

    >>> llm = PerCacheLlamaCPP(max_new_tokens=32)            # doctest: +SKIP
    >>> llm.complete("The capital of France is").text        # doctest: +SKIP
    """

    model_path: str | None = Field(default=None, description="GGUF file; None: the bundled model")
    max_new_tokens: int = Field(default=128, gt=0)
    n_ctx: int = Field(default=2048, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    stop: list[str] = Field(default_factory=lambda: list(DEFAULT_STOP))
    _engine: LlamaEngine | None = PrivateAttr(default=None)

    def __init__(self, engine: LlamaEngine | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "PerCacheLlamaCPP"

    @property
    def engine(self) -> LlamaEngine:
        """The llama.cpp engine (loaded on first use)."""
        if self._engine is None:
            self._engine = LlamaEngine(resolve_model_path(self.model_path), n_ctx=self.n_ctx)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.n_ctx,
            num_output=self.max_new_tokens,
            model_name=self.model_path or "gemma-3-270m-q4_k_m.gguf",
            is_chat_model=False,
        )

    def _pieces(self, prompt: str) -> Iterator[str]:
        """The completion's text pieces, produced by a thread of their own (an abandoned
        stream never keeps the model from other calls)."""
        events = stream_text(
            self.engine,
            prompt,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            stop=self.stop,
        )
        for piece in BackgroundStream(events):
            if isinstance(piece, str):
                yield piece

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return CompletionResponse(text="".join(self._pieces(prompt)).strip())

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        text = ""
        for piece in self._pieces(prompt):
            text += piece
            yield CompletionResponse(text=text, delta=piece)
