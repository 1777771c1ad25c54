"""``GrammarMatcher``: where one sequence stands in its grammar (docs/architecture.md#structured-outputs).

It advances with every token the sequence appends (``accept``). ``is_finished`` once the grammar admits
nothing more: the engine then ends the sequence with ``finish_reason: "stop"``; while the grammar could
end or go on, the mask also allows EOS. A parallel sample or a beam forks its parent's matcher.
"""

from __future__ import annotations

import llguidance


class GrammarMatcher:
    __slots__ = ("kind", "ll")

    def __init__(self, ll: llguidance.LLMatcher, kind: str) -> None:
        #: the llguidance matcher (``bitmask.py`` fills masks from it)
        self.ll = ll
        #: the constraint's kind (``StructuredOutputsParams.kind``)
        self.kind = kind

    def accept(self, token: int) -> bool:
        """Advance by ``token``; False if the grammar forbids it (the matcher is then in error)."""
        return self.ll.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar accepts from here (the matcher does not move)."""
        return self.ll.validate_tokens(tokens)

    @property
    def is_finished(self) -> bool:
        """The grammar is complete and admits no further token (EOS included)."""
        return self.ll.is_stopped()

    @property
    def error(self) -> str | None:
        return self.ll.get_error() if self.ll.is_error() else None

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self.ll.deep_copy(), self.kind)
