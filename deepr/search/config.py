"""Settings of the search layer (``--search``, ``--allow-host``, ``--search-cache`` and limits).

``spec`` names one or more sources joined by ``+``: ``corpus`` (the local index, default),
``searxng:URL``, ``serper``, ``tavily``, ``brave``, ``jina``, ``mcp:<command or URL>``.

Example::

    python -c "from deepr.search.config import parse_spec; print(parse_spec('corpus+searxng:http://127.0.0.1:8888'))"
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from deepr.search.cache import MODES
from deepr.search.guard import parse_allow
from deepr.search.reader import DEFAULT_TYPES

KEYED = ("serper", "tavily", "brave", "jina")


def parse_spec(spec: str) -> list[tuple[str, str]]:
    """``[(kind, argument)]`` for a ``--search`` value; a bad value raises ValueError naming it."""
    out: list[tuple[str, str]] = []
    # a "+" inside an mcp command or URL is rare; split only where a known source starts
    parts, buf = [], ""
    for piece in (spec or "").split("+"):
        head = piece.strip().split(":", 1)[0].lower()
        if buf and head not in ("corpus", "searxng", "mcp", *KEYED):
            buf += "+" + piece
        else:
            if buf:
                parts.append(buf)
            buf = piece
    if buf:
        parts.append(buf)
    for part in parts:
        kind, _, arg = part.strip().partition(":")
        kind = kind.lower()
        if kind in ("corpus", *KEYED) and not arg:
            out.append((kind, ""))
        elif kind == "searxng" and arg.startswith(("http://", "https://")):
            out.append((kind, arg.rstrip("/")))
        elif kind == "mcp" and arg.strip():
            out.append((kind, arg.strip()))
        else:
            raise ValueError(f"--search {spec!r}: cannot read {part!r}; expected corpus, searxng:URL, serper, "
                             "tavily, brave, jina or mcp:<command or URL>, joined by '+'")
    if not out:
        raise ValueError("--search is empty; use 'corpus' for the local index")
    if len({k if k != "searxng" and k != "mcp" else k + a for k, a in out}) != len(out):
        raise ValueError(f"--search {spec!r}: a source is named twice")
    return out


# what each kind of source needs installed (the ``web`` extra) before a run may start
NEEDS_MODULE = {"mcp": "mcp"}
WEB_MODULES = ("trafilatura", "pypdf")


def not_ready(spec: str, reader: str = "trafilatura") -> str | None:
    """Why a ``--search`` value cannot work on this machine (a missing API key or a missing
    ``web`` extra), as one line naming the variable or the extra; None when it can. Checked
    before any work, so a run never fails on it after opening the corpus and calling models."""
    import importlib.util
    import os

    from deepr.search.providers import KEY_ENV

    kinds = [k for k, _ in parse_spec(spec)]
    if kinds == ["corpus"]:
        return None
    for kind in (*kinds, *(["jina"] if reader == "jina" else [])):
        env = KEY_ENV.get(kind)
        if env and not os.environ.get(env, "").strip():
            what = f"--search {kind}" if kind in kinds else "DEEPR_READER=jina"
            return f"{what} needs an API key: set the environment variable {env}"
    wanted = [m for m in WEB_MODULES if reader != "jina" or m != "trafilatura"]
    wanted += [NEEDS_MODULE[k] for k in kinds if k in NEEDS_MODULE]
    missing = [m for m in dict.fromkeys(wanted) if importlib.util.find_spec(m) is None]
    if missing:
        return (f"--search {spec}: reading web pages needs the 'web' extra ({', '.join(missing)} not installed): "
                "pip install 'deepr[web]'")
    return None


class SearchConfig(BaseModel):
    """Everything that decides what a search or fetch does (one object per run)."""

    model_config = ConfigDict(extra="forbid")
    spec: str = "corpus"
    allow_hosts: list[str] = Field(default_factory=list)
    cache: str = "use"
    cache_dir: Path | None = None
    ttl_hours: float = Field(168.0, gt=0)
    timeout: float = Field(15.0, gt=0, le=600)
    max_bytes: int = Field(5_000_000, ge=1000)
    content_types: tuple[str, ...] = DEFAULT_TYPES
    per_host: int = Field(4, ge=1, le=64)
    concurrency: int = Field(8, ge=1, le=256)
    rate: float | None = Field(None, gt=0, description="Most request starts per second (None: unlimited).")
    reader: str = Field("trafilatura", pattern="^(trafilatura|jina)$")
    passages: int = Field(4, ge=1, le=20, description="Passages of a read page given to the model.")
    verify_pages: bool = Field(True, description="Fetch every result page while searching and drop results "
                               "whose page fails (captcha, 403, empty...), so only readable pages are cited.")

    @field_validator("spec")
    @classmethod
    def _spec(cls, v: str) -> str:
        parse_spec(v)
        return v

    @field_validator("cache")
    @classmethod
    def _cache(cls, v: str) -> str:
        if v not in MODES:
            raise ValueError(f"--search-cache {v!r}: expected one of {', '.join(MODES)}")
        return v

    @field_validator("content_types")
    @classmethod
    def _types(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if not v:
            raise ValueError("name at least one content type, e.g. text/html")
        bad = [t for t in v if not re.fullmatch(r"[a-z0-9][a-z0-9.+\-]*/[a-z0-9][a-z0-9.+\-]*", t)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a content type of the form type/subtype (e.g. text/html)")
        return v

    @field_validator("allow_hosts")
    @classmethod
    def _allow(cls, v: list[str]) -> list[str]:
        parse_allow(v)
        return v

    @property
    def web(self) -> bool:
        return any(k != "corpus" for k, _ in parse_spec(self.spec))

    def public(self) -> dict:
        """The settings for provenance (no secrets live here: keys are read from env at call time)."""
        return self.model_dump(mode="json")


def _types(v: str) -> tuple[str, ...]:
    return tuple(t.strip().lower() for t in v.split(",") if t.strip())


# Environment variables that set fetch limits (a command's own flags win over them): name → field, parser.
LIMIT_ENV: dict[str, tuple[str, Callable[[str], Any]]] = {
    "DEEPR_FETCH_TIMEOUT": ("timeout", float), "DEEPR_FETCH_MAX_BYTES": ("max_bytes", int),
    "DEEPR_FETCH_TYPES": ("content_types", _types), "DEEPR_FETCH_PER_HOST": ("per_host", int),
    "DEEPR_FETCH_CONCURRENCY": ("concurrency", int), "DEEPR_SEARCH_RATE": ("rate", float),
    "DEEPR_SEARCH_TTL_HOURS": ("ttl_hours", float)}


def env_limits() -> dict[str, Any]:
    """The fetch limits set in the environment, as SearchConfig fields; a value that does not parse
    raises ValueError naming the variable."""
    out: dict[str, Any] = {}
    for env, (field, conv) in LIMIT_ENV.items():
        raw = os.environ.get(env, "").strip()
        if raw:
            try:
                out[field] = conv(raw)
            except ValueError:
                raise ValueError(f"{env}={raw!r}: not a valid value") from None
    return out


def search_config(spec: str = "corpus", allow_hosts: Sequence[str] = (), cache: str = "use",
                  cache_dir: Path | None = None, **limits: Any) -> SearchConfig:
    """A SearchConfig whose limits come from ``limits`` first, then the environment (``LIMIT_ENV``,
    and ``DEEPR_READER`` for the page reader); raises pydantic's ValidationError on a bad value."""
    return SearchConfig(spec=spec, allow_hosts=list(allow_hosts), cache=cache, cache_dir=cache_dir,
                        reader=os.environ.get("DEEPR_READER") or "trafilatura", **{**env_limits(), **limits})
