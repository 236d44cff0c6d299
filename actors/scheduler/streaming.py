"""How often a request's tokens go to its tokenizer (SGLang's ``--stream-interval``).

Every message between actors costs each side a fraction of a millisecond of Python
(ZMQ, msgpack, asyncio): at batch 1 on a 2-core machine the tokenizer and the client
spent ~0.4 ms each a token, on the cores the worker's step needs. With an interval of
N a request's tokens travel N at a time: its first at once (time to first token is
not delayed), its last with whatever it holds, the rest when N have gathered.
"""

from __future__ import annotations

import msgspec

from ...messages.generate import TokenDelta

__all__ = ["StreamBuffer", "merge_deltas"]


def merge_deltas(a: TokenDelta, b: TokenDelta) -> TokenDelta:
    """``a`` then ``b`` as one delta: the tokens (and their logprobs) of both, the rest
    ``b``'s (the later word on the request)."""

    def both(x: list | None, y: list | None) -> list | None:
        return None if x is None and y is None else [*(x or []), *(y or [])]

    return msgspec.structs.replace(
        b,
        token_ids=[*a.token_ids, *b.token_ids],
        logprobs=both(a.logprobs, b.logprobs),
        top_logprobs=both(a.top_logprobs, b.top_logprobs),
        prompt_tokens=b.prompt_tokens or a.prompt_tokens,
        cached_tokens=max(a.cached_tokens, b.cached_tokens),
    )


class StreamBuffer:
    """The deltas held back between a request's streamed ones."""

    def __init__(self, interval: int) -> None:
        self.interval = max(1, interval)
        self.held: dict[str, TokenDelta] = {}
        self.started: set[str] = set()  # requests whose first tokens went out

    def take(self, deltas: list[TokenDelta]) -> list[TokenDelta]:
        """Of this step's ``deltas``, what goes out now (held tokens merged in front)."""
        if self.interval == 1:
            return deltas
        out: list[TokenDelta] = []
        for d in deltas:
            held = self.held.pop(d.rid, None)
            if held is not None:
                d = merge_deltas(held, d)
            last = d.finish_reason is not None or d.error is not None
            if last:
                self.started.discard(d.rid)
            elif d.rid in self.started and len(d.token_ids) < self.interval:
                self.held[d.rid] = d
                continue
            else:
                self.started.add(d.rid)
            out.append(d)
        return out

    def forget(self, rid: str) -> None:
        """``rid`` ended without a last delta (a stop string, its tokenizer gone)."""
        self.held.pop(rid, None)
        self.started.discard(rid)
