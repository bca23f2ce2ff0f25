"""An :class:`LLMEngine` driven by one background thread, fed and drained from an asyncio event loop.

Threading model (the invariant everything else relies on): **only the engine thread touches the engine's
mutable state** (``add_request``, ``abort_request``, ``step``, ``stats``) **and the engine's tokenizer**
(requests arrive as token ids; the server tokenizes with its own instance, see
:mod:`kv8.entrypoints.openai.tokenizer`). The event loop talks to the thread through an inbox guarded by a
condition variable:

* :meth:`AsyncEngine.add` puts ``(request_id, prompt token ids, params, mailbox)`` in the inbox and awaits a
  future that the engine thread resolves once ``add_request`` accepted (or rejected) the request;
* :meth:`AsyncEngine.abort` puts a request id in the inbox; the thread aborts it before its next step, which
  frees the request's KV blocks;
* after every step the thread posts each changed :class:`RequestOutput` to the request's :class:`OutputMailbox`
  with ``loop.call_soon_threadsafe`` and refreshes a snapshot of ``engine.stats()`` (read by ``/metrics``).
  Outputs are cumulative, so a mailbox keeps only the latest one per request: a client that stops reading
  costs one output's memory, not one per step.

While any request is unfinished the thread steps back to back, so requests that arrive meanwhile join the
running batch at the next step (continuous batching); when idle it sleeps on the condition variable.
If a step raises, the engine is considered broken (a failure of one request alone does not raise: the engine
finishes that request with an error and goes on): every open request receives an :class:`EngineDeadError` in its
mailbox, later ``add`` calls raise it, :attr:`error` is set (``/health`` then reports failure), and
``on_failure(error)`` runs on the event loop: ``kv8 serve`` exits non-zero there, so that a supervisor restarts
it, rather than lingering and answering 503. The same happens at once, without waiting for a step, when
something outside the engine reports it broken (:meth:`AsyncEngine.fail`): a tensor-parallel worker process
that exits calls it from the group's watch thread, so an idle server goes down too.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kv8.distributed.group import TensorParallelError
from kv8.engine.engine import LLMEngine
from kv8.engine.stats import EngineStats
from kv8.outputs import RequestOutput
from kv8.sampling_params import SamplingParams

logger = logging.getLogger("kv8.server")

# What a mailbox receives: (request_id, output) or (request_id, exception).
QueueItem = tuple[str, "RequestOutput | BaseException"]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (a step raised, or the server is shutting down)."""


