"""One way to set a trainer. A training config holds deepr's own fields; every TRL or peft setting
is given by TRL's own name — a field of TRL's ``GRPOConfig`` / ``SFTConfig``, or one of the
``lora_*`` fields of TRL's ``ModelConfig`` (the names TRL's own scripts take as flags) — in the
same settings: a config file, a flag, or a keyword. deepr restates no TRL field: it checks each
name against TRL's dataclasses when the trainer is built, and TRL validates the values.

Where a value comes from, lowest first: TRL's default, the stage's ``BASE`` (what deepr sets for
every run of that trainer), its ``PAPER`` (the paper's table), then the user's settings.

    SftConfig(model="m", out="o", learning_rate=2e-5, lora_r=16)   # TRL names, as flags and files use
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# TRL ModelConfig's LoRA fields (the names TRL's scripts take as flags).
LORA_EXTRA = ("use_rslora", "use_dora")
# Names deepr's flags and older config files used for TRL settings.
ALIASES = {"lr": "learning_rate", "epochs": "num_train_epochs", "lr_scheduler": "lr_scheduler_type",
           "target_modules": "lora_target_modules", "grad_accum": "gradient_accumulation_steps",
           "batch_size": "per_device_train_batch_size"}


class TrainerSettings(BaseModel):
    """Base of every training config: deepr's fields are declared on the subclass; anything else
    is a TRL setting (``trl``) or a LoRA setting (``lora``, TRL ModelConfig's ``lora_*`` names),
    read back as attributes (``config.learning_rate``)."""

    model_config = ConfigDict(extra="forbid")
    BASE: ClassVar[dict[str, Any]] = {}
    PAPER: ClassVar[dict[str, Any]] = {}
    trl: dict[str, Any] = Field(default_factory=dict, description="TRL trainer settings by TRL's field names.")
    lora: dict[str, Any] = Field(default_factory=dict, description="LoRA settings by TRL ModelConfig's lora_* "
                                 "names (lora_r, lora_alpha, lora_dropout, lora_target_modules).")

    @model_validator(mode="before")
    @classmethod
    def _route(cls, data: Any) -> Any:
        """Keys that are not deepr fields go to ``trl`` or ``lora`` under TRL's name."""
        if not isinstance(data, dict):
            return data
        own = set(cls.model_fields)
        out = {k: v for k, v in data.items() if k in own}
        trl, lora = dict(out.get("trl") or {}), dict(out.get("lora") or {})
        for key, value in data.items():
            if key not in own:
                name = ALIASES.get(key, key)
                (lora if is_lora(name) else trl)[name] = value
        return {**out, "trl": trl, "lora": lora}

    @field_validator("model", check_fields=False)
    @classmethod
    def _absolute_local_model(cls, v: str) -> str:
        # the adapter records this as its base: relative to today's directory, it would not load
        # from another one (`deepr run --llm hf:<adapter>` elsewhere)
        from deepr.llm.hf_adapters import local_path

        return local_path(v)

    @model_validator(mode="after")
    def _fill(self) -> Any:
        self.fill()
        return self

    def __getattr__(self, name: str) -> Any:
        name = ALIASES.get(name, name)
        for part in ("trl", "lora"):
            values = self.__dict__.get(part) or {}
            if name in values:
                return values[name]
        return super().__getattr__(name)  # type: ignore[misc]

    def paper(self) -> dict[str, Any]:
        """The paper's values of this stage (settings the user leaves out take them)."""
        return self.PAPER

    def fill(self) -> None:
        """Put BASE and PAPER values under the user's: deepr fields left None, TRL and LoRA settings
        not given."""
        for name, value in {**self.BASE, **self.paper()}.items():
            if name in type(self).model_fields:
                if getattr(self, name) is None:
                    setattr(self, name, value)
            else:
                self.setdefault(name, value)

    def setdefault(self, name: str, value: Any) -> None:
        (self.lora if is_lora(name) else self.trl).setdefault(name, value)

    def flat(self) -> dict[str, Any]:
        """Every setting under one name each (deepr's, TRL's, LoRA's): what deepr_meta.json and the
        sidecar record as the run's config."""
        own = self.model_dump(mode="json", exclude={"trl", "lora"})
        return {**own, **self.trl, **self.lora}

    def peft_config(self) -> Any:
        """peft's LoraConfig from the lora_* settings, built as TRL's scripts build it."""
        from trl import ModelConfig, get_peft_config

        check_names(ModelConfig, self.lora, "LoRA (TRL ModelConfig)")
        return get_peft_config(ModelConfig(use_peft=True, lora_task_type="CAUSAL_LM", **self.lora))


def is_lora(name: str) -> bool:
    return name.startswith("lora_") or name in LORA_EXTRA


def check_names(dataclass: type, values: dict[str, Any], what: str) -> None:
    """Refuse a setting ``dataclass`` has no field for, naming it (a typo would otherwise be lost)."""
    known = {f.name for f in dataclasses.fields(dataclass)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown setting {unknown[0]!r}: not a field of deepr's config nor of {what}; "
                         "see docs/training.md for the names")


def build_args(dataclass: type, values: dict[str, Any], what: str, **fixed: Any) -> Any:
    """TRL's config dataclass from deepr's fixed values and the settings; a name TRL does not know,
    or a value TRL refuses, is a ValueError naming the settings (nothing has been loaded yet)."""
    check_names(dataclass, values, what)
    seed = values.get("seed", 0)
    if not (isinstance(seed, int) and 0 <= seed < 2**32):  # TRL takes any int; numpy refuses it at train time
        raise ValueError(f"{what} refused the settings (seed={seed!r}): the seed must be between 0 and 2**32 - 1")
    try:
        return dataclass(**fixed, **values)
    except (ValueError, TypeError) as e:
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(values.items()))
        raise ValueError(f"{what} refused the settings ({shown}): {e}") from None


def parse_assignments(pairs: list[str] | None, flag: str = "--set") -> dict[str, Any]:
    """``NAME=VALUE`` strings as settings: VALUE read as JSON where it parses (numbers, true,
    null, lists), else as text; NAME with dashes or underscores."""
    import json

    out: dict[str, Any] = {}
    for pair in pairs or ():
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"{flag} {pair!r}: expected NAME=VALUE, e.g. {flag} warmup_steps=10")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        out[name.strip().replace("-", "_")] = value
    return out
