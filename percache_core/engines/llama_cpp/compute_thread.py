"""One thread that makes every llama.cpp call of the process's engines.

llama.cpp's CPU backend is built with OpenMP by default (``make`` turns it off, for the
reason at the end): each OS thread that calls
``llama_decode`` gets a team of worker threads of its own, and a team that has just
finished spins on the cores for a while before it sleeps. PerCache calls the model from
several Python threads (the caller's, the threads that produce streams, the idle worker),
so several teams existed, and one spun on the two cores while another computed: a sequence
of RAG chat turns ran 1.21x slower than stock ``llama_cpp.Llama``, which calls from one
thread. A :class:`ComputeThread` runs the calls on one thread, whatever thread asks. The
engine's lock still orders who asks.

It is one thread for the whole process (:func:`process_compute_thread`), not one per
engine: once two threads have each called ``llama_decode``, the process holds more
OpenMP threads than cores, and libgomp then stops spinning at its barriers. A decode step
(hundreds of barriers a token) of Gemma 3 270M took 34 ms instead of 20 ms on 2 cores for
every model in the process, measured with a second model (an engine for another context
length, or stock ``llama_cpp.Llama`` beside it) that had computed once from another thread.
Other libraries' teams share that count: after an app's torch embedder (a HuggingFace
model) had run on the app's thread, a decode step took 38 ms instead of 24, where stock
calling from that same thread took 25. ggml's own thread pool (a build with
``-DGGML_OPENMP=OFF``, as ``make`` builds it) has no such count: 24.5 ms with torch beside
it (measured 2026-12-06).

>>> worker = ComputeThread("example")
>>> worker.call(sum, [1, 2, 3])
6
>>> worker.close()
>>> process_compute_thread() is process_compute_thread()
True
"""

from __future__ import annotations

import _thread
import functools
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

R = TypeVar("R")

_STOP = object()


class _Call:
    """One call handed to the thread; ``done`` is released when it has run."""

    __slots__ = ("function", "args", "kwargs", "value", "error", "done")

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.value: Any = None
        self.error: BaseException | None = None
        self.done = _thread.allocate_lock()  # the cheapest hand-back CPython has
        self.done.acquire()


class ComputeThread:
    """A daemon thread, started on the first call, that runs the functions handed to it
    one at a time and hands back their results (or raises their errors in the caller). A
    call made from the thread itself runs at once."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    def call(self, function: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """``function(*args, **kwargs)`` run on this thread; its value, or its error raised
        here."""
        if threading.get_ident() == self._ident:
            return function(*args, **kwargs)
        if self._thread is None or self._closed:
            self._start()  # raises once closed
        call = _Call(function, args, kwargs)
        self._calls.put(call)
        call.done.acquire()
        if call.error is not None:
            raise call.error
        return call.value

    def _start(self) -> None:
        with self._start_lock:
            if self._closed:
                raise RuntimeError(f"the compute thread {self._name!r} is closed")
            if self._thread is None:
                started = threading.Event()
                thread = threading.Thread(target=self._loop, args=(started,), name=self._name, daemon=True)
                thread.start()
                started.wait()
                self._thread = thread

    def _loop(self, started: threading.Event) -> None:
        self._ident = threading.get_ident()
        started.set()
        calls = self._calls
        while True:
            call = calls.get()
            if call is _STOP:
                return
            try:
                call.value = call.function(*call.args, **call.kwargs)
            except BaseException as error:  # handed to the caller
                call.error = error
            call.done.release()

    def close(self) -> None:
        """Let the thread end once the calls before this one have run (idempotent)."""
        with self._start_lock:
            self._closed = True
            if self._thread is not None:
                self._calls.put(_STOP)


_process_thread: ComputeThread | None = None
_process_thread_lock = threading.Lock()


def process_compute_thread() -> ComputeThread:
    """The compute thread every in-process engine shares (started on its first call; it is
    never closed: it is a daemon thread, idle when nothing computes)."""
    global _process_thread
    with _process_thread_lock:
        if _process_thread is None:
            _process_thread = ComputeThread("percache-compute")
        return _process_thread


def on_compute_thread(method: Callable[..., R]) -> Callable[..., R]:
    """Run an engine method on the engine's ``compute`` thread (see :class:`ComputeThread`)."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> R:
        return self.compute.call(method, self, *args, **kwargs)

    return wrapper
