"""The numerics envelope a probe runs under, and the combination it refuses before any rank joins a group.

A probe's negative control forces a route without a canonical sum (``--route native``). Under a bitwise envelope
the router refuses that route for every float SUM site, so the run could only end in a ``ValueError`` on every
rank after the group is up. Under ``detcomm-launch`` the ranks always see an exported ``$DETCOMM_NUMERICS`` (the
launcher's ``--numerics``, rl-bitwise by default), so a probe-side "auto when the route is native" default would
never apply there; the probe says what to pass instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from detcomm.envelope import BITWISE_ENVELOPES, DEFAULT_NUMERICS
from detcomm.sites import ROUTE_INFO, Route

__all__ = ["ROUTE_CHOICES", "probe_numerics"]

NUMERICS_ENV = "DETCOMM_NUMERICS"
ROUTE_CHOICES: tuple[str, ...] = tuple(r.value for r in Route)


def probe_numerics(flag: str | None, *, route: str | None, command: str,
                   env: Mapping[str, str] | None = None) -> str:
    """The envelope of a probe run: ``--numerics``, else ``$DETCOMM_NUMERICS``, else ``DEFAULT_NUMERICS``.

    Args:
        flag: the probe's ``--numerics`` (None when not given).
        route: the probe's ``--route`` (None when not given); a ``Route`` value.
        command: the probe's sub-command (``model``, ``hf``, ``collectives``), quoted in the fix.
        env: the environment to read (default ``os.environ``).

    Raises:
        ValueError: ``route`` makes no canonical-sum claim and the envelope is bitwise; the message names where
            the envelope came from and the command line that runs the negative control.
    """
    current = os.environ if env is None else env
    exported = current.get(NUMERICS_ENV) or None
    numerics = flag or exported or DEFAULT_NUMERICS
    if route is None or numerics not in BITWISE_ENVELOPES or ROUTE_INFO[Route(route)].canonical_sum:
        return numerics
    if flag:
        source = f"--numerics {flag}"
    elif exported:
        source = (f"${NUMERICS_ENV}={exported}, exported to every rank (detcomm-launch exports its --numerics, "
                  f"{DEFAULT_NUMERICS} by default)")
    else:
        source = f"the default envelope {DEFAULT_NUMERICS}"
    raise ValueError(
        f"--route {route} makes no bitwise claim, so the {numerics} envelope (from {source}) refuses it on every "
        f"float SUM site; run the negative control under numerics auto: detcomm-launch --nproc N --numerics auto "
        f"-m detcomm.probe {command} --route {route} --expect-divergence")
