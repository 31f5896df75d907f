"""Flags shared by every command that calls a model, and the one place that turns a config's
validation error into a message naming the flag.

- :func:`gen_options` / :func:`gen_defaults`: ``--max-tokens --temperature --top-p --seed``
  (issue 14.3), checked and packed into a :class:`~deepr.llm.base.GenDefaults`;
- :data:`DEADLINE`, :data:`ALLOW_FALLBACK`: the wall-clock budget and the exit-status switch;
- :func:`flag_error`: ``ValidationError`` → ``--max-depth 9: must be <= 6 (allowed 1..6)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

# Config fields whose flag is not simply ``--field-name``.
FIELD_FLAGS = {"decor_steps": "--steps", "k": "--top-k", "learning_rate": "--lr", "prune_drafts": "--no-prune",
               "metrics": "--metric", "judge": "--judge-llm"}

# The model specs deepr.llm.get_llm reads, for every --llm / --judge-llm help.
LLM_FORMS = ("openai:<model>, hf:<path>[,adapter=<role>:<path>], smollm2 (SmolLM2-135M offline), "
             "gguf:<file.gguf> or replay:<file>")
LLM_HELP = f"extractive (no LLM, the offline default), {LLM_FORMS}."

MAX_TOKENS = typer.Option(None, "--max-tokens", help="Cap on completion tokens of every model call (each role "
                          "keeps its own smaller default).")
TEMPERATURE = typer.Option(None, "--temperature", help="Sampling temperature of every model call, 0..2 "
                           "(default: each role's own).")
TOP_P = typer.Option(None, "--top-p", help="Nucleus sampling mass, in (0, 1].")
GEN_SEED = typer.Option(None, "--seed", help="Sampling seed sent with every model call (backends that "
                        "support it repeat their replies).")
DEADLINE = typer.Option(None, "--deadline", help="Wall-clock budget in seconds for the whole command's model "
                        "calls; after it, remaining calls fail at once and the command finishes with what it "
                        "has (recorded as failures).")
ALLOW_FALLBACK = typer.Option(False, "--allow-fallback", help="Exit 0 when output was written but some records "
                              "or turns failed or fell back to the extractive engine (default: exit 3).")
PROFILE = typer.Option(None, "--profile", help="How requests are shaped for the model: 'default' (each "
                       "role's own schema or tag, valid under strict structured outputs) or 'small' (per-call "
                       "formats built from the prompt, decoding bans, resampled re-asks: what a ~100M model needs). "
                       "Unset: 'small' for smollm2 and gguf:, 'default' for every other model.")
FORMATS = typer.Option("auto", "--formats", help="Per-call formats on top of the profile: 'strict' builds each "
                       "call's format from its prompt (fixed dag plan skeleton, plain-word cited sentences, only "
                       "shown ids), 'schema' keeps each role's own schema or tag, 'auto' takes the profile's "
                       "choice. ROLE=MODE after it sets one role: 'strict,planner=schema'.")
REASK = typer.Option("auto", "--reask", help="How a refused reply is asked again: 'correct' shows the model "
                     "its reply and why it was refused, 'resample' sends the same prompt again sampled with a new "
                     "seed, 'auto' takes the profile's choice (resample for 'small').")
TIMEOUT = typer.Option(120.0, "--timeout", help="Seconds before one model call times out (> 0).")

EXIT_HELP = ("Exit status: 0 all good; 2 bad input or flags (nothing run); 3 some records/turns failed or fell "
             "back (0 with --allow-fallback); 4 nothing succeeded; 5 the endpoint refused the credentials "
             "(stopped at once); 130 interrupted (the message says what was kept). See README 'Exit status'.")


def profile_of(spec: str | None, name: str | None = None, formats: str | None = None, reask: str | None = None) -> Any:
    """The :class:`~deepr.profiles.Profile` of the model ``spec`` with the user's flags on top;
    raises ValueError naming the flag."""
    from deepr.profiles import get_profile

    return get_profile(name, spec=spec, formats=formats, reask=reask)


def gen_defaults(max_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
                 seed: int | None = None, formats: str | None = None, reask: str | None = None) -> Any:
    """Check the generation flags and pack them; raises ValueError naming the flag. ``formats`` and
    ``reask`` are checked here and applied by the profile (:func:`profile_of`)."""
    from deepr.llm.base import GenDefaults
    from deepr.profiles import parse_formats

    if max_tokens is not None and not 1 <= max_tokens <= 1_000_000:
        raise ValueError(f"--max-tokens {max_tokens}: must be a positive number of tokens (1..1000000)")
    if temperature is not None and not 0.0 <= temperature <= 2.0:
        raise ValueError(f"--temperature {temperature:g}: must be between 0 and 2")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"--top-p {top_p:g}: must be in (0, 1]")
    if seed is not None and not 0 <= seed < 2**63:
        raise ValueError(f"--seed {seed}: must be a non-negative integer")
    if formats is not None:
        parse_formats(formats)  # raises naming the wrong part
    if reask not in (None, "auto", "correct", "resample"):
        raise ValueError(f"--reask {reask!r}: choose auto, correct or resample")
    return GenDefaults(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)


def check_budget(timeout: float | None = None, deadline: float | None = None, concurrency: int | None = None,
                 limit: int | None = None) -> None:
    """The numeric flags every model-calling command shares; raises ValueError naming the flag."""
    if timeout is not None and not timeout > 0:
        raise ValueError(f"--timeout {timeout:g}: must be a positive number of seconds")
    if deadline is not None and not deadline > 0:
        raise ValueError(f"--deadline {deadline:g}: must be a positive number of seconds")
    if concurrency is not None and not 1 <= concurrency <= 1024:
        raise ValueError(f"--concurrency {concurrency}: must be between 1 and 1024")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit {limit}: must be a positive number")


def _bounds(ctx: dict[str, Any]) -> str:
    lo = next((f"{'>' if k == 'gt' else '>='} {ctx[k]}" for k in ("ge", "gt") if k in ctx), None)
    hi = next((f"{'<' if k == 'lt' else '<='} {ctx[k]}" for k in ("le", "lt") if k in ctx), None)
    return " and ".join(x for x in (lo, hi) if x)


def _model_named(name: str) -> Any:
    from pydantic import BaseModel

    todo = list(BaseModel.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def _field_range(title: str, loc: list[str]) -> dict[str, Any]:
    """Every bound declared on the field (so the message gives the whole allowed range)."""
    cls, bounds = _model_named(title), {}
    for name in loc:
        info = getattr(cls, "model_fields", {}).get(name)
        if info is None:
            return {}
        cls = info.annotation
        for m in info.metadata:
            bounds.update({k: getattr(m, k) for k in ("ge", "gt", "le", "lt") if getattr(m, k, None) is not None})
    return bounds


def flag_error(err: Any, flags: dict[str, str] | None = None) -> str:
    """One line for the first problem of a pydantic ValidationError, named by its CLI flag."""
    first = err.errors()[0]
    names = [str(p) for p in first.get("loc", ()) if isinstance(p, str)]
    field = names[-1] if names else ""
    table = {**FIELD_FLAGS, **(flags or {})}
    # A model-level check has no field; a command names its flag under "".
    flag = table.get(field, f"--{field.replace('_', '-')}") if field else table.get("", "options")
    msg = str(first.get("msg", err)).removeprefix("Value error, ")
    ctx = first.get("ctx") or {}
    value = first.get("input")
    if _bounds(ctx):
        msg = f"must be {_bounds({**_field_range(err.title, names), **ctx})}"
    if msg.startswith("--"):  # the config already wrote a message naming its flag
        return msg
    shown = f" {value}" if isinstance(value, (int, float, str)) and not isinstance(value, bool) and field else ""
    return f"{flag}{shown}: {msg}"


def load_config_file(path: Path | None) -> dict[str, Any]:
    """Settings from a .json or .toml file (deepr's fields and TRL's by name; flags on the command line win)."""
    if path is None:
        return {}
    if not path.is_file():
        raise FileNotFoundError(f"--config {path}: no such file")
    import json

    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        import tomllib

        data = tomllib.loads(text)
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--config {path}: line {e.lineno}: not valid JSON ({e.msg}); use JSON or .toml") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected an object of settings, got {type(data).__name__}")
    return data


def setting_options(table: dict[str, tuple[str, Any, str]]) -> Any:
    """Add one typer option per entry of ``table`` (setting name → flag, type, help) to a command,
    plus ``--set NAME=VALUE`` for any other setting (deepr's, TRL's or LoRA's). The command receives the settings
    given, by TRL's names, as its ``settings`` argument; flags left out are not in it, so the
    config file and the stage's defaults keep theirs."""
    import functools
    import inspect
    from typing import Optional

    def decorate(fn: Any) -> Any:
        extra = [inspect.Parameter(f"set_{name}", inspect.Parameter.KEYWORD_ONLY,
                                   annotation=Optional[kind],  # noqa: UP007 (typer reads it)
                                   default=typer.Option(None, *flag.split("/") if kind is not bool else [flag],
                                                        help=text, rich_help_panel="Trainer settings"))
                 for name, (flag, kind, text) in table.items()]
        extra.append(inspect.Parameter("set_pairs", inspect.Parameter.KEYWORD_ONLY,
                                       annotation=Optional[list[str]],  # noqa: UP007
                                       default=typer.Option(None, "--set", help="Any other setting: the stage "
                                                            "config's, or TRL's trainer config or LoRA by TRL's "
                                                            "name: --set warmup_steps=10 (repeatable; "
                                                            "docs/training.md).",
                                                            rich_help_panel="Trainer settings")))
        sig = inspect.signature(fn)
        params = [p for p in sig.parameters.values() if p.name != "settings"]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            from deepr.train.settings import parse_assignments

            given = {p.name.removeprefix("set_"): kwargs.pop(p.name) for p in extra[:-1]}
            pairs = kwargs.pop("set_pairs")
            try:
                settings = parse_assignments(pairs)
            except ValueError as e:  # click prints it as a usage error naming --set, exit 2
                raise typer.BadParameter(str(e), param_hint="--set") from None
            settings.update({k: v for k, v in given.items() if v is not None})
            return fn(*args, settings=settings, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=[*params, *extra])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {**getattr(fn, "__annotations__", {}), **{p.name: p.annotation for p in extra}}
        return wrapper

    return decorate
