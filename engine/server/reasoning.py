"""A reasoning model's answer cut into its thoughts and the rest (``--reasoning-parser``):
``message.reasoning_content`` and ``message.content``, whole or as stream deltas, by the
end-of-think token's position in the completion's token ids (gpt-oss: by the channels of its
harmony messages, ``HarmonySplitter``)."""

from __future__ import annotations

from collections.abc import Sequence

from baton.engine.config import REASONING_PARSERS
from baton.engine.server.harmony import HarmonyTokens, harmony_messages
from baton.engine.tokenizer import Tokenizer
from baton.grammar.reasoning import reasoning_token_ids
from baton.grammar.tool_formats import FUNCTION_NAME, OPENAI

# The parsers whose model writes harmony (``HarmonySplitter``).
_HARMONY = frozenset({"openai_gptoss"})


def reasoning_splitter(tokenizer: Tokenizer, parser: str) -> ReasoningSplitter:
    """The splitter of ``parser`` (a ``REASONING_PARSERS`` name) for ``tokenizer``'s model.

    Raises:
        ValueError: the tokenizer lacks the parser's tokens.
    """
    cls = HarmonySplitter if parser in _HARMONY else ReasoningSplitter
    return cls(tokenizer, parser)


class ReasoningSplitter:
    """Cuts completions of ``parser``'s model at its end-of-think token.

    Raises:
        ValueError: the tokenizer lacks the parser's tokens (``reasoning_token_ids``).
    """

    def __init__(self, tokenizer: Tokenizer, parser: str) -> None:
        markers = REASONING_PARSERS[parser]
        self.start_text, self.end_text = markers.start, markers.end
        self.markers = reasoning_token_ids(
            tokenizer, markers.start, markers.end, markers.forced_prefix
        )
        self.start_id, self.end_id = self.markers.start, self.markers.end[-1]
        self.tokenizer = tokenizer

    def thinks_first(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether a completion of this prompt begins with thoughts (its template did not
        close them: no end of the thoughts after the last start)."""
        return self.markers.thinks_first(prompt_token_ids)

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


class HarmonySplitter(ReasoningSplitter):
    """gpt-oss's completions cut by harmony channel (``harmony.py``): the analysis messages
    are the thoughts, the final ones (and commentary without a recipient, the preambles
    shown to users) the content. A call (a message to ``functions.NAME``) is written into the
    content in the text of the ``openai`` tool-call format, for its parser to read; messages
    to other recipients (built-in tools) are left out.

    Raises:
        ValueError: the tokenizer lacks harmony's special tokens.
    """

    def __init__(self, tokenizer: Tokenizer, parser: str) -> None:
        super().__init__(tokenizer, parser)
        self.special = HarmonyTokens.of(tokenizer)

    def split(
        self, text: str, token_ids: Sequence[int], thinks_first: bool
    ) -> tuple[str | None, str | None]:
        """``(reasoning_content, content)`` read from the completion's harmony messages
        (content None until a final or preamble message has begun); all the text content
        where the prompt opened the final message already."""
        if not thinks_first:
            return None, text
        reasoning: list[str] = []
        content: list[str] | None = None
        for message in harmony_messages(token_ids, self.special, self.tokenizer.decode):
            name = message.recipient.removeprefix("functions.")
            if message.channel == "analysis":
                reasoning.append(message.body)
            elif message.recipient.startswith("functions.") and FUNCTION_NAME.fullmatch(name):
                end = OPENAI.end if message.closed else ""
                content = [*(content or []), OPENAI.begin(name) + message.body + end]
            elif message.channel == "final" or not message.recipient:
                content = [*(content or []), message.body]
        return "".join(reasoning), None if content is None else "".join(content)

    def reasoning_tokens(self, token_ids: Sequence[int], thinks_first: bool) -> int:
        """Tokens up to the end of the thoughts (``<|channel|>final<|message|>``), or up to
        the header of the first message in another channel than analysis (a call or a
        preamble: no final message follows a call)."""
        if not thinks_first:
            return 0
        ids, end = list(token_ids), self.markers.end
        for i in range(len(ids) - len(end) + 1):
            if tuple(ids[i : i + len(end)]) == end:
                return i + len(end)
        channel, message = self.special.ids["<|channel|>"], self.special.ids["<|message|>"]
        for i, token in enumerate(ids):
            if token != channel:
                continue
            if message not in ids[i:]:
                break  # a header still being written
            header = self.tokenizer.decode(ids[i + 1 : ids.index(message, i)])
            if header.split()[:1] != ["analysis"]:
                return i
        return len(ids)


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
