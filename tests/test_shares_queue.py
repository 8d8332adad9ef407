"""A slot's queue by share, as pure asyncio (turns.py, slots.py): the order waiters go in, the
count of those ahead of one, and the interactive requests in flight counted at the grant, before
a granted request's task has run (a group's swap decision may be taken in that instant)."""

from __future__ import annotations

import asyncio

from hal0d.config import SlotConfig
from hal0d.lifecycle.slots import Slot, SlotState
from hal0d.lifecycle.turns import ClientQueue
from hal0d.shares import Share
from hal0d.shares.book import ShareBook

CHAT, AGENT = Share("chat"), Share("agent")
NIGHTLY = Share("nightly", batch=True)


async def order(queue: ClientQueue, waiters: list[tuple[str, Share]]) -> list[str]:
    """The names of `waiters` (client, share) in the order the queue lets them go."""
    loop = asyncio.get_running_loop()
    names = {}
    for index, (client, share) in enumerate(waiters):
        fut: asyncio.Future[None] = loop.create_future()
        names[fut] = f"{share.account}{index}"
        queue.append(fut, client, share)
    return [names[queue.popleft().fut] for _ in waiters]


async def test_interactive_before_batch_then_the_lesser_use_for_its_weight() -> None:
    book = ShareBook()
    book.charge("chat", 900)
    book.charge("agent", 300)
    queue = ClientQueue(book)
    gone = await order(queue, [("n", NIGHTLY), ("c", CHAT), ("a", AGENT), ("c", CHAT)])
    # The agent used less: it goes first; then the chat's two; batch last.
    assert gone == ["agent2", "chat1", "chat3", "nightly0"]

    heavy = ClientQueue(book)
    weighted = [("c", Share("chat", weight=4.0)), ("a", AGENT)]  # 900 / 4 < 300 / 1
    assert await order(heavy, weighted) == ["chat0", "agent1"]


async def test_equal_use_alternates_the_keys_and_a_key_takes_turns_between_its_clients() -> None:
    queue = ClientQueue(ShareBook())
    gone = await order(queue, [("x", CHAT), ("x", CHAT), ("y", CHAT), ("a", AGENT),
                               ("a", AGENT)])
    assert gone == ["chat0", "agent3", "chat2", "agent4", "chat1"]


async def test_batch_past_its_bound_goes_first_and_the_count_ahead_follows_the_order() -> None:
    queue = ClientQueue(ShareBook(batch_max_wait_s=0.0))
    loop = asyncio.get_running_loop()
    chat: asyncio.Future[None] = loop.create_future()
    nightly: asyncio.Future[None] = loop.create_future()
    queue.append(chat, "c", CHAT)
    queue.append(nightly, "n", NIGHTLY)
    assert queue.ahead(nightly) == 0 and queue.ahead(chat) == 1
    assert queue.urgent() and queue.popleft().fut is nightly

    waiting = ClientQueue(ShareBook(batch_max_wait_s=60.0))
    waiting.append(nightly, "n", NIGHTLY)
    assert not waiting.urgent()
    waiting.append(chat, "c", CHAT)
    assert waiting.ahead(nightly) == 1 and waiting.ahead(chat) == 0 and waiting.urgent()


async def test_interactive_requests_in_flight_are_counted_when_granted() -> None:
    slot = Slot(SlotConfig(name="a", upstream="http://127.0.0.1:9", models=("m",),
                           max_concurrent=1), state=SlotState.READY)
    first = slot.lease(share=NIGHTLY)
    await first.__aenter__()
    chat = slot.lease(share=CHAT)
    second = asyncio.create_task(chat.__aenter__())
    await asyncio.sleep(0)  # the chat's task runs to its wait in the queue
    assert (slot.queued, slot.in_flight, slot.interactive_in_flight) == (1, 1, 0)
    assert slot.urgent()  # its interactive work waits
    await first.__aexit__(None, None, None)
    # Granted: counted before the chat's task has run again.
    assert not second.done() and (slot.in_flight, slot.interactive_in_flight) == (1, 1)
    assert (await second).slot is slot
    await chat.__aexit__(None, None, None)
    assert (slot.in_flight, slot.interactive_in_flight, slot.urgent()) == (0, 0, False)
