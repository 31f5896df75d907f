"""Settings of an ``openai:<model>`` backend, and where its endpoint and key come from (the
arguments, then ``DEEPR_LLM_BASE_URL`` / ``DEEPR_LLM_API_KEY``, then ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY``). The key is held so that no repr, log line or description shows it."""

from __future__ import annotations

import functools
import os
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

# Sent when the endpoint needs no key (local servers): the client insists on one.
_NO_KEY = "no-key-needed"


class _Secret:
    """Holds the API key; its repr never shows it, so dumps of the backend stay clean."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "'***'"


class OpenAIConfig(BaseModel):
    """Settings of one OpenAI-compatible backend (credentials are deliberately not here)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, description="Model name the endpoint serves, e.g. 'Qwen/Qwen3-8B'.")
    base_url: str | None = Field(None, description="Endpoint URL ending in /v1; None means api.openai.com.")
    timeout: float = Field(60.0, gt=0, description="Seconds one call may take before it counts as a timeout.")
    max_retries: int = Field(3, ge=0, le=20, description="The SDK's retries after the first try (408, 409, "
                             "429, 5xx, timeouts, connection errors), with its own backoff.")
    max_concurrency: int = Field(8, ge=1, description="Most requests in flight at once from this backend.")
    seed: int | None = Field(None, description="Sampling seed sent to the endpoint (and part of the cache key).")
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = Field(
        "max_tokens", description="Request field carrying the reply length limit (newer OpenAI models "
        "want max_completion_tokens).")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Extra JSON fields sent with "
                                       "every request (e.g. vLLM's top_k).")
    default_max_tokens: int = Field(1024, ge=1, description="max_tokens sent when a call gives none: a server "
                                    "without a limit may generate until its context is full.")
    context_length: int | None = Field(None, ge=1, description="The served model's context in tokens, where the "
                                       "server does not say it (vLLM's /v1/models and llama.cpp's /props do).")
    structured_outputs: bool = Field(True, description="Send response_format for JSON-schema formats (turned "
                                     "off for the rest of the run if the server refuses it).")
    strict_schema: bool = Field(True, description="The json_schema 'strict' flag sent with response_format.")
    http_client: Literal["auto", "aiohttp", "httpx"] = Field(
        "auto", description="HTTP transport of the SDK: aiohttp (the SDK's DefaultAioHttpClient, about half "
        "the client CPU per call: docs/experiments.md) or httpx; auto = aiohttp where installed.")


@functools.lru_cache(maxsize=64)  # every request names its endpoint in its cache key
def safe_url(url: str | None) -> str | None:
    """The URL without user:password or query string, which may hold credentials."""
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def resolve_endpoint(base_url: str | None, api_key: str | None) -> tuple[str | None, str]:
    """Base URL and key from the arguments, then the deepr, then the OpenAI variables."""
    env = os.environ
    base_url = base_url or env.get("DEEPR_LLM_BASE_URL") or env.get("OPENAI_BASE_URL") or None
    api_key = api_key or env.get("DEEPR_LLM_API_KEY") or env.get("OPENAI_API_KEY") or None
    if api_key is None:
        if base_url is None:
            raise ValueError("no endpoint configured for --llm openai:<model>: pass --base-url for a local "
                             "server, or set OPENAI_API_KEY (or DEEPR_LLM_API_KEY) for api.openai.com")
        api_key = _NO_KEY
    return base_url, api_key