class OutputMailbox:
    """Where the engine delivers the outputs of one or more requests; used on the event loop thread only.

    Holds at most one item per request id: a newer output replaces an unread older one (outputs are
    cumulative); an exception is never replaced.
    """

    def __init__(self) -> None:
        self._items: dict[str, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    def put_nowait(self, item: QueueItem) -> None:
        rid, value = item
        if isinstance(self._items.get(rid), BaseException):
            return
        self._items[rid] = value
        self._ready.set()

    async def get_all(self) -> list[QueueItem]:
        """Wait until something arrived; return and clear everything (cancel-safe: nothing is lost)."""
        await self._ready.wait()
        self._ready.clear()
        items = list(self._items.items())
        self._items.clear()
        return items


@dataclass
class _NewRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mailbox: OutputMailbox
    accepted: asyncio.Future[None]


class AsyncEngine:
    """Owns the engine thread. Create it, then call :meth:`start` from inside the running event loop."""

    def __init__(self, engine: LLMEngine, on_failure: Callable[[BaseException], None] | None = None) -> None:
        self.engine = engine
        self.on_failure = on_failure   # called on the event loop once, when the engine thread failed
        self._cv = threading.Condition()
        self._new: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._mailboxes: dict[str, OutputMailbox] = {}   # engine thread only
        self._stopping = False
        self._abort_all_reason: str | None = None
        self._failure: BaseException | None = None   # set by fail(); raised by the engine thread
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._stats: EngineStats = engine.stats()

    # ---- event-loop side ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        tp = self.engine.tp
        if tp.size > 1 and tp.is_driver:
            tp.on_rank_exit.append(lambda what: self.fail(TensorParallelError(
                f"tensor-parallel {what}; the engine cannot continue and must be restarted")))
        self._thread = threading.Thread(target=self._run, name="kv8-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stats(self) -> EngineStats:
        """The engine's ``stats()`` as of the end of the engine thread's last iteration."""
        with self._cv:
            return self._stats

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  mailbox: OutputMailbox) -> None:
        """Queue a request; returns once the engine accepted it. Raises ``ValueError`` if the engine rejects it,
        :class:`EngineDeadError` if the engine is not running. Outputs then arrive in ``mailbox``."""
        if self._loop is None:
            raise RuntimeError("AsyncEngine.add() before start()")
        fut: asyncio.Future[None] = self._loop.create_future()
        with self._cv:
            if self._stopping or self.error is not None:
                raise EngineDeadError("the engine is not running" if self.error is None
                                      else f"the engine failed: {self.error!r}")
            self._new.append(_NewRequest(request_id, list(prompt_token_ids), params, mailbox, fut))
            self._cv.notify()
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); its blocks are freed before the next step."""
        with self._cv:
            self._aborts.append(request_id)
            self._cv.notify()

    def abort_all(self, reason: str) -> None:
        """Abort every request now; each one's mailbox receives an :class:`EngineDeadError` with ``reason``.
        The engine keeps running (used when a graceful shutdown runs out of time)."""
        with self._cv:
            self._abort_all_reason = reason
            self._cv.notify()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything still running and stop the thread (waits at most ``timeout`` seconds)."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.1f s", timeout)

    # ---- engine thread --------------------------------------------------------------------------------------
    def _post(self, mailbox: OutputMailbox, item: QueueItem) -> None:  # engine thread -> event loop
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(mailbox.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _settle(self, fut: asyncio.Future[None], exc: BaseException | None) -> None:
        def settle() -> None:
            if fut.done():
                return
            if exc is None:
                fut.set_result(None)
            else:
                fut.set_exception(exc)
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def fail(self, error: BaseException) -> None:
        """Report the engine broken from any thread: the engine thread raises ``error`` before its next step (or
        as soon as it is idle), which fails every open request and calls ``on_failure`` as a failed step does."""
        with self._cv:
            if self._failure is None:
                self._failure = error
            self._cv.notify_all()

    def _take_inbox(self) -> tuple[list[_NewRequest], list[str], str | None, bool]:
        with self._cv:
            while not (self._new or self._aborts or self._stopping or self._abort_all_reason is not None
                       or self._failure is not None or self.engine.has_unfinished_requests()):
                self._cv.wait()
            new, aborts, self._new, self._aborts = self._new, self._aborts, [], []
            abort_all, self._abort_all_reason = self._abort_all_reason, None
            if self._failure is not None:
                raise self._failure
            return new, aborts, abort_all, self._stopping

    def _run(self) -> None:
        try:
            while True:
                new, aborts, abort_all, stopping = self._take_inbox()
                for item in new:
                    try:
                        self.engine.add_request(item.prompt_token_ids, item.params, request_id=item.request_id)
                    except ValueError as e:
                        self._settle(item.accepted, e)
                        continue
                    self._mailboxes[item.request_id] = item.mailbox
                    self._settle(item.accepted, None)
                for rid in aborts:
                    if self.engine.abort_request(rid):
                        logger.debug("aborted request %s", rid)
                    self._mailboxes.pop(rid, None)
                if stopping:
                    self._abort_all(EngineDeadError("the server is shutting down"))
                    return
                if abort_all is not None:
                    self._abort_all(EngineDeadError(abort_all))
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                with self._cv:
                    self._stats = self.engine.stats()
                for out in outputs:
                    mailbox = self._mailboxes.get(out.request_id)
                    if mailbox is None:
                        continue
                    if out.finished:
                        del self._mailboxes[out.request_id]
                    self._post(mailbox, (out.request_id, out))
        except Exception as e:  # noqa: BLE001 - a broken engine must not hang its clients
            logger.exception("the engine thread failed")
            with self._cv:
                self.error = e
                pending, self._new = self._new, []
            for item in pending:
                self._settle(item.accepted, EngineDeadError(f"the engine failed: {e!r}"))
            self._abort_all(EngineDeadError(f"the engine failed: {e!r}"))
            if self.on_failure is not None and self._loop is not None:
                try:
                    self._loop.call_soon_threadsafe(self.on_failure, e)
                except RuntimeError:  # the loop is closed: the server is gone already
                    pass

    def _abort_all(self, exc: EngineDeadError) -> None:
        for rid, mailbox in list(self._mailboxes.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - best effort while going down
                logger.exception("could not abort %s", rid)
            self._post(mailbox, (rid, exc))
        self._mailboxes.clear()
        with self._cv:
            try:
                self._stats = self.engine.stats()
            except Exception:  # noqa: BLE001
                pass
