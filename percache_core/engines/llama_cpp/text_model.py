"""The text side of a llama.cpp model: its tokenizer and chat template (the
:class:`~percache_core.kv.engine.TextModel` half of an engine). ``LlamaEngine`` adds the
sequence side on top of it."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ...errors import EngineError
from ...kv.engine import ChatPrompt

# what llama-cpp-python's Llama picks for a GGUF template it recognises (its
# guess_chat_format_from_gguf_metadata names -> the formatters registered under them)
_NAMED_FORMATTERS = {"chatml": "format_chatml", "mistral-instruct": "format_mistral_instruct", "llama-3": "format_llama3"}


class LlamaTextModel:
    """Tokenizing, detokenizing and chat formatting with a loaded llama.cpp model (*lc*:
    llama-cpp-python's low-level bindings, *model*: its ``llama_model`` pointer)."""

    def __init__(self, lc: Any, model: Any, model_path: Path) -> None:
        self._lc = lc
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)
        self.model_path = model_path
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)

    @property
    def model_name(self) -> str:
        return self.model_path.name

    # -- tokens ---------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]:
        """Token ids of *text*; with *special*, markup such as ``<start_of_turn>`` in the
        text becomes special tokens (for chat-template prompts)."""
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buffer = (self._lc.llama_token * capacity)()
        count = self._lc.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_bos, special)
        if count < 0:
            capacity = -count
            buffer = (self._lc.llama_token * capacity)()
            count = self._lc.llama_tokenize(self._vocab, data, len(data), buffer, capacity, add_bos, special)
        if count < 0:
            raise EngineError(f"tokenization failed for a text of {len(data)} bytes")
        return list(buffer[:count])

    @property
    def chat_template(self) -> str | None:
        """The chat template stored in the GGUF file, if any."""
        template = self._lc.llama_model_chat_template(self._model, None)
        return template.decode("utf-8", "replace") if template else None

    def chat_prompt(self, user_message: str) -> str:
        """*user_message* as one user turn in the model's chat template, ready for the
        assistant's reply (tokenize it with ``special=True`` and no extra BOS)."""
        return self.format_chat([("user", user_message)])

    def format_chat(self, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str:
        """(role, content) messages in the GGUF file's chat template, or in *template* (a
        llama.cpp built-in name such as ``"gemma"``, or template text it recognises):
        llama.cpp's own rendering, ending with the assistant's turn opened. Raises
        EngineError when there is no template or llama.cpp cannot apply it."""
        chosen = template.encode("utf-8") if template else self._lc.llama_model_chat_template(self._model, None)
        if not chosen:
            raise EngineError(f"{self.model_name} has no chat template")
        if not messages:
            raise ValueError("no messages to format")
        encoded = [(role.encode("utf-8"), content.encode("utf-8")) for role, content in messages]
        array = (self._lc.llama_chat_message * len(encoded))()
        for slot, (role, content) in zip(array, encoded):
            slot.role, slot.content = role, content
        size = 2 * sum(len(content) for _, content in encoded) + 1024
        buffer = ctypes.create_string_buffer(size)
        count = self._lc.llama_chat_apply_template(chosen, array, len(encoded), True, buffer, size)
        if count > size:
            buffer = ctypes.create_string_buffer(count)
            count = self._lc.llama_chat_apply_template(chosen, array, len(encoded), True, buffer, count)
        if count < 0:
            raise EngineError("llama.cpp could not apply the chat template")
        return buffer.raw[:count].decode("utf-8", "replace")

    def stock_chat(self, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
        """(role, content) *messages* laid out as stock ``llama_cpp.Llama.create_chat_completion``
        lays them out by default, with llama-cpp-python's own formatters: the GGUF file's
        chat template rendered by its Jinja2 formatter (or the named format it recognises
        the template as), and llama-cpp-python's fallback ``llama-2`` format for a file
        without a template. So a chat gives stock's text on every GGUF."""
        if not messages:
            raise ValueError("no messages to format")
        from llama_cpp import llama_chat_format  # llama-cpp-python's public formatters

        requests = [{"role": role, "content": content} for role, content in messages]
        template = self.chat_template
        if template is None:
            response = llama_chat_format.format_llama2(messages=requests)
        else:
            name = llama_chat_format.guess_chat_format_from_gguf_metadata({"tokenizer.chat_template": template})
            if name in _NAMED_FORMATTERS:
                response = getattr(llama_chat_format, _NAMED_FORMATTERS[name])(messages=requests)
            else:
                eos, bos = self._lc.llama_vocab_eos(self._vocab), self._lc.llama_vocab_bos(self._vocab)
                formatter = llama_chat_format.Jinja2ChatFormatter(
                    template=template,
                    eos_token=self._token_text(eos),
                    bos_token=self._token_text(bos),
                    stop_token_ids=[eos],
                )
                response = formatter(messages=requests)
        stop = response.stop
        stops = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
        return ChatPrompt(response.prompt, not response.added_special, tuple(s for s in stops if s))

    def _token_text(self, token: int) -> str:
        """A token's text as llama-cpp-python's ``Llama`` passes it to chat templates."""
        if token < 0:
            return ""
        return self._lc.llama_vocab_get_text(self._vocab, token).decode("utf-8")

    def tokenize_chat(self, prompt: str) -> list[int]:
        """Tokens of a chat-template prompt: markup as special tokens, BOS added only if the
        template did not write it."""
        bos = self._lc.llama_vocab_bos(self._vocab)
        bos_text = self.token_bytes(bos, special=True).decode("utf-8", "replace") if bos >= 0 else ""
        starts_with_bos = bool(bos_text) and prompt.startswith(bos_text)
        return self.tokenize(prompt, not starts_with_bos, special=True)

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes a token stands for (may be part of a UTF-8 character)."""
        buffer = ctypes.create_string_buffer(64)
        count = self._lc.llama_token_to_piece(self._vocab, token, buffer, 64, 0, special)
        if count < 0:
            buffer = ctypes.create_string_buffer(-count)
            count = self._lc.llama_token_to_piece(self._vocab, token, buffer, -count, 0, special)
        return buffer.raw[:count]

    def is_end_of_generation(self, token: int) -> bool:
        return bool(self._lc.llama_vocab_is_eog(self._vocab, token))
