"""What real clients see: the ``openai`` and ``anthropic`` packages against a running server.

``usage_seen`` sends one request per API x streamed x sampling settings and returns, for each,
the prompt length and the tokens the server reported as read from its cache, exactly as each
SDK parses them: OpenAI ``usage.prompt_tokens_details.cached_tokens`` (streamed: the final
usage chunk), Anthropic ``cache_read_input_tokens`` beside ``input_tokens`` (streamed: both in
``message_start`` and in the final message the SDK accumulates from ``message_delta``).
"""

from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
from PIL import Image

DEFAULT: dict = {}  # the client sends no sampling settings: the server's defaults
SAMPLED = {"temperature": 0.7, "top_p": 0.9}
SETTINGS = {"default": DEFAULT, "sampled": SAMPLED}


def png_b64(pixels: np.ndarray | None = None) -> str:
    """A small PNG (black 56x56 by default), base64."""
    pixels = np.zeros((56, 56, 3), np.uint8) if pixels is None else pixels
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def messages(text: str, image: str | None = None) -> tuple[list, list]:
    """The same user turn for the OpenAI and the Anthropic API (``image``: base64 PNG)."""
    if image is None:
        turn = [{"role": "user", "content": text}]
        return turn, turn
    url = {"url": "data:image/png;base64," + image}
    source = {"type": "base64", "media_type": "image/png", "data": image}
    text_part = {"type": "text", "text": text}
    openai_turn = [
        {"role": "user", "content": [{"type": "image_url", "image_url": url}, text_part]}
    ]
    anthropic_turn = [{"role": "user", "content": [{"type": "image", "source": source}, text_part]}]
    return openai_turn, anthropic_turn


class Clients:
    """Both SDKs pointed at one server."""

    def __init__(self, url: str, model: str, max_tokens: int = 4) -> None:
        self.openai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        self.anthropic = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        self.model, self.max_tokens = model, max_tokens

    def openai_chat(self, turn: list, settings: dict) -> tuple[str, int, int | None]:
        """(text, prompt_tokens, cached_tokens) of a non-streamed chat completion."""
        out = self.openai.chat.completions.create(
            model=self.model, messages=turn, max_tokens=self.max_tokens, **settings
        )
        details = out.usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None else None
        return out.choices[0].message.content or "", out.usage.prompt_tokens, cached

    def openai_stream(self, turn: list, settings: dict) -> tuple[int, int | None]:
        chunks = self.openai.chat.completions.create(
            model=self.model, messages=turn, max_tokens=self.max_tokens, stream=True,
            stream_options={"include_usage": True}, **settings,
        )  # fmt: skip
        usage = [c.usage for c in chunks if c.usage is not None][-1]
        details = usage.prompt_tokens_details
        return usage.prompt_tokens, details.cached_tokens if details is not None else None

    def openai_response(
        self, text: str, settings: dict, stream: bool, salted: dict | None = None
    ) -> tuple[int, int]:
        """(input_tokens, input_tokens_details.cached_tokens) of the Responses API (``salted``:
        the SDK's ``extra_body`` or ``extra_headers`` that carry a cache salt)."""
        kw = dict(model=self.model, input=text, max_output_tokens=self.max_tokens, **settings)
        kw.update(salted or {})
        if stream:
            events = self.openai.responses.create(stream=True, **kw)
            usage = [e.response.usage for e in events if e.type == "response.completed"][-1]
        else:
            usage = self.openai.responses.create(**kw).usage
        return usage.input_tokens, usage.input_tokens_details.cached_tokens

    def anthropic_message(
        self, turn: list, settings: dict, headers: dict | None = None
    ) -> tuple[int, int | None]:
        """(input_tokens + cache reads, cache reads) of a non-streamed message."""
        out = self.anthropic.messages.create(
            model=self.model, messages=turn, max_tokens=self.max_tokens, extra_body=settings,
            extra_headers=headers or {},
        )  # fmt: skip
        read = out.usage.cache_read_input_tokens
        return out.usage.input_tokens + (read or 0), read

    def anthropic_stream(self, turn: list, settings: dict) -> list[tuple[int, int | None]]:
        """The same from ``message_start`` and from the final (accumulated) message."""
        with self.anthropic.messages.stream(
            model=self.model, messages=turn, max_tokens=self.max_tokens, extra_body=settings
        ) as stream:
            start = next(e for e in stream if e.type == "message_start").message.usage
            final = stream.get_final_message().usage
        return [
            (u.input_tokens + (u.cache_read_input_tokens or 0), u.cache_read_input_tokens)
            for u in (start, final)
        ]


def usage_seen(
    clients: Clients, openai_turn: list, anthropic_turn: list | None, responses: str | None = None
) -> dict:
    """{(api, settings name): (prompt tokens, cached tokens)} for a prompt the OpenAI API has
    already sent (the Messages API's own rendering of it is sent once first, uncounted);
    ``anthropic_turn`` None: the server has no Messages API; ``responses``: the same prompt's
    text for the Responses API (which renders it as the chat API does)."""
    seen: dict = {}
    if anthropic_turn is not None:
        clients.anthropic_message(anthropic_turn, DEFAULT)
    for name, settings in SETTINGS.items():
        _, n, cached = clients.openai_chat(openai_turn, settings)
        seen["openai", name] = (n, cached)
        seen["openai stream", name] = clients.openai_stream(openai_turn, settings)
        if anthropic_turn is not None:
            seen["anthropic", name] = clients.anthropic_message(anthropic_turn, settings)
            start, final = clients.anthropic_stream(anthropic_turn, settings)
            seen["anthropic message_start", name] = start
            seen["anthropic stream end", name] = final
        if responses is not None:
            seen["responses", name] = clients.openai_response(responses, settings, False)
            seen["responses stream", name] = clients.openai_response(responses, settings, True)
    return seen


def salted_reads(clients: Clients, anthropic_turn: list | None, responses: str | None) -> dict:
    """{api: [(prompt tokens, cache reads)]} of one prompt sent under salts no request used
    before: a new salt (body field), the same again, the same as ``X-Cache-Salt`` header,
    another salt. Isolation reads 0, n - 1, n - 1, 0 of its n tokens (Messages, Responses)."""
    sends: dict = {}
    if anthropic_turn is not None:
        sends["anthropic"] = lambda body, headers: clients.anthropic_message(
            anthropic_turn, body, headers
        )
    if responses is not None:
        sends["responses"] = lambda body, headers: clients.openai_response(
            responses, {}, False, {"extra_body": body, "extra_headers": headers}
        )
    out = {}
    for api, send in sends.items():
        first, other = f"{api}-salt-1", f"{api}-salt-2"
        asks = [({"cache_salt": first}, {}), ({"cache_salt": first}, {}),
                ({}, {"X-Cache-Salt": first}), ({"cache_salt": other}, {})]  # fmt: skip
        out[api] = [send(body, headers) for body, headers in asks]
    return out


def isolated(seen: list) -> bool:
    """Whether ``salted_reads``' (prompt tokens, cache reads) show each salt its own blocks."""
    n = seen[0][0]
    return seen == [(n, 0), (n, n - 1), (n, n - 1), (n, 0)]
