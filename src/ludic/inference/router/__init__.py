"""One address over N inference servers (spec 5's reward router, built to take policy
servers too): least-in-flight load balancing, health checks, retry on another backend.

* :mod:`ludic.inference.router.pool`: :class:`Backend`, :class:`BackendPool` (choice,
  leases, health checks; no web framework).
* :mod:`ludic.inference.router.app`: :class:`RouterApp`, the ASGI app (which routes are
  forwarded, retries, ``/router/backends``).
* :mod:`ludic.inference.router.server`: ``ludic serve router`` and :func:`start_router`.
"""

from ludic._lazy import lazy_exports

__getattr__, __all__ = lazy_exports(
    __name__,
    globals(),
    {
        "Backend": "ludic.inference.router.pool",
        "BackendPool": "ludic.inference.router.pool",
        "NoBackendError": "ludic.inference.router.pool",
        "RouterApp": "ludic.inference.router.app",
        "DATA_ROUTES": "ludic.inference.router.app",
        "start_router": "ludic.inference.router.server",
    },
)
