"""Stop strings on streamed text: no part of a stop string ever reaches the caller.

A stop string can span several tokens ("</answer>" may be "</", "ans", "wer>"), and a
stream sends text as each token completes it. So the text that could still be the
start of a stop string is held back until the next token says whether it is one:

    stop = ["</answer>"]
    feed("42 </")     -> ("42 ", False)    "</" could start the stop: held
    feed("ans")       -> ("", False)       "</ans" still could
    feed("wer> ok")   -> ("", True)        the stop: what is held is dropped, the request ends
    (a stream that ends without a stop: flush() sends what is held)

The text sent, joined, is the request's whole text cut before its first stop string,
which is what the non-streamed response holds: OpenAI's `stop` leaves the stop string
out of the text.
"""

from __future__ import annotations

from ..errors import AotcError


class StopError(AotcError):
    """A stop list that cannot be used."""


class StopText:
    """One request's stop strings over its streamed text (module docstring)."""

    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        if isinstance(stops, str):
            stops = [stops]
        if any(not isinstance(s, str) or not s for s in stops):
            raise StopError(f"stop: {list(stops)!r}; expected non-empty strings")
        self.stops = list(stops)
        self.held = ""
        self.text = ""  # everything sent so far
        self.stopped = False

    def feed(self, delta: str) -> tuple[str, bool]:
        """The part of `delta` (with what was held) that can be sent now, and whether a stop
        string was found; after a stop nothing more is sent."""
        if self.stopped:
            return "", True
        buffer = self.held + delta
        found = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if found:
            send, self.held, self.stopped = buffer[: min(found)], "", True
        else:
            keep = self._could_start(buffer)
            send, self.held = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.text += send
        return send, self.stopped

    def flush(self) -> str:
        """What is held, sent when the stream ends without a stop string."""
        send, self.held = ("" if self.stopped else self.held), ""
        self.text += send
        return send

    def _could_start(self, buffer: str) -> int:
        """The length of the longest end of `buffer` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
