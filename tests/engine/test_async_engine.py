"""The async engine's parts (:mod:`kv8.engine.async_engine`): the output mailbox keeps each request's latest
output, and an error, which is never replaced."""

from __future__ import annotations

from typing import Any


def test_output_mailbox_keeps_latest_and_errors() -> None:
    import asyncio

    from kv8.engine.async_engine import OutputMailbox

    async def scenario() -> list[Any]:
        box = OutputMailbox()
        box.put_nowait(("a", "a1"))  # type: ignore[arg-type]
        box.put_nowait(("a", "a2"))  # type: ignore[arg-type]
        box.put_nowait(("b", "b1"))  # type: ignore[arg-type]
        first = await box.get_all()
        err = RuntimeError("down")
        box.put_nowait(("a", err))
        box.put_nowait(("a", "a3"))  # type: ignore[arg-type]  # an error is never replaced
        second = await box.get_all()
        waiting = asyncio.ensure_future(box.get_all())
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing new: get_all waits
        waiting.cancel()
        return [first, second]

    first, second = asyncio.run(scenario())
    assert first == [("a", "a2"), ("b", "b1")]
    assert len(second) == 1 and isinstance(second[0][1], RuntimeError)
