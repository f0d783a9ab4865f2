"""A server-sent-events response that stops at once when the client leaves, then cleans up."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client has disconnected (other messages are drained)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Streams `content` as text/event-stream; `on_close()` runs when it ends or the client goes."""

    def __init__(self, content: AsyncIterator[str], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)

    async def on_close(self) -> None:
        """Release what the stream holds (subclasses: abort requests, unregister viewers)."""
        await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        watch_task = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream_task, watch_task):
                task.cancel()
            await asyncio.gather(stream_task, watch_task, return_exceptions=True)
            await self.on_close()
        if not stream_task.cancelled() and stream_task.exception() is not None:
            error = stream_task.exception()
            if not isinstance(error, OSError):  # OSError: the client went away mid-send
                raise error  # type: ignore[misc]
