"""Which data-parallel replica serves a request: prefix-cache affinity, balanced by load.

Each replica has its own KV cache, so a prompt that shares a prefix with an earlier one is prefilled faster on the
replica that served the earlier one (its prefix blocks are cached there). :class:`PrefixRouter` remembers, for
each replica, the prefixes it was sent, as a chain of hashes of fixed-size character chunks (the analogue of the
engine's block hashes, on text, so the router needs no tokenizer)::

    prompt   | chunk 0 (chunk_chars) | chunk 1 | chunk 2 | tail (< chunk_chars, not remembered) |
    hashes     h0 = H(chunk 0)        h1 = H(h0, chunk 1)   h2 = H(h1, chunk 2)

A replica *matches* ``k`` chunks of a prompt when it was sent ``h0 .. h(k-1)``; ``h(k-1)`` alone identifies the
whole prefix, so a match is a walk along the chain until the first unknown hash.

Policy (:meth:`PrefixRouter.choose`), over the replicas that are up:

1. the replica with the longest match (ties: the lower load, then the lower index), if it matches at least one
   chunk and its load exceeds the least-loaded replica's by at most ``imbalance_threshold`` requests;
2. otherwise the least-loaded replica (ties: the one sent the fewest requests so far, then the lower index, so
   that an idle endpoint spreads distinct prompts evenly).

The chosen replica is then recorded as holding every full chunk of the prompt. The table is an LRU of at most
``max_entries`` hashes; :meth:`forget` drops a replica whose cache is gone (it died and restarted).

Invariant: every hash in the table maps to a non-empty set of replica indexes; the table never exceeds
``max_entries`` hashes.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class RouterConfig:
    """``chunk_chars``: characters per remembered chunk (about one KV block of 16 tokens of English text);
    ``imbalance_threshold``: how many more in-flight requests than the least-loaded replica a prefix match may
    have and still win; ``max_chunks``: the leading chunks of a prompt that count (a longer prompt is routed by
    its first ``max_chunks * chunk_chars`` characters, so routing costs no more for a huge prompt);
    ``max_entries``: hashes remembered in all. Invariant: ints, ``chunk_chars``, ``max_chunks`` and
    ``max_entries`` >= 1, ``imbalance_threshold`` >= 0."""

    chunk_chars: int = 64
    imbalance_threshold: int = 4
    max_chunks: int = 256
    max_entries: int = 100_000

    def __post_init__(self) -> None:
        for name, low in (("chunk_chars", 1), ("imbalance_threshold", 0), ("max_chunks", 1), ("max_entries", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"RouterConfig.{name}={value!r} must be an int >= {low}")


@dataclass(frozen=True)
class Decision:
    """Where a request goes and why: ``reason`` is ``"prefix"`` (the longest cached prefix, ``matched_chunks``
    of it) or ``"least_loaded"``."""

    replica: int
    reason: str
    matched_chunks: int


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """The hash chain of ``text``'s full chunks of ``chunk_chars`` characters (the partial tail is left out)."""
    out: list[bytes] = []
    parent = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hashlib.blake2b(parent + text[start:start + chunk_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=16).digest()
        out.append(parent)
    return out


class PrefixRouter:
    """The routing table of one ingress (not thread-safe: used from its event loop only)."""

    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config if config is not None else RouterConfig()
        self._table: OrderedDict[bytes, set[int]] = OrderedDict()
        self._sent: dict[int, int] = {}   # replica -> requests routed to it so far

    def choose(self, prefix: str, loads: Mapping[int, int]) -> Decision:
        """The replica for a prompt whose routing text is ``prefix``, among the keys of ``loads`` (replica index
        -> requests in flight there; the replicas that are up). Records the choice. ``ValueError`` if ``loads``
        is empty."""
        if not loads:
            raise ValueError("no replica is up to route to")
        hashes = self._hashes(prefix)
        matched = {r: self._match(hashes, r) for r in loads}
        least = min(loads, key=lambda r: (loads[r], self._sent.get(r, 0), r))
        best = min(loads, key=lambda r: (-matched[r], loads[r], r))
        if matched[best] > 0 and loads[best] - loads[least] <= self.config.imbalance_threshold:
            decision = Decision(best, "prefix", matched[best])
        else:
            decision = Decision(least, "least_loaded", matched[least])
        self._record(hashes, decision.replica)
        return decision

    def forget(self, replica: int) -> None:
        """Drop what ``replica`` was sent (its KV cache is gone)."""
        for h in [h for h, owners in self._table.items() if replica in owners]:
            owners = self._table[h]
            owners.discard(replica)
            if not owners:
                del self._table[h]

    def matched_chunks(self, prefix: str, replica: int) -> int:
        """How many leading chunks of ``prefix`` ``replica`` holds (for inspection and tests)."""
        return self._match(self._hashes(prefix), replica)

    def __len__(self) -> int:
        return len(self._table)

    def _hashes(self, prefix: str) -> list[bytes]:
        cfg = self.config
        return chunk_hashes(prefix[:cfg.chunk_chars * cfg.max_chunks], cfg.chunk_chars)

    def _match(self, hashes: list[bytes], replica: int) -> int:
        n = 0
        for h in hashes:
            owners = self._table.get(h)
            if owners is None or replica not in owners:
                break
            n += 1
        return n

    def _record(self, hashes: list[bytes], replica: int) -> None:
        self._sent[replica] = self._sent.get(replica, 0) + 1
        for h in hashes:
            owners = self._table.get(h)
            if owners is None:
                self._table[h] = {replica}
            else:
                owners.add(replica)
                self._table.move_to_end(h)
        while len(self._table) > self.config.max_entries:
            self._table.popitem(last=False)


def _responses_messages(body: Mapping[str, object]) -> list[object]:
    """A Responses request's conversation as chat messages, for routing: ``instructions`` as a system message, a
    string ``input`` as a user message, the message items of a list as they are (other items as messages of
    their type, without text)."""
    messages: list[object] = []
    if isinstance(body.get("instructions"), str):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and "role" not in item:
            item = {"role": item.get("type"), "content": item.get("output")}
        messages.append(item)
    return messages


def routing_text(route: str, body: Mapping[str, object]) -> str:
    """The text whose prefix decides routing: a completion's first prompt (token ids as comma-separated
    numbers), or a chat's messages, each as ``role`` then its text, in order (equal leading messages give
    equal leading text, and so do equal rendered chat-template prefixes); a Responses request's conversation as
    the chat messages it stands for (so that it shares a chat's affinity). Anything else: the empty string
    (no affinity)."""
    if route == "responses":
        return routing_text("chat", {"messages": _responses_messages(body)})
    if route == "completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return ",".join(str(t) for t in prompt)
        return ""
    if route == "chat":
        messages = body.get("messages")
        parts: list[str] = []
        for m in messages if isinstance(messages, list) else []:
            if not isinstance(m, dict):
                break
            parts.append(f"\x1e{m.get('role')}\x1f")
            content = m.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts += [p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
        return "".join(parts)
    return ""
