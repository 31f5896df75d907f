"""Profiles: what deepr changes in its requests for a class of model.

A capable model (Qwen3-8B behind vLLM, SGLang, llama.cpp, Ollama or OpenAI) gets the ``default``
profile: each role's own prompt and its own JSON schema or tag format, OpenAI-strict and accepted
by every grammar engine, re-asked with the reason when a reply is refused. Nothing else.

A 135M model needs much more to produce a usable reply; the ``small`` profile holds all of it:

- per-call formats built from the prompt (cited prose over exactly the ids shown, queries in the
  prompt's words, a fixed plan skeleton; :mod:`deepr.profiles.formats`), acronyms and numbers
  limited to those the prompt shows;
- the plan's graph schema with its guard (:mod:`deepr.profiles.plan_guard`) when the planner is
  left its own shapes, and the distinct-word decoding ban;
- its own rubric-synthesis prompt and slots (:mod:`deepr.profiles.rubrics_strict`);
- re-asks that resample instead of showing a looping reply back;
- repetition penalties and n-gram bans for the hf backend (:data:`SMALL_DECODING`), for every call
  under this profile and, under another, for the calls of the roles ``--formats ROLE=strict`` names;
- the plan format GRPO samples planner rollouts under when ``--rollout-formats schema`` asks for
  it (never by default: rollouts come from the policy, see docs/faithfulness.md).

``smollm2`` and ``gguf:`` select ``small``; every other model spec ``default``; ``--profile``
overrides. The profile travels with each call (``perform(..., profile=)``); the backend object
knows nothing of it. Role modules never import this package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepr.llm.base import Message, OutputFormat

PROFILES = ("default", "small")
# Roles the small profile builds per-call formats for: the names ``--formats ROLE=MODE`` takes
# (tests/test_profiles.py checks it against the tables).
FORMAT_ROLES = ("agent", "answerer", "condenser", "decompose", "decor_answerer", "decor_filter", "decor_planner",
                "extract", "gate", "ground", "planner", "root_query", "searcher", "synthesize", "verify", "warp")
# What the small models decode with on the hf backend unless the spec says otherwise: llama.cpp
# server's repeat penalty (1.1 over the last 64 tokens), no 6-token run twice in a reply, and no
# word right after itself. Greedy SmolLM2 looped in most agent turns without them.
SMALL_DECODING = {"repetition_penalty": 1.1, "repetition_window": 64, "no_repeat_ngram": 6, "no_repeat_word": True}


@dataclass(frozen=True)
class Tables:
    """A profile's per-role overrides, keyed by the Role they change (matched by name and action).

    ``strict``: a per-call format built from the call's input (None keeps the next choice);
    ``schema``: the format a role decodes under when strict formats are off for it;
    ``messages``: the profile's own prompt for a role while its strict format is on;
    ``precheck``: a reason not to call at all (no reply could pass), while strict is on.
    """

    strict: Mapping[Any, Callable[[Any], OutputFormat | None]] = field(default_factory=dict)
    schema: Mapping[Any, Callable[[], OutputFormat]] = field(default_factory=dict)
    messages: Mapping[Any, Callable[[Any], list[Message]]] = field(default_factory=dict)
    precheck: Mapping[Any, Callable[[Any], str | None]] = field(default_factory=dict)


def _lookup(table: Mapping[Any, Any], role: Any) -> Any:
    """The override declared for ``role``. Tables are keyed by the role objects themselves (an
    import leads to the declaration) and matched by name and action, so a role re-declared with
    ``dataclasses.replace`` (another prompt, no fallback) keeps its override."""
    return next((f for r, f in table.items() if (r.name, r.action) == (role.name, role.action)), None)


@dataclass(frozen=True)
class Profile:
    """See the module docstring. ``strict``/``roles``: whether per-call formats are on (for every
    role / per role); ``reask``: "correct" or "resample"; ``decoding``: hf backend options."""

    name: str = "default"
    strict: bool = False
    roles: Mapping[str, bool] = field(default_factory=dict)
    reask: str = "correct"
    decoding: Mapping[str, Any] = field(default_factory=dict)

    def tables(self) -> Tables:
        # Strict formats asked of the default profile (--formats strict) come from the same tables.
        if self.name == "small" or self.strict or any(self.roles.values()):
            from deepr.profiles.small import TABLES

            return TABLES
        return Tables()

    def strict_for(self, role_name: str) -> bool:
        return self.roles.get(role_name, self.strict)

    def format(self, role: Any, inp: Any, messages: Sequence[Message]) -> OutputFormat | None:
        """This call's decoding format, or None for the role's own (``role.output.fmt``)."""
        tables = self.tables()
        if self.strict_for(role.name) and (build := _lookup(tables.strict, role)) is not None:
            from deepr.profiles.formats import ground

            # acronyms and numbers only as the prompt shows them (the system prompt's own excluded)
            built = ground(build(inp), [m["content"] for m in messages if m["role"] != "system"])
            if built:
                # its repetition rules travel with it: a role made strict under another profile needs them too
                return dataclasses.replace(built, name=f"{role.name}.{role.action}", decoding=SMALL_DECODING)
        if self.name == "small" and (schema := _lookup(tables.schema, role)) is not None:
            return dataclasses.replace(schema(), name=f"{role.name}.{role.action}")
        return None

    def messages(self, role: Any, inp: Any) -> list[Message] | None:
        make = _lookup(self.tables().messages, role) if self.strict_for(role.name) else None
        return make(inp) if make is not None else None

    def precheck(self, role: Any, inp: Any) -> str | None:
        check = _lookup(self.tables().precheck, role) if self.strict_for(role.name) else None
        return check(inp) if check is not None else None

    def describe(self) -> dict[str, Any]:
        """What sidecars and deepr_meta.json record."""
        strict_any = self.strict or any(self.roles.values())
        return {"name": self.name, "formats": "strict" if self.strict else "schema",
                **({"roles": {k: "strict" if v else "schema" for k, v in self.roles.items()}} if self.roles else {}),
                "reask": self.reask, **({"decoding": dict(self.decoding)} if self.decoding else {}),
                # what the strict formats bring to their own calls on the hf backend (see format())
                **({"strict_decoding": dict(SMALL_DECODING)} if strict_any and not self.decoding else {})}


DEFAULT = Profile()
SMALL = Profile("small", strict=True, reask="resample", decoding=SMALL_DECODING)


def auto_name(spec: str | None) -> str:
    """The profile a model spec selects: ``small`` for the built-in small models."""
    spec = (spec or "").strip()
    return "small" if spec == "smollm2" or spec.startswith(("smollm2,", "gguf:")) else "default"


def parse_formats(value: str | None) -> tuple[str | None, dict[str, bool]]:
    """``--formats`` as (the mode of every role: "strict", "schema" or None for the profile's; {role:
    strict?} for the roles named with ROLE=MODE). Raises ValueError naming the part that is wrong."""
    default: str | None = None
    roles: dict[str, bool] = {}
    for part in (p.strip() for p in (value or "auto").split(",")):
        role, _, mode = part.rpartition("=")
        if mode not in ("auto", "strict", "schema") or (role and mode == "auto"):
            raise ValueError(f"--formats {value!r}: {part!r} is not a mode; use auto, strict or schema, or "
                             "ROLE=strict / ROLE=schema for one role (e.g. strict,planner=schema)")
        if not role:
            if default is not None:
                raise ValueError(f"--formats {value!r}: give one mode for all roles, then ROLE=MODE exceptions")
            default = mode
        elif role not in FORMAT_ROLES:
            raise ValueError(f"--formats {value!r}: no role {role!r} has strict formats; roles: {', '.join(FORMAT_ROLES)}")
        else:
            roles[role] = mode == "strict"
    return (None if default in (None, "auto") else default), roles


def get_profile(name: str | None = None, *, spec: str | None = None, formats: str | None = None,
                reask: str | None = None) -> Profile:
    """The profile ``name`` (None: the one ``spec`` selects), with the user's ``--formats`` and
    ``--reask`` on top. Raises ValueError naming a wrong value."""
    name = name or auto_name(spec)
    if name not in PROFILES:
        raise ValueError(f"--profile {name!r}: unknown profile; choose one of {', '.join(PROFILES)}")
    base = SMALL if name == "small" else DEFAULT
    mode, roles = parse_formats(formats)
    if reask not in (None, "auto", "correct", "resample"):
        raise ValueError(f"--reask {reask!r}: choose auto, correct or resample")
    return dataclasses.replace(
        base, strict=base.strict if mode is None else mode == "strict", roles={**base.roles, **roles},
        reask=base.reask if reask in (None, "auto") else reask)
