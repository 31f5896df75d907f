"""Settings of an ``openai:<model>`` backend, and where its endpoint and key come from (the arguments, then
``DEEPR_LLM_BASE_URL`` / ``DEEPR_LLM_API_KEY``, then ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``)."""

from __future__ import annotations

import os
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

_NO_KEY = "no-key-needed"  # sent where the endpoint needs no key (local servers): the SDK insists on one


class OpenAIConfig(BaseModel):
    """Settings of one OpenAI-compatible backend; credentials are deliberately not here."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)  # the name the endpoint serves, e.g. 'Qwen/Qwen3-8B'
    base_url: str | None = None  # ending in /v1; None: api.openai.com
    timeout: float = Field(60.0, gt=0)  # seconds one try may take
    max_retries: int = Field(3, ge=0, le=20)  # the SDK's, with its backoff (408, 409, 429, 5xx, timeouts, connection)
    max_concurrency: int = Field(8, ge=1)
    seed: int | None = None  # sent with every request, and part of the cache key
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"  # newer OpenAI models: the latter
    extra_body: dict[str, Any] = Field(default_factory=dict)  # JSON fields sent with every request (vLLM's top_k)
    # sent when a call gives none: a server without a limit may generate until its context is full
    default_max_tokens: int = Field(1024, ge=1)
    # where the server does not say it (vLLM's /v1/models and llama.cpp's /props do)
    context_length: int | None = Field(None, ge=1)
    structured_outputs: bool = True  # send format fields (a run stops sending those the server refuses)
    strict_schema: bool = True  # the 'strict' flag of a json_schema response_format


def safe_url(url: str | None) -> str | None:
    """The URL without user:password or query string, which may hold credentials."""
    if not url:
        return url
    p = urlsplit(url)
    return urlunsplit((p.scheme, (p.hostname or "") + (f":{p.port}" if p.port else ""), p.path, "", ""))


def resolve_endpoint(base_url: str | None, api_key: str | None) -> tuple[str | None, str]:
    """Base URL and key from the arguments, then the deepr, then the OpenAI variables."""
    env = os.environ
    base_url = base_url or env.get("DEEPR_LLM_BASE_URL") or env.get("OPENAI_BASE_URL") or None
    api_key = api_key or env.get("DEEPR_LLM_API_KEY") or env.get("OPENAI_API_KEY") or None
    if api_key is None and base_url is None:
        raise ValueError("no endpoint configured for --llm openai:<model>: pass --base-url for a local "
                         "server, or set OPENAI_API_KEY (or DEEPR_LLM_API_KEY) for api.openai.com")
    return base_url, api_key or _NO_KEY
