"""``bench sidecar --output-lengths alpaca``: answer lengths in the engine's own tokens."""

from __future__ import annotations

import aiohttp
import pytest

from slipstream_cli.benches.sidecar import MAX_ALPACA_TOKENS, _answer_lengths
from slipstream_testbed.engine_server import ServeOptions, serve

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_answer_lengths_are_the_engines_token_counts_within_bounds() -> None:
    srv = await serve(ServeOptions(port=0))
    try:
        async with aiohttp.ClientSession() as http:
            answers = ["Non-citrus fruit.", "E, G, B", "", "word " * 2000]
            counts = []
            for text in answers:
                async with http.post(
                    srv.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}
                ) as resp:
                    counts.append(int((await resp.json())["count"]))
            got = await _answer_lengths(http, srv.url, answers)
    finally:
        await srv.close()
    assert counts[0] > 1 and counts[3] > MAX_ALPACA_TOKENS  # the bounds below bite
    assert got[:2] == counts[:2]  # the engine's count, not a character estimate
    assert counts[2] == 0 and got[2] == 1  # an empty answer still asks for one token
    assert got[3] == MAX_ALPACA_TOKENS
