"""llama-server's own Responses API through a real `hal0d serve` in the default mode
(`responses = "native"`), read by the openai SDK.

llama-server's /v1/responses stream carries no `sequence_number`, `output_index` or
`content_index`, which the SDK's `responses.stream()` files every event by; hal0d's native relay
supplies them (hal0d/openai/responses.py), so the default needs no `responses = "translate"`.
Run by `make test-real` (HAL0D_REAL_SERVER and HAL0D_REAL_MODEL: see realserver.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from realserver import free_port, require_real_server, running_hal0d, server_command

MODEL = "smollm2"


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    port = free_port()
    config = {"slots": [{"name": "real", "upstream": f"http://127.0.0.1:{port}",
                         "models": [MODEL], "command": server_command(MODEL, port)}]}
    with running_hal0d(tmp_path_factory.mktemp("responses"), config,
                       lambda views: views["real"]["state"] == "ready") as base:
        yield base


def test_the_sdks_responses_stream_reads_llama_servers_own_stream_in_the_default_mode(
    hal0d: str,
) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused", max_retries=0)
    with client.responses.stream(model=MODEL, input="Say hello.",
                                 max_output_tokens=24) as stream:
        events = list(stream)  # the SDK files every event by its indices as it reads it
        final = stream.get_final_response()
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text.strip()
    assert final.output_text == text
    assert final.id.startswith("resp_")  # llama-server's own: the stream was relayed, not made
    assert events[-1].type == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=24)
    assert whole.output_text.strip()
