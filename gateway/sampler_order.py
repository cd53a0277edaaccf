"""llama-server's `samplers` (its sampler order) as the order the tail applies its stages in (pure).

llama-server runs the samplers its `samplers` field lists, in that order, each on the candidates
the earlier ones left (its default: penalties, dry, top_n_sigma, top_k, typ_p, top_p, min_p, xtc,
temperature; its web UI sends one as a list of names or a string of letters). The tail applies
penalties (and logit_bias and the output constraint) first, then top_k, min_p, temperature and
top_p in SamplingParams.order, with llama.cpp's semantics (nodes/sampling.py). So a request's
`samplers` is honoured when:
- it names only samplers llama-server has (`infill` and `adaptive_p`, which change answers, and
  unknown names are refused);
- it lists each stage the request turns on exactly once (llama-server skips a stage it does not
  list, and runs one listed twice twice); a sampler that is off (dry, typ_p, xtc, top_n_sigma
  at their "disabled" values, which gateway/neutral_params.py checks; top_k 0, min_p 0, top_p 1,
  temperature 1, no penalties) does nothing wherever it is listed;
- the penalties, when on, come before every other stage the request turns on.
Anything else is a 400 naming `samplers`.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequestError
from schemas.sampling import DEFAULT_ORDER, SamplingParams, Stage

# llama-server's sampler names (common_sampler_type_to_str) and their one-letter forms
SAMPLER_CHARS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                 "t": "temperature", "x": "xtc", "e": "penalties"}
PIPELINE = ("penalties", *DEFAULT_ORDER)  # this gateway's order when a request sends no `samplers`
# either order of these gives the same candidates: both judge the same ranking
_COMMUTE = {frozenset({"top_k", "min_p"}), frozenset({"top_k", "temperature"})}


def active_stages(sampling: SamplingParams) -> list[str]:
    """The stages a request turns on, in PIPELINE's order. A greedy request (temperature 0)
    keeps the likeliest token whatever top_k, min_p and top_p keep."""
    on = {"penalties": bool(sampling.presence_penalty or sampling.frequency_penalty),
          "temperature": sampling.temperature != 1.0}
    if not sampling.greedy:
        on |= {"top_k": sampling.top_k > 0, "min_p": sampling.min_p > 0.0, "top_p": sampling.top_p < 1.0}
    return [s for s in PIPELINE if on.get(s)]


def _refuse(message: str) -> InvalidRequestError:
    return InvalidRequestError(f"samplers: {message}", param="samplers", code="unsupported_value")


def sampler_names(value: Any) -> list[str]:
    """The names `samplers` lists (a list of names, or a string of their letters), or a 400."""
    if isinstance(value, str):
        names = [SAMPLER_CHARS.get(c, "infill" if c == "i" else c) for c in value]  # i: llama-server's infill
    elif isinstance(value, list) and all(isinstance(s, str) for s in value):
        names = list(value)
    else:
        raise InvalidRequestError("invalid value for samplers: a list of sampler names or a string of their "
                                  "letters", param="samplers", code="invalid_value")
    unknown = [n for n in names if n not in SAMPLER_CHARS.values()]
    if unknown:
        raise _refuse(f"{unknown[0]!r} is not a sampler this gateway runs; the list may name "
                      f"{', '.join(SAMPLER_CHARS.values())} (those that are off are ignored)")
    return names


def _canonical(stages: list[str]) -> tuple[Stage, ...]:
    """A full order of the four cut and scale stages that gives what `stages` (the active ones,
    in the listed order) gives: DEFAULT_ORDER where it does (so such a request's arithmetic is
    the default's), else the listed ones with commuting neighbours put in DEFAULT_ORDER's
    order, then the inactive ones."""
    out = list(stages)
    moved = True
    while moved:
        moved = False
        for i in range(len(out) - 1):
            a, b = out[i], out[i + 1]
            if frozenset({a, b}) in _COMMUTE and DEFAULT_ORDER.index(b) < DEFAULT_ORDER.index(a):
                out[i], out[i + 1], moved = b, a, True
    if out == [s for s in DEFAULT_ORDER if s in out]:
        return DEFAULT_ORDER
    return (*out, *(s for s in DEFAULT_ORDER if s not in out))  # type: ignore[return-value]


def sampler_order(value: Any, sampling: SamplingParams) -> tuple[Stage, ...]:
    """The order the tail applies `sampling`'s stages in for a request's `samplers` (None: not
    sent, the default), or a 400 naming `samplers` (see the module's docstring)."""
    if value is None:
        return DEFAULT_ORDER
    names = sampler_names(value)
    stages = active_stages(sampling)
    for s in stages:
        if names.count(s) != 1:
            how = "does not list it" if s not in names else f"lists it {names.count(s)} times"
            raise _refuse(f"this request turns {s} on, so it must be listed exactly once (the list {how})")
    listed = [n for n in names if n in stages]
    if "penalties" in listed and listed[0] != "penalties":
        raise _refuse(f"the penalties are applied first here, and this request lists {listed[0]} before them")
    if sampling.greedy:
        return DEFAULT_ORDER  # the likeliest token, whatever the order
    return _canonical([n for n in listed if n != "penalties"])


def ordered(sampling: SamplingParams, samplers: Any) -> SamplingParams:
    """`sampling` with the order a request's `samplers` gives (or the 400 naming it)."""
    order = sampler_order(samplers, sampling)
    return sampling if order == sampling.order else sampling.model_copy(update={"order": order})
