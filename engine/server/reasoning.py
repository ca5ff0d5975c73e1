"""A reasoning model's answer cut into its thoughts and the rest (``--reasoning-parser``):
``message.reasoning_content`` and ``message.content``, whole or as stream deltas, by the
end-of-think token's position in the completion's token ids."""

from __future__ import annotations

from collections.abc import Sequence

from baton.engine.config import REASONING_PARSERS
from baton.engine.tokenizer import Tokenizer
from baton.grammar.reasoning import reasoning_token_ids


class ReasoningSplitter:
    """Cuts completions of ``parser``'s model at its end-of-think token.

    Raises:
        ValueError: the tokenizer lacks the parser's tokens (``reasoning_token_ids``).
    """

    def __init__(self, tokenizer: Tokenizer, parser: str) -> None:
        self.start_text, self.end_text = REASONING_PARSERS[parser]
        self.start_id, self.end_id = reasoning_token_ids(tokenizer, self.start_text, self.end_text)
        self.tokenizer = tokenizer

    def thinks_first(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a completion of this prompt begins with thoughts (its template did not
        close them: no end-of-think token after the last start)."""
        ids = list(prompt_token_ids)
        last_end = max((i for i, t in enumerate(ids) if t == self.end_id), default=-1)
        last_start = max((i for i, t in enumerate(ids) if t == self.start_id), default=-1)
        return last_end <= last_start

    def split(
        self, text: str, token_ids: Sequence[int], thinks_first: bool
    ) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` of a completion's text (as the engine detokenised
        it, stop strings cut) and tokens: the text before and after the end-of-think token
        (content None while the thoughts have not ended); all of it content where the
        completion did not begin with thoughts."""
        if not thinks_first:
            return None, text
        if self.end_text in text:  # the end token is text (not a skipped special token)
            reasoning, _, content = text.partition(self.end_text)
            return reasoning.replace(self.start_text, ""), content
        ids = list(token_ids)
        if self.end_id not in ids:
            return text.replace(self.start_text, ""), None
        reasoning = self.tokenizer.decode(ids[: ids.index(self.end_id)])
        if text.startswith(reasoning):
            return reasoning, text[len(reasoning) :]
        return reasoning, self.tokenizer.decode(ids[ids.index(self.end_id) + 1 :])

    def reasoning_tokens(self, token_ids: Sequence[int], thinks_first: bool) -> int:
        """Tokens of the thoughts (up to and with the end-of-think token) for usage."""
        if not thinks_first:
            return 0
        ids = list(token_ids)
        return ids.index(self.end_id) + 1 if self.end_id in ids else len(ids)


class ReasoningDeltas:
    """One streamed choice's deltas: ``reasoning_content`` until the end-of-think token,
    ``content`` after it (the text of each side recomputed from the ids so far, the new
    part sent)."""

    def __init__(self, splitter: ReasoningSplitter, thinks_first: bool) -> None:
        self.splitter = splitter
        self.thinks_first = thinks_first
        self._sent = ("", "")

    def delta(self, text: str, token_ids: Sequence[int]) -> dict[str, str]:
        """The new reasoning and content text since the last call (``text``, ``token_ids``:
        the completion's so far)."""
        reasoning, content = self.splitter.split(text, token_ids, self.thinks_first)
        now = (reasoning or "", content or "")
        out = {}
        for key, part, sent in zip(("reasoning_content", "content"), now, self._sent, strict=True):
            if len(part) > len(sent) and part.startswith(sent):
                out[key] = part[len(sent) :]
        self._sent = now
        return out

    @property
    def content(self) -> str:
        """The content (the text after the thoughts) as of the last ``delta``."""
        return self._sent[1]
