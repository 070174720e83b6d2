"""Whether a llama-server's slots compute independently of each other: measured once on a
server PerCache attaches to, before it uses more than one of its slots.

A server PerCache starts gives each slot a KV cache of its own (``--no-kv-unified``), and a
request there is computed as on a fresh server whatever the other slots hold (measured on
Gemma 3: identical log-probabilities fresh and restored, in slot 0 of an empty server and in
slots 0, 2 and 3 beside slots holding other prompts). In one cache that the slots share
(llama-server's default), a request's cells lie among the other slots' and its arithmetic
changes with them (measured: another slot's 480 tokens changed a fresh prefill's
log-probabilities), unless the server clears the idle slots first (its ``--cache-idle-slots``,
on by default with ``--cache-ram``). So :func:`slots_independent` checks it on the server
itself: a prompt's first-token log-probabilities, fresh with the other slots empty, then fresh
and (where slot files work) restored from a state while another slot holds other tokens.
Where restored ones match only once the other slots are emptied (measured on a default
server, SmolLM2: restored beside another slot's tokens, other log-probabilities; restored
into slot 0 or 2 with the others erased, identical), PerCache uses every slot and a run that
computes alone first empties the other free slots (:attr:`LlamaServer.slots_shared`; where it
can, through the server's own idle-slot save to its RAM prompt cache, so that little is lost:
``SlotPool.clear_others``). Where fresh
requests match but restored ones do not, PerCache uses every slot and keeps no chunk states
there (stored answers only); where fresh ones differ too, it uses one slot of that server
(as exact as before, one request at a time).
"""

from __future__ import annotations

import uuid

from ...kv.engine import Decoding, EngineVerdicts
from ...kv.probe_text import probe_tokens
from .cuts import first_logprobs
from .server import InSlot, LlamaServer

_verdicts: EngineVerdicts[int] = EngineVerdicts("server_slots_independent", decode=int)
# what computes as on a fresh server: fresh requests, restored states once the other slots are
# erased, restored states whatever the other slots hold
FRESH, ISOLATED, RESTORED = 1, 2, 3
_PROMPT_TOKENS = 300
_STATE_TOKENS = 128


def slots_independent(server: LlamaServer) -> int:
    """What in *server*'s slots is computed as on a fresh server whatever its other slots
    hold (see the module): 0 (nothing), :data:`FRESH` (fresh requests), :data:`ISOLATED`
    (restored states too, once the other slots are erased) or :data:`RESTORED` (restored
    states too, where slot files work); :data:`RESTORED` for a one-slot server,
    measured once per server otherwise (remembered on disk for one PerCache started). Holds
    the whole server."""
    if server.total_slots < 2:
        return RESTORED
    known, value = _verdicts.known(server)
    if known:
        return int(value or 0)
    with server.lock:
        tokens = probe_tokens(server, 2 * _PROMPT_TOKENS)  # type: ignore[arg-type]
        prompt, other = tokens[:_PROMPT_TOKENS], tokens[:1] + tokens[_PROMPT_TOKENS:]
        for slot in range(server.total_slots):
            server.erase_slot(slot)
        reference = first_logprobs(server, prompt)
        prefill_fresh(server, other, 1)
        verdict = FRESH if first_logprobs(server, prompt) == reference else 0
        if verdict and server.chunk_state_problem is None:
            if _restored_logprobs(server, prompt, other) == reference:
                verdict = RESTORED
            elif _restored_logprobs(server, prompt, other, isolated=True) == reference:
                verdict = ISOLATED
        for slot in range(server.total_slots):
            server.erase_slot(slot)
    _verdicts.keep(server, verdict)
    return verdict


def prefill_fresh(server: LlamaServer, tokens: list[int], slot: int) -> None:
    """Prefill *tokens* in *slot* of *server*, nothing reused and nothing generated."""
    for _ in server.complete(tokens, Decoding(0), cache_prompt=False, slot=InSlot(slot)):
        pass


def _restored_logprobs(server: LlamaServer, prompt: list[int], other: list[int], *, isolated: bool = False) -> object:
    """:func:`~percache_core.engines.llama_server.cuts.first_logprobs` of *prompt* from a state of its first tokens, restored into
    slot 0 while slot 1 holds *other* (*isolated*: slot 1 erased first)."""
    assert server.slot_save_path is not None
    name = f"percache-probe-{uuid.uuid4().hex}.bin"
    try:
        prefill_fresh(server, prompt[:_STATE_TOKENS], 0)
        server.save_slot(name, 0)
        server.erase_slot(0)
        prefill_fresh(server, other, 1)
        if isolated:
            server.erase_slot(1)
        server.restore_slot(name, 0)
        return first_logprobs(server, prompt, _STATE_TOKENS)
    finally:
        (server.slot_save_path / name).unlink(missing_ok=True)
