"""Adapter folders for the hf backend: ``--llm hf:<adapter folder>`` reads the base model from
the folder's metadata (``deepr_meta.json``, else PEFT's ``adapter_config.json``), and the roles
it serves from how deepr trained it. Training records a local base as an absolute path
(:func:`local_path`) so the folder loads from any working directory.

    resolve_adapter_folder("runs/planner", {})  ->  ("/abs/base", {"planner": "runs/planner"})
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ALL_ROLES = "*"  # adapter key: the adapter serves every role


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _meta_roles(meta: dict[str, Any], folder: Path) -> list[str]:
    """The roles a deepr training run trained this adapter for (DECOR's team shares one)."""
    spec = meta.get("llm_spec")
    if isinstance(spec, str) and spec.startswith("hf:"):
        from deepr.llm import hf_options, parse_hf_spec

        _, adapters = parse_hf_spec(hf_options(spec)[0][3:])
        roles = [r for r, a in adapters.items() if Path(a).expanduser().resolve() == folder.resolve()]
        if roles:
            return roles
    role = meta.get("role")
    return [role] if isinstance(role, str) and role else []


def local_path(name: str) -> str:
    """An existing local folder as an absolute path, anything else (a hub name) unchanged: what a
    trained adapter records as its base must load from any working directory."""
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


def adapter_base(folder: str | Path, fix: str = "pass --llm hf:<base>,adapter=<role>:<folder>") -> str:
    """The base model an adapter folder was trained on: ``deepr_meta.json``'s ``base_model``,
    else peft's ``adapter_config.json`` (``base_model_name_or_path``).

    Adapters trained before deepr recorded absolute paths may name their base relative to the
    folder training ran in; such a path that does not exist from here is looked up under the
    adapter folder's ancestors (the usual place: ``runs/x/sft-merged`` beside ``runs/x/grpo``)."""
    p = Path(folder).expanduser()
    meta = _read_json(p / "deepr_meta.json")
    base = meta.get("base_model") or _read_json(p / "adapter_config.json").get("base_model_name_or_path")
    if not base or not isinstance(base, str):
        raise ValueError(f"adapter folder {p}: no base model recorded (deepr_meta.json 'base_model' or "
                         f"adapter_config.json 'base_model_name_or_path'); {fix.replace('<folder>', str(p))}")
    rel = Path(base).expanduser()
    if rel.is_absolute() or rel.exists():
        return base
    for parent in p.resolve().parents:
        if (parent / rel / "config.json").is_file() or (parent / rel / "adapter_config.json").is_file():
            return str(parent / rel)
    return base  # a hub name (org/model) or a folder that is gone: the loader says which


def resolve_adapter_folder(path: str, adapters: dict[str, str]) -> tuple[str, dict[str, str]]:
    """``hf:<adapter folder>`` -> (base model, {role: adapter}); other paths pass through.

    The base comes from ``deepr_meta.json`` (``base_model``), else from peft's
    ``adapter_config.json`` (``base_model_name_or_path``). The adapter serves the roles
    recorded in ``deepr_meta.json``, or every role (``*``) when none is recorded; an explicit
    ``adapter=<role>:<dir>`` in the spec wins for its role.
    """
    p = Path(path).expanduser()
    if (p / "config.json").is_file() or not (p / "adapter_config.json").is_file():
        return path, adapters
    base = adapter_base(p)
    roles = _meta_roles(_read_json(p / "deepr_meta.json"), p) or [ALL_ROLES]
    return base, {**{r: str(p) for r in roles}, **adapters}
