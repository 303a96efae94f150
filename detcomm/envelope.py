"""Numerics envelopes: named sets of collectives switches that keep a deployment's numerical contract coherent.

Every switch exists on its own; an envelope only ever tightens. It sets every switch it governs to the tight
value and refuses, with the reason, an explicit choice it cannot tighten (a fused all-reduce+norm requested
under rl-bitwise, say), instead of keeping the choice and silently voiding the contract. Validation happens
once, here; the layers that read a resolved switch trust it.

Selection code tests ``numerics in BITWISE_ENVELOPES``, never a name, so an envelope a plugin registers above
rl-bitwise inherits every pin.

Rejected alternatives: reading switches from environment variables at call time (a switch could then change
between ranks or between calls; detcomm resolves once at ``init``) and a free-form dict of options (unknown
names would pass silently; here an unknown switch is an error naming the known ones).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field

from .errors import DetcommError

__all__ = [
    "BITWISE_ENVELOPES",
    "DEFAULT_NUMERICS",
    "MULTICAST_OFF_ENV",
    "Envelope",
    "Switches",
    "Resolved",
    "register_numerics_envelope",
    "resolve_numerics",
    "warn_missing_environment",
    "envelope_environment",
    "apply_environment",
    "known_envelopes",
    "fingerprint",
]

# docs/spec.md section 8: set wherever detcomm creates an environment, unless the user opted into multicast.
MULTICAST_OFF_ENV: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

# NCCL reads these when a communicator is created; a ring reduction with the Simple protocol keeps one
# association order per message size (run-stable, though still not batch-invariant).
BITWISE_NCCL_ENV: Mapping[str, str] = {"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple"}
TF32_OFF_ENV: Mapping[str, str] = {"NVIDIA_TF32_OVERRIDE": "0"}

_LAYER_BOUNDARY_NORMS = ("fused", "unfused")

# The one default envelope of every entry point (detcomm.init, the probes, `detcomm routes`, detcomm-launch):
# the guarantee this package exists for. Speed-first deployments opt out with numerics="auto".
DEFAULT_NUMERICS = "rl-bitwise"


@dataclass(frozen=True)
class Switches:
    """The collectives switches. ``None`` means "not chosen": the envelope (or the default) decides.

    Attributes:
        batch_invariant_collectives: every floating-point SUM reduction takes a canonical-fold route.
        layer_boundary_norm: "fused" or "unfused"; unfused vetoes every all-reduce + norm fusion: detcomm's own
            (batch_invariant_fusion) and, for an engine reading ``Resolved.switches``, the engine's.
        batch_invariant_fusion: ``all_reduce_residual_rmsnorm`` may run detcomm's fused workspace kernel instead
            of the all-reduce followed by the canonical norm. Allowed in every envelope because the only fused
            kernel detcomm routes to has the ``batch_invariant`` feature and serves a site only after the
            self-checks proved it bit-equal to the composition (docs/spec.md §9.2); layer_boundary_norm="unfused"
            vetoes it.
        nccl_ring_simple: require NCCL_ALGO=Ring and NCCL_PROTO=Simple before any NCCL communicator exists.
        disable_tf32: NVIDIA_TF32_OVERRIDE=0 and TF32 off in torch.
        force_deterministic_rsag: reductions only on the native collective + fold (no symmetric-memory
            path at all); gathers move to the native collective. Not folded in by any envelope.
        allow_multicast: the user's opt-in to NVLink multicast (docs/spec.md §8); still subject to hardware support
            and to none of the multicast-off variables being set.
    """

    batch_invariant_collectives: bool | None = None
    layer_boundary_norm: str | None = None
    batch_invariant_fusion: bool | None = None
    nccl_ring_simple: bool | None = None
    disable_tf32: bool | None = None
    force_deterministic_rsag: bool | None = None
    allow_multicast: bool | None = None

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_kwargs(cls, switches: Mapping[str, object]) -> Switches:
        unknown = sorted(set(switches) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"unknown numerics switch(es) {unknown}; the known switches are {list(cls.names())}"
            )
        for name, value in switches.items():
            _check_type(name, value)
        return cls(**switches)  # type: ignore[arg-type]


def _check_type(name: str, value: object) -> None:
    if value is None:
        return
    if name == "layer_boundary_norm":
        if value not in _LAYER_BOUNDARY_NORMS:
            raise ValueError(f"switch {name} must be one of {_LAYER_BOUNDARY_NORMS}, got {value!r}")
    elif not isinstance(value, bool):
        raise ValueError(f"switch {name} must be True or False, got {value!r}")


# The defaults of a plain (auto) deployment: the fast paths on.
_DEFAULTS = Switches(
    batch_invariant_collectives=False,
    layer_boundary_norm="fused",
    batch_invariant_fusion=True,
    nccl_ring_simple=False,
    disable_tf32=False,
    force_deterministic_rsag=False,
    allow_multicast=False,
)

# What a bitwise envelope pins. force_deterministic_rsag and allow_multicast are deliberately absent: the
# first is the user's own knob and the second an opt-in that the envelope neither grants nor needs.
_BITWISE_TIGHT: Mapping[str, object] = {
    "batch_invariant_collectives": True,
    "nccl_ring_simple": True,
    "disable_tf32": True,
}

_WHY_TIGHT: Mapping[str, str] = {
    "batch_invariant_collectives": "a bitwise envelope needs every SUM reduction on a canonical-fold route",
    "nccl_ring_simple": "NCCL's algorithm/protocol switch by message size changes the association order",
    "disable_tf32": "TF32 matrix products round differently from fp32 and vary with the kernel chosen",
}


@dataclass(frozen=True)
class Envelope:
    """A named numerics envelope.

    Attributes:
        name: the ``numerics=`` value that selects it.
        bitwise: whether it promises bitwise batch invariance (membership in ``BITWISE_ENVELOPES``).
        tight: switch values it pins; an explicit contrary choice is refused.
        description: one line for the route table and ``--help``.
    """

    name: str
    bitwise: bool
    tight: Mapping[str, object] = field(default_factory=dict)
    description: str = ""


@dataclass(frozen=True)
class Resolved:
    """An envelope with every switch decided. ``explicit`` names the switches the caller chose."""

    envelope: Envelope
    switches: Switches
    explicit: frozenset[str]

    @property
    def numerics(self) -> str:
        return self.envelope.name

    @property
    def bitwise(self) -> bool:
        return self.envelope.name in BITWISE_ENVELOPES

    def __getattr__(self, name: str) -> object:
        # Convenience: resolved.batch_invariant_collectives etc.
        if name in Switches.names():
            return getattr(self.switches, name)
        raise AttributeError(name)


_ENVELOPES: dict[str, Envelope] = {}


class _BitwiseView:
    """Live, read-only set-like view of the registered bitwise envelopes' names."""

    def __contains__(self, name: object) -> bool:
        env = _ENVELOPES.get(name) if isinstance(name, str) else None
        return env is not None and env.bitwise

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(n for n, e in _ENVELOPES.items() if e.bitwise))

    def __len__(self) -> int:
        return sum(1 for e in _ENVELOPES.values() if e.bitwise)

    def __repr__(self) -> str:
        return f"BITWISE_ENVELOPES({sorted(self)})"


