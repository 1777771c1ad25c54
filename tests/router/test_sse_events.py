"""The SSE splitter relays exactly the complete events of any chunking of a stream, holds at most its limit
of an unfinished event, and is torn only while it has passed on part of one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.router.sse_events import EVENT_ENDS, EventSplitter


def complete_events_end(data: bytes) -> int:
    """Where the last complete event of ``data`` ends (0: none): the spec's blank line, any line ending."""
    return max((data.rfind(ending) + len(ending) for ending in EVENT_ENDS if ending in data), default=0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.binary(max_size=12).map(lambda b: b.translate(bytes.maketrans(b"\x00\x01", b"\n\r"))), max_size=20
    ),
    st.integers(0, 16),
)
def test_any_chunking_relays_the_complete_events_and_holds_at_most_the_limit(chunks, limit):
    splitter = EventSplitter(limit)
    seen, relayed = b"", b""
    for chunk in chunks:
        relayed += splitter.feed(chunk)
        seen += chunk
        end = complete_events_end(seen)
        if splitter.torn:
            assert relayed == seen  # passed on as it comes, until the long event ends
        else:
            assert relayed == seen[:end]
            assert len(seen) - len(relayed) <= limit
    assert relayed + splitter.rest() == seen


def test_an_event_end_split_across_chunks_is_found():
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\r") == b""
    assert splitter.feed(b"\n\r") == b""
    assert splitter.feed(b"\ndata: b") == b"data: a\r\n\r\n"
    assert splitter.rest() == b"data: b"
    assert splitter.feed(b"data: c\n\n") == b"data: c\n\n" and not splitter.torn
