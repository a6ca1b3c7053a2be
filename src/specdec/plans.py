"""One request, whichever front end it comes through.

`specdec generate` (the CLI), `specdec.request` / `generate` (the Python API) and the server's
`make_job` each hand what their caller said to `plan_request`, which decides by one set of
rules the drafter (a prediction's included), its k and the checked config and sampling. The
front ends differ only in how they say an error: a line on stderr, a ValueError, a 400 naming
the request's field (`PlanError.param`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import GenerationConfig, SamplingParams
from .drafters.base import Drafter, draft_model_method, needs_draft_model, resolve_k, uses_draft_model
from .drafters.prediction import PREDICTION_READERS

PLAIN = "none"  # the method name that asks for plain decoding (the server's `speculative.method`)
CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig)) - {"k"}
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class PlanError(ValueError):
    """A request that cannot run as asked; `param`: the request field at fault (the server's
    400 names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RequestPlan:
    """What a request runs with, decided; the front end builds `drafter` (a name) into a drafter."""

    drafter: str | Drafter | None  # a registered name, the caller's own drafter, None: plain decoding
    uses_draft: bool  # whether that drafter reads the draft model (the front end hands it over)
    config: GenerationConfig
    sampling: SamplingParams
    k_source: str | None  # "given", "tuned" or "default"; None for plain decoding


def name_of(drafter: str | Drafter | None) -> str | None:
    if drafter is None or isinstance(drafter, str):
        return None if drafter == PLAIN else drafter
    return drafter.name or type(drafter).__name__


def prediction_drafter(named: str | Drafter | None, default: str | None, draft: bool) -> str | Drafter:
    """The drafter of a request that carries a prediction: the one the request names, if it
    reads predictions (else an error); else the front end's default where that reads them; else
    auto where a draft model is at hand (the prediction, the draft model and copying, each step
    the best), the prediction drafter alone where not."""
    if named is not None:
        if name_of(named) not in PREDICTION_READERS:
            raise PlanError(
                f"the {name_of(named) or 'plain'} drafter does not draft from a prediction; use "
                f"{' or '.join(repr(n) for n in PREDICTION_READERS)}, or drop the prediction",
                param="prediction",
            )
        return named
    if default in PREDICTION_READERS:
        return default
    return "auto" if draft else "prediction"


def choose_drafter(
    named: str | Drafter | None, default: str | None, draft: bool, predicted: bool
) -> str | Drafter | None:
    """The request's drafter (None: plain decoding): the one it names, else the front end's
    default, else the draft model's drafter where a draft is at hand; for a request with a
    prediction, `prediction_drafter`."""
    if predicted:
        drafter: str | Drafter | None = prediction_drafter(named, default, draft)
    else:
        drafter = named if named is not None else default
        if drafter is None and draft:
            drafter = draft_model_method()
    if name_of(drafter) is None:
        return None
    if isinstance(drafter, str) and needs_draft_model(drafter) and not draft:
        raise PlanError(
            f"the {drafter} drafter needs a draft model (--draft NAME, or assistant_model=)", param="speculative"
        )
    return drafter


def plan_request(
    *,
    target: str,
    mode: str,
    draft: str | None,
    named: str | Drafter | None = None,
    default: str | None = None,
    k: int | None = None,
    predicted: bool = False,
    config: GenerationConfig | dict[str, Any] | None = None,
    sampling: SamplingParams | dict[str, Any] | None = None,
) -> RequestPlan:
    """The request's drafter, k, config and sampling. `target`, `mode`: the target's name and
    precision; `draft`: the draft model at hand (its name), if any; `named`: the drafter the
    request names (`PLAIN`: plain decoding), else the front end's `default`, else the draft
    model's drafter where a draft is at hand, else plain; `predicted`: the request carries a
    prediction (`prediction_drafter`). `k`: the request's, else the tuned or the drafter's own
    (`resolve_k`). `config`, `sampling`: built by the caller, or their fields."""
    drafter = choose_drafter(named, default, draft is not None, predicted)
    name = name_of(drafter)
    uses = isinstance(drafter, str) and uses_draft_model(drafter) and draft is not None
    try:
        if not isinstance(sampling, SamplingParams):
            sampling = SamplingParams(**(sampling or {}))
        if isinstance(config, GenerationConfig):
            if k is not None:
                raise PlanError("pass config= or its fields as keywords, not both")
            return RequestPlan(drafter, uses, config, sampling, "given" if drafter is not None else None)
        k_source = None
        if drafter is not None:
            k, k_source = resolve_k(k, target=target, method=name, mode=mode, draft=draft)
        fields = dict(config or {})
        if "stop" in fields and fields["stop"] is not None:
            fields["stop"] = (fields["stop"],) if isinstance(fields["stop"], str) else tuple(fields["stop"])
        cfg = GenerationConfig(**fields, **({"k": k} if k is not None else {}))
    except PlanError:
        raise
    except ValueError as exc:
        raise PlanError(str(exc)) from exc
    return RequestPlan(drafter, uses, cfg, sampling, k_source)