BITWISE_ENVELOPES = _BitwiseView()


def register_numerics_envelope(
    name: str, *, bitwise: bool, tight: Mapping[str, object] | None = None, description: str = ""
) -> Envelope:
    """Register a numerics envelope (for plugins).

    A bitwise envelope always pins at least what rl-bitwise pins (it may pin more): an envelope cannot
    claim bitwise invariance while leaving a switch loose that voids it.
    """
    if not name or not isinstance(name, str):
        raise ValueError(f"an envelope needs a non-empty name, got {name!r}")
    if name in _ENVELOPES:
        raise ValueError(f"numerics envelope {name!r} is already registered")
    pins = dict(tight or {})
    for key, value in pins.items():
        if key not in Switches.names():
            raise ValueError(f"envelope {name!r} pins unknown switch {key!r}; known: {list(Switches.names())}")
        _check_type(key, value)
    if bitwise:
        for key, value in _BITWISE_TIGHT.items():
            if pins.setdefault(key, value) != value:
                raise ValueError(
                    f"bitwise envelope {name!r} cannot set {key}={pins[key]!r}: {_WHY_TIGHT[key]}"
                )
    env = Envelope(name=name, bitwise=bitwise, tight=pins, description=description)
    _ENVELOPES[name] = env
    return env


def unregister_numerics_envelope(name: str) -> None:
    """Remove a plugin's envelope (the built-in ones cannot be removed)."""
    if name in ("auto", "rl-bitwise"):
        raise ValueError(f"the built-in envelope {name!r} cannot be removed")
    _ENVELOPES.pop(name, None)


def known_envelopes() -> tuple[str, ...]:
    return tuple(sorted(_ENVELOPES))


register_numerics_envelope("auto", bitwise=False, description="fast paths; no bitwise claim")
register_numerics_envelope(
    "rl-bitwise",
    bitwise=True,
    description="bitwise batch- and run-invariant collectives for RL rollouts",
)


def resolve_numerics(numerics: str = "auto", **switches: object) -> Resolved:
    """Resolve an envelope and explicit switches into a coherent set, or raise ValueError with the reason.

    Order: the envelope's pins first (an explicit contrary choice is refused), then the implications
    between switches (layer_boundary_norm="unfused" vetoes batch_invariant_fusion; an explicit contrary choice
    is a conflict), then the defaults for whatever is still open.
    """
    if numerics not in _ENVELOPES:
        raise ValueError(f"unknown numerics envelope {numerics!r}; known: {list(known_envelopes())}")
    env = _ENVELOPES[numerics]
    chosen = Switches.from_kwargs(switches)
    explicit = frozenset(k for k in Switches.names() if getattr(chosen, k) is not None)
    values = {k: getattr(chosen, k) for k in Switches.names()}

    for key, tight in env.tight.items():
        if values[key] is not None and values[key] != tight:
            why = _WHY_TIGHT.get(key, f"envelope {numerics!r} pins it")
            raise ValueError(
                f"numerics={numerics!r} cannot keep the explicit choice {key}={values[key]!r}: {why}. "
                f"Drop the switch (the envelope sets {key}={tight!r}) or use numerics='auto'."
            )
        values[key] = tight

    if values["layer_boundary_norm"] == "unfused":
        if values["batch_invariant_fusion"]:
            raise ValueError("conflicting switches: batch_invariant_fusion=True with layer_boundary_norm='unfused' "
                             "(unfused vetoes every all-reduce + norm fusion); drop one of them")
        values["batch_invariant_fusion"] = False

    for key in Switches.names():
        if values[key] is None:
            values[key] = getattr(_DEFAULTS, key)
    return Resolved(envelope=env, switches=Switches(**values), explicit=explicit)  # type: ignore[arg-type]


