"""``LlamaServer``: llama.cpp's ``llama-server`` as PerCache's engine, over HTTP.

A server speaks in whole prompts: a request sends a prompt's token ids, and the server
prefills what its slot does not already hold (its ``cache_prompt`` reuse of the longest
common token prefix) and decodes. It cannot hand out logits or cut a prefill where a
client likes, so this engine is not a token-level :class:`~percache_core.kv.engine.Engine`;
it offers what the server's API allows:

- :meth:`LlamaServer.complete`: one completion of a token list, streamed, with
  ``cache_prompt`` on (reuse what the slot holds) or off (a fresh prefill), reporting how
  many tokens the server reused before any text arrives (``prompt_progress.cache``);
- :meth:`LlamaServer.save_slot` / :meth:`LlamaServer.restore_slot`: the slot's tokens and
  KV cells as a file (``--slot-save-path``), the chunk states PerCache stores;
- the text side: ``/tokenize``, ``/detokenize`` and ``/apply-template``.

:mod:`percache_core.engines.llama_server.runner` runs PerCache's prompts on it, exactly: the
answer's text is what the same server gives the same prompt with nothing reused.

Start a server from the build ``make llama-server`` made (``.venv/bin/llama-server``, or
``$PERCACHE_LLAMA_SERVER``), or attach to one you run::

    server = LlamaServer.start("model.gguf")                    # owns the process
    server = LlamaServer(url="http://127.0.0.1:8080",           # yours, started with
                         slot_save_path="/var/cache/slots")     # --slot-save-path
    pc = PerCache.open("cache", engine=server)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ...kv.engine import ChatPrompt, Decoding, EngineFeatures, Sampling
from .launch_choice import with_kernels_chosen
from .server_http import ServerError, ServerHTTP, ServerUnreachable
from .server_process import ServerLaunch, ServerProcess, find_server_binary, free_port
from .server_streams import Completion, InSlot, Relays, UnexpectedReuse, completion_events
from .slot_leases import SlotLeases

logger = logging.getLogger(__name__)

__all__ = [
    "Completion",
    "InSlot",
    "LlamaServer",
    "ServerError",
    "ServerLaunch",
    "ServerUnreachable",
    "SlotLeases",
    "UnexpectedReuse",
    "find_server_binary",
    "free_port",
    "gguf_sliding_window",
]



_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def gguf_sliding_window(path: str | os.PathLike[str]) -> int:
    """The sliding-window size of the model in GGUF file *path* (its
    ``<arch>.attention.sliding_window`` value; 0 when it has none), read from the file's
    header without loading it."""
    with open(path, "rb") as file:

        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            return struct.unpack("<" + fmt, file.read(size))[0]

        def skip(kind: int) -> Any:
            if kind == 8:
                return file.read(read("Q"))
            if kind == 9:
                inner, count = read("I"), read("Q")
                for _ in range(count):
                    skip(inner)
                return None
            return read(_GGUF_SCALARS[kind])

        if file.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read("I")  # version
        read("Q")  # tensors
        for _ in range(read("Q")):
            key = file.read(read("Q")).decode(errors="replace")
            value = skip(read("I"))
            if key.endswith(".attention.sliding_window"):
                return int(value)
    return 0


class LlamaServer:
    """A llama-server, started by :meth:`start` or attached to by its *url*.

    An attached server is used as it runs, with every slot it has (:attr:`leases`): its
    settings are read from ``/props``; chunk states need it to run with
    ``--slot-save-path`` (give the same folder as *slot_save_path*, readable here); where
    that is not so, PerCache keeps only stored answers for it and says why
    (:attr:`chunk_state_problem`). Nothing is sent before the first use.

    >>> server = LlamaServer(url="http://127.0.0.1:8080")   # doctest: +SKIP
    >>> server.tokenize("Hello")                             # doctest: +SKIP
    [9259]
    """

    def __init__(
        self,
        url: str,
        *,
        slot_save_path: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"give the server's http:// address, e.g. http://127.0.0.1:8080 (got {url!r})")
        self.http = ServerHTTP(parts.hostname, parts.port or 80, api_key=api_key, timeout_s=timeout_s)
        self._relays = Relays(self.http)
        self.url = self.http.url
        self.slot_save_path = Path(slot_save_path) if slot_save_path is not None else None
        self._leases: SlotLeases | None = None  # made on first use (the slot count is in /props)
        self._props: dict[str, Any] | None = None
        self._pieces: dict[int, bytes] = {}  # token id -> bytes, from /tokenize
        self._sliding_window: int | None = None
        self._process: ServerProcess | None = None  # a started server's
        self.launch_flags: tuple[str, ...] = ()  # the flags (and VAR=value environment) a started server runs with (but where)
        self.model_path: Path | None = None  # the GGUF (a started server's, or /props' when readable)
        self._n_ubatch = 512  # llama-server's default -ub (a started server's: its launch's)
        self.slots_problem: str | None = None  # why its slots hold no exact states (slot_probe)
        self.slots_shared = False  # one KV cache: a run alone empties the other free slots first (slot_probe)
        self.batch_invariant = False  # started so that a batched run computes as alone (ServerLaunch.batch_invariant)
        self.binary_digest: str | None = None  # a started batch-invariant server's binary's sha256 (its kernels' changes are not in build_info)

    # -- starting and stopping --------------------------------------------------------------

    @classmethod
    def start(cls, model_path: str | os.PathLike[str] | None = None, launch: ServerLaunch | None = None) -> LlamaServer:
        """Start a llama-server on *model_path* and wait until it answers. It runs with the
        launch's slots (default: llama-server's 4, each with a KV cache of its own: see
        :class:`ServerLaunch`), ``-b``/``-ub`` ``n_batch``, ``--swa-full``, ``--cache-ram 0``
        and ``--slot-save-path`` (the launch's, or a temporary folder removed on :meth:`close`); a
        batch-invariant launch's kernels measured for the model once (:mod:`.launch_choice`).
        Returns the started server (close it, or use it as a context manager).

        Args:
            model_path: a GGUF file (None: the bundled model).
            launch: the context, batch, threads, address, slot folder and flags (default: :class:`ServerLaunch`'s).

        Raises:
            ValueError: a context under 64 tokens, a batch under 32, or an unknown kernel switch.
            ServerError: no binary, or the server exited or did not answer in time.

        >>> server = LlamaServer.start(None, ServerLaunch(n_ctx=2048))   # doctest: +SKIP
        >>> server.close()                                               # doctest: +SKIP
        """
        from ...models import file_sha256, resolve_model_path

        model = Path(resolve_model_path(None if model_path is None else str(model_path)))
        launch = with_kernels_chosen(model, launch or ServerLaunch())
        process = ServerProcess(model, launch)
        server = cls(process.url, slot_save_path=process.slot_save_path)
        server._process, server.model_path = process, model
        server.launch_flags = (*process.flags, *(f"{k}={v}" for k, v in sorted(launch.environment().items())))
        server._n_ubatch, server.batch_invariant = launch.n_batch, launch.batch_invariant
        server.binary_digest = file_sha256(process.executable) if launch.batch_invariant else None
        try:
            process.wait_until_ready(server.http, launch.startup_timeout_s)
        except BaseException:
            server.close()
            raise
        return server

    @property
    def owns_process(self) -> bool:
        """Whether this object started the server (and stops it on :meth:`close`)."""
        return self._process is not None

    def close(self) -> None:
        """Stop a server this object started (an attached one keeps running)."""
        self.http.drop_connection()
        process, self._process = self._process, None
        if process is not None:
            process.stop()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what the server is -----------------------------------------------------------------

    @property
    def props(self) -> dict[str, Any]:
        """The server's ``/props`` (read once)."""
        if self._props is None:
            decoded = self._props = self.http.get("/props")
            if self.model_path is None:
                path = Path(str(decoded.get("model_path", "")))
                self.model_path = path if path.is_file() else None
        return self._props

    @property
    def total_slots(self) -> int:  # (-np; 4 when started with no flags)
        return max(1, int(self.props.get("total_slots", 1) or 1))

    @property
    def leases(self) -> SlotLeases:
        """Who uses which of the server's slots now (:class:`SlotLeases`): a run leases one,
        a measurement or a passed-through request the whole server. A started server's every
        slot; an attached one's first only, until :meth:`use_every_slot`."""
        if self._leases is None:
            self._leases = SlotLeases(self.total_slots if self.owns_process else 1, invariant=self.batch_invariant)
        return self._leases

    def use_every_slot(self) -> None:
        """Lease every slot from now on, before any run (``slot_probe`` measured them)."""
        if self.leases.count != self.total_slots:
            self._leases = SlotLeases(self.total_slots)

    @property
    def lock(self) -> AbstractContextManager[None]:
        """The whole server (``leases.whole()``: the start-up measurements)."""
        return self.leases.whole()

    @property
    def n_ubatch(self) -> int:
        """The server's micro-batch (``-ub``): a started server's launch batch; 512 for an
        attached one (llama-server's default: its ``/props`` does not say)."""
        return self._n_ubatch

    @property
    def n_ctx(self) -> int:
        """The slot's context size."""
        return int(self.props.get("default_generation_settings", {}).get("n_ctx", 0))

    @property
    def model_name(self) -> str:
        alias = self.props.get("model_alias") or ""
        return str(alias or Path(str(self.props.get("model_path", "model"))).stem)

    @property
    def api_key(self) -> str | None:
        """The key the server asks for (None: none)."""
        return self.http.api_key

    def models(self) -> dict[str, Any]:
        return self.http.get("/v1/models")

    @property
    def chat_template(self) -> str | None:
        template = self.props.get("chat_template")
        return str(template) if template else None

    @property
    def chunk_state_problem(self) -> str | None:
        """Why this server cannot hold exact chunk states (None: it can, subject to the
        start-up check of :mod:`percache_core.engines.llama_server.runner`)."""
        props = self.props
        if self.slot_save_path is None or not self.slot_save_path.is_dir():
            return "no slot-save folder readable here: start it with --slot-save-path DIR and give that DIR"
        if not (self.owns_process or os.access(self.slot_save_path, os.W_OK)):
            return f"the slot-save folder {self.slot_save_path} is not writable here"
        if self.model_path is None:
            return f"its model file {props.get('model_path')!r} is not readable here (its layout decides which states restore exactly)"
        return self.slots_problem

    @property
    def sliding_window(self) -> int:
        """The model's sliding-window size (0: none), read from its GGUF file once."""
        if self._sliding_window is None:
            self._sliding_window = gguf_sliding_window(self.model_path) if self.model_path is not None else 0
        return self._sliding_window

    @property
    def features(self) -> EngineFeatures:
        """What PerCache can do on this server (read once per server)."""
        return EngineFeatures(chunk_states=self.chunk_state_problem is None)

    @property
    def verdict_key(self) -> str | None:
        """Its self-checks' key on disk: a started server's fingerprint; None for an attached
        one (its flags cannot be read from it: measured in each process)."""
        return self.fingerprint("self-checks") if self.owns_process else None

    @property
    def n_vocab(self) -> int:
        try:
            return int(self.models()["data"][0]["meta"]["n_vocab"])
        except (KeyError, IndexError, TypeError, ValueError) as error:
            raise ServerError("llama-server /v1/models: no n_vocab") from error

    def warm_up(self) -> None:  # (it warms its model up itself when it starts)
        _ = self.props

    def fingerprint(self, extra: str = "") -> str:
        """A digest of what decides the server's output and its slot files' bytes: its build, model (path, size
        and mtime where readable), context size, a started server's flags (and a batch-invariant one's binary,
        whose changed kernels ``build_info`` does not name); plus *extra*."""
        props = self.props
        model, stat = str(props.get("model_path", "")), _size_and_mtime(self.model_path)
        record = json.dumps(
            [props.get("build_info"), model, stat, self.n_ctx, props.get("total_slots"), self.launch_flags, extra]
            + [self.binary_digest] * self.batch_invariant,
            default=str,
        )
        return hashlib.sha256(record.encode()).hexdigest()[:32]

    # -- text -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = False, *, special: bool = False) -> list[int]:
        """The server's token ids of *text* (with BOS where *add_bos* and the model adds one);
        their bytes are kept for :meth:`token_bytes`."""
        body = {"content": text, "add_special": add_bos, "parse_special": special, "with_pieces": True}
        tokens: list[int] = []
        for item in self.http.call("POST", "/tokenize", body)["tokens"]:
            token, piece = int(item["id"]), item["piece"]
            self._pieces[token] = bytes(piece) if isinstance(piece, list) else str(piece).encode("utf-8")
            tokens.append(token)
        return tokens

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The bytes of *token* (as the server printed it when it tokenized it; else asked)."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.detokenize([token]).encode("utf-8")
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self.http.call("POST", "/detokenize", {"tokens": list(tokens)})["content"])

    def stock_chat(self, messages: Sequence[tuple[str, str]]) -> ChatPrompt:
        """The chat laid out as the server's ``/v1/chat/completions`` lays it out (its own
        template, tokenized with special tokens and the model's BOS rule)."""
        body = {"messages": [{"role": role, "content": content} for role, content in messages]}
        prompt = str(self.http.call("POST", "/apply-template", body)["prompt"])
        return ChatPrompt(prompt, add_bos=True)

    def apply_template(self, body: dict[str, Any]) -> str:
        """The prompt the server's ``/v1/chat/completions`` lays out for the OpenAI request
        *body* (its messages, tools and template settings), without running it."""
        return str(self.http.call("POST", "/apply-template", body)["prompt"])

    def format_chat(self, messages: Sequence[tuple[str, str]], *, template: str | None = None) -> str:
        if template is not None:
            raise ServerError("a server formats chats with its own template only")
        return self.stock_chat(messages).text

    def chat_prompt(self, user_message: str) -> str:  # (the engine protocol's)
        return self.format_chat([("user", user_message)])

    def tokenize_chat(self, prompt: str) -> list[int]:
        return self.tokenize(prompt, True, special=True)

    # -- the slot ----------------------------------------------------------------------------

    def complete(
        self,
        tokens: Sequence[int],
        decoding: Decoding,
        *,
        cache_prompt: bool,
        n_probs: int = 0,
        expected_cached: int | None = None,
        slot: InSlot | None = None,
    ) -> Iterator[str]:
        """Stream the completion of *tokens* in *slot* (default: slot 0) with *decoding*
        (its ``max_new_tokens`` set, 0 to prefill only; greedy and no stop strings unless it
        says): yields text pieces; the request's :class:`Completion` is the slot's
        ``completion``, and :attr:`last` (read either once the iterator is done; with
        requests in several slots at once, read the slot's).

        With *cache_prompt* the server reuses the longest common prefix of its slot's tokens
        (at least one token is always prefilled again); without, it prefills everything.
        When *expected_cached* is given and the server reports another reuse before any
        text, the request is cancelled and :class:`UnexpectedReuse` raised (no text was
        yielded). Closing the iterator early cancels the request (the connection is closed).
        """
        sampling, slot = decoding.sampling or Sampling(), slot or InSlot()
        body: dict[str, Any] = {
            "prompt": list(tokens),
            "n_predict": decoding.required_tokens(),
            "cache_prompt": cache_prompt,
            "id_slot": slot.index,
            "stream": True,
            "return_progress": True,
            "return_tokens": True,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop": list(decoding.stop or ()),
            "n_probs": n_probs,
        }
        completion = self.last = slot.completion
        yield from completion_events(self.http, body, completion, expected_cached)

    last: Completion = Completion()

    def relay(
        self,
        path: str,
        body: dict[str, Any],
        *,
        cache_prompt: bool,
        expected: tuple[int, int] | None,
        chunks: list[dict[str, Any]],
        slot: InSlot | None = None,
    ) -> Iterator[str]:
        """Run a client's OpenAI request *body* on the server's own endpoint *path*
        (``/v1/chat/completions`` or ``/v1/completions``) in *slot* (default: slot 0): the server
        lays out the prompt, samples, stops and parses the reply as it does for the client
        alone. Streamed as the client streams it (:class:`Relays`): appends each chunk the
        client would get to *chunks* as it arrives (the server's progress events left out)
        and yields the text each adds; asked whole, the server's reply is *chunks*' one item
        and the completion's ``whole``. The request's :class:`Completion` is the slot's
        ``completion`` and :attr:`last`.

        Before any text, the server must show *expected* = (tokens reused, prompt tokens)
        (the prompt PerCache laid out; None: not checked): otherwise
        :class:`UnexpectedReuse` is raised (a streamed request is cancelled)."""
        slot = slot or InSlot()
        self.last = slot.completion
        settings = {"cache_prompt": cache_prompt, "id_slot": slot.index}
        yield from self._relays.run(path, body, settings, expected, slot, chunks)

    def save_slot(self, filename: str, slot: int = 0) -> int:
        """Save slot *slot*'s tokens and KV cells as *filename* in the slot-save folder; the
        tokens saved."""
        return int(self.http.call("POST", f"/slots/{slot}?action=save", {"filename": filename})["n_saved"])

    def restore_slot(self, filename: str, slot: int = 0) -> int:
        """Load *filename* from the slot-save folder into slot *slot*; the tokens restored
        (:class:`ServerError` when the server refuses the file)."""
        return int(self.http.call("POST", f"/slots/{slot}?action=restore", {"filename": filename})["n_restored"])

    def erase_slot(self, slot: int = 0) -> None:
        self.http.call("POST", f"/slots/{slot}?action=erase", {})


def _size_and_mtime(path: Path | None) -> str:
    """``size:mtime_ns`` of a readable file ("" for None): it changes when the file is replaced."""
    if path is None:
        return ""
    info = path.stat()
    return f"{info.st_size}:{info.st_mtime_ns}"
