"""The context guard: a prompt that does not fit a slot's context (with the answer's max_tokens)
is sent to another slot of its route, or refused in the client's own words (ContextExceeded),
before it takes a lease: no queue, no load, no upstream that reads it.

Per request, before the lease (attempt.Forward.run):

    no context known       nothing to guard (contexts.py): the server's own error is mapped
    upper bound fits       `need.upper` (the request's bytes: no token is shorter than a byte,
                           and a chat template adds less than the JSON around each message,
                           TEMPLATE_ALLOWANCE aside) plus max_tokens within the context: sent,
                           at the cost of one comparison
    near the limit, up     counted exactly with the slot's own tokenizer (transport/tokens.py:
                           the chat template applied and tokenized), unless a generation runs
                           there on a server whose count would interrupt it (llama-cpp-python)
    near the limit, else   the likely count (the text's characters / 4): refused only past the
                           context, as the server would refuse it after its load
    too long               HandOn("context") while another slot of the route is left (the plan
                           goes on to one that holds it), else ContextExceeded

The count is recorded as the request's prompt_tokens; a refusal as error_code
`context_exceeded` with the context it did not fit (context_tokens).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

from hal0d.config import SlotConfig
from hal0d.errors import ContextExceeded
from hal0d.forward.contexts import Context, Contexts
from hal0d.logs import get_logger
from hal0d.transport.tokens import ESTIMATED, TokenCounter, estimate

log = get_logger()

# What a chat template may add beyond the JSON around the messages (a default system prompt,
# tool instructions): the upper bound stays one.
TEMPLATE_ALLOWANCE: Final = 512


def chat_text(chat: dict[str, Any]) -> str:
    """Every string of a chat request's messages and tools, whatever their shape: what the
    model reads, for the likely count (a client's body is counted as it came)."""
    return strings_of(chat.get("messages"), chat.get("tools"))


def as_one_message(*values: Any) -> dict[str, Any]:
    """A chat request of one message holding every string of `values`: what a request no
    translator reads (fields only a native upstream knows) is counted as."""
    return {"messages": [{"role": "user", "content": strings_of(*values)}]}


def strings_of(*values: Any) -> str:
    """Every string inside `values` (lists and objects walked), joined by newlines."""
    parts: list[str] = []
    stack: list[Any] = list(values)
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return "\n".join(parts)


@dataclass(frozen=True, slots=True)
class ContextNeed:
    """What a generation request needs of a context, as its surface tells it (Exchange.need).
    `chat`: the request as an OpenAI chat completion, to count exactly (made only then);
    `text`: its text, for the likely count."""

    upper: int
    max_tokens: int | None
    chat: Callable[[], dict[str, Any]]
    text: Callable[[dict[str, Any]], str] = chat_text
    clamped: bool = False  # the slot's max_output_tokens clamps the answer (Anthropic, Responses)
    # Ollama's surface: drops the oldest messages that may go (the system prompt and the newest
    # stay) until about `tokens` are shed; False when none may go any more (shorten()).
    drop_oldest: Callable[[int, int], bool] | None = None

    @classmethod
    def of_body(cls, body: bytes, max_tokens: object, chat: Callable[[], dict[str, Any]], *,
                clamped: bool = False) -> ContextNeed:
        answer = max_tokens if type(max_tokens) is int and max_tokens > 0 else None
        return cls(len(body) + TEMPLATE_ALLOWANCE, answer, chat, clamped=clamped)

    def answer(self, config: SlotConfig) -> int:
        """The tokens its answer may take on the slot `config`."""
        limit = config.max_output_tokens if self.clamped else None
        asked = self.max_tokens or 0
        return min(asked, limit) if limit is not None else asked


@dataclass(frozen=True, slots=True)
class Fit:
    """Whether the request fits: its count (None: the upper bound sufficed) and how it was
    made."""

    fits: bool
    context: Context | None
    counted: int | None = None
    how: str = "bound"
    answer: int = 0  # the tokens the answer may take there


async def measure(need: ContextNeed, contexts: Contexts, tokens: TokenCounter,
                  config: SlotConfig, *, up: bool, busy: bool) -> Fit:
    """How the request fits the slot `config` (the module's docstring)."""
    context = await contexts.of(config)
    if context is None:
        return Fit(True, None)
    answer = need.answer(config)
    if need.upper + answer <= context.tokens:
        return Fit(True, context)
    chat = need.chat()
    if up and not (busy and tokens.interrupts(config)):
        counted, how = await tokens.count(config, chat, need.text(chat))
        if how != ESTIMATED:
            return Fit(counted + answer <= context.tokens, context, counted, how, answer)
    likely = estimate(need.text(chat))
    return Fit(likely <= context.tokens, context, likely, ESTIMATED, answer)


# How many times a conversation is shortened and measured again before it is refused.
SHORTEN_ROUNDS: Final = 4


async def shortened(need: ContextNeed, fit: Fit,
                    measure_again: Callable[[], Awaitable[Fit]]) -> Fit:
    """Ollama's way with a conversation past the context: its oldest messages dropped (the
    system prompt and the newest kept) until it fits, measured again after each cut; the last
    measure (not fitting when even that could not make it fit)."""
    assert need.drop_oldest is not None and fit.context is not None
    rounds = 0
    while not fit.fits and rounds < SHORTEN_ROUNDS and fit.counted is not None:
        over = fit.counted + fit.answer - fit.context.tokens
        if not need.drop_oldest(max(1, over), fit.counted):
            break
        fit = await measure_again()
        rounds += 1
    return fit


def refusal(need: ContextNeed, fit: Fit, slot: str, *, hands_on: bool) -> ContextExceeded:
    """The refusal of a request that does not fit, said in the log (also when the route's next
    slot is tried)."""
    assert fit.context is not None and fit.counted is not None
    log.info("request.context_exceeded", slot=slot, prompt_tokens=fit.counted,
             max_tokens=fit.answer, context=fit.context.tokens,
             context_from=fit.context.source, counted_by=fit.how, hands_on=hands_on)
    return ContextExceeded(fit.counted, fit.context.tokens, fit.answer or None)