def envelope_environment(numerics: str = "auto", **switches: object) -> dict[str, str]:
    """The environment a launcher sets before any rank (and any NCCL communicator) exists.

    Always the multicast-off variables of docs/spec.md §8 unless ``allow_multicast=True``; NCCL_ALGO=Ring and
    NCCL_PROTO=Simple when ``nccl_ring_simple`` resolves True; NVIDIA_TF32_OVERRIDE=0 when ``disable_tf32``.
    Plus DETCOMM_NUMERICS so that ``detcomm.init()`` in the ranks defaults to the same envelope.
    """
    resolved = resolve_numerics(numerics, **switches)
    env: dict[str, str] = {"DETCOMM_NUMERICS": resolved.numerics}
    if resolved.switches.nccl_ring_simple:
        env.update(BITWISE_NCCL_ENV)
    if resolved.switches.disable_tf32:
        env.update(TF32_OFF_ENV)
    if not resolved.switches.allow_multicast:
        env.update(MULTICAST_OFF_ENV)
    return env


def apply_environment(
    numerics: str = "auto", *, env: MutableMapping[str, str] | None = None, **switches: object
) -> dict[str, str]:
    """Write ``envelope_environment(numerics, **switches)`` into ``env`` (default ``os.environ``).

    Call it before ``torch.distributed.init_process_group``: NCCL reads its variables when a communicator is
    created. Returns the variables it set.
    """
    target = os.environ if env is None else env
    values = envelope_environment(numerics, **switches)
    target.update(values)
    return values


def missing_environment(resolved: Resolved, *, backend: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables ``resolved`` needs for a communicator of ``backend`` that ``env`` lacks (name -> wanted)."""
    current = os.environ if env is None else env
    wanted: dict[str, str] = {}
    if backend == "nccl" and resolved.switches.nccl_ring_simple:
        wanted.update(BITWISE_NCCL_ENV)
    if backend == "nccl" and resolved.switches.disable_tf32:
        wanted.update(TF32_OFF_ENV)
    return {k: v for k, v in wanted.items() if current.get(k) != v}


def multicast_allowed(resolved: Resolved, *, hardware_supports: bool, env: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """docs/spec.md §8's three conditions, with the reason when multicast is not allowed."""
    current = os.environ if env is None else env
    if not resolved.switches.allow_multicast:
        return False, "not opted in (allow_multicast=False)"
    set_off = [k for k, off in MULTICAST_OFF_ENV.items() if current.get(k) == off]
    if set_off:
        return False, f"disabled by {', '.join(f'{k}={MULTICAST_OFF_ENV[k]}' for k in set_off)}"
    if not hardware_supports:
        return False, "the hardware does not support NVLink multicast"
    return True, "opted in, supported, not disabled"


def default_numerics(env: Mapping[str, str] | None = None) -> str:
    """The envelope a launcher or the user exported (DETCOMM_NUMERICS), else DEFAULT_NUMERICS."""
    current = os.environ if env is None else env
    return current.get("DETCOMM_NUMERICS") or DEFAULT_NUMERICS



def fingerprint(resolved: Resolved) -> dict[str, str]:
    """What every rank of a group must agree on about its envelope (``Communicator`` compares it at init, before
    any other collective): the envelope's name and every switch's value."""
    out = {"numerics": resolved.numerics}
    out.update({f"switch {k}": repr(getattr(resolved.switches, k)) for k in Switches.names()})
    return out


def warn_missing_environment(resolved: Resolved, backend: str) -> None:
    """Refuse (NCCL under a bitwise envelope) or warn when the group was created without the environment
    the envelope needs: NCCL reads it only when a communicator is created."""
    missing = missing_environment(resolved, backend=backend)
    if not missing:
        return
    text = ", ".join(f"{k}={v}" for k, v in missing.items())
    fix = (
        f"launch with `detcomm-launch --numerics {resolved.numerics}` or call "
        f"detcomm.apply_environment({resolved.numerics!r}) before torch.distributed.init_process_group"
    )
    if resolved.bitwise and "NCCL_ALGO" in missing:
        raise DetcommError(
            f"numerics={resolved.numerics!r} needs {text} before the NCCL communicator is created, and the "
            f"process group already exists without it: {fix}"
        )
    warnings.warn(f"the process group was created without {text}; {fix}", RuntimeWarning, stacklevel=3)
