"""What every route implementation shares: binding a site to the backend's method for that site's collective.

The communicator validates inputs and routing picks the route before a backend sees a tensor; a backend only
moves and reduces. Every method is collective over the backend's group: all ranks call it in the same order
with tensors of the same dtype and trailing shape. ``bind`` resolves the collective (and op) once per site, so
a call does no dispatch work; a route asked to bind a collective it cannot carry is a routing bug (sites.py's
table of what each route carries), hence an assertion, not a user error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..sites import CallArgs, Collective, Route, Site
from .guard import MessageGuard

Call = Callable[[torch.Tensor, CallArgs], torch.Tensor]


@dataclass(frozen=True)
class Bound:
    """A site bound to one route's method (implements route.BoundRoute)."""

    route: Route
    site: Site
    call: Call
    # Every kernel variant a call of the site can reach, by name, each forced (ipc_fold: one_shot, two_shot,
    # chunked...): the self-checks prove each before the site's first use. Empty: the route has one code path.
    variants: Mapping[str, Call] = field(default_factory=dict)
    # The call may be handed x itself as args.out (route.BoundRoute.in_place): it reads each input element before
    # it writes that element of the result, so an in-place call needs no copy.
    in_place: bool = False
    # The call guard's header inside the call's own message (guard.MessageGuard), where the route carries it: the
    # communicator arms it with each user call's number before the call. None: the route's messages are the data.
    guard: MessageGuard | None = None

    def __call__(self, x: torch.Tensor, args: CallArgs) -> torch.Tensor:
        return self.call(x, args)


def bind_from(route: Route, site: Site, table: dict[Collective, Call], *, in_place: bool = False,
              guard: MessageGuard | None = None) -> Bound:
    """Bind ``site`` to the entry of ``table`` (the backend's methods by collective); ``in_place``, ``guard``: see
    Bound."""
    # The norm composition's communication is its all-reduce (the communicator adds the residual and normalizes).
    collective = Collective.ALL_REDUCE if site.collective is Collective.ALL_REDUCE_RMSNORM else site.collective
    call = table.get(collective)
    assert call is not None, f"route {route.value} cannot carry {site.collective.value}: routing sent it here"
    return Bound(route, site, call, in_place=in_place, guard=guard)
