"""Who may abort which request through vLLM's `Abort` (router/api/vllm_grpc.py): the caller that
started it, or a caller holding the admin token. Request ids are client-chosen and often
guessable (a gateway forwards its own), so without this any client could end other users'
streams by id.

The caller is its mutual-TLS certificate when it sent one, else its connection (gRPC's peer
address and port): a gateway's Generate and Abort share its channel. A request started through
another front end (epcluster.v1, HTTP) has no vLLM owner: only the admin token aborts it there.
"""

import hashlib

import grpc

from router.auth import ADMIN, ServerSecurity
from router.frontend import Frontend


def caller(context: grpc.aio.ServicerContext) -> str:
    """The identity of the call's client: its certificate's digest, or its connection."""
    certs = (context.auth_context() or {}).get("x509_pem_cert")
    if certs:
        return "cert:" + hashlib.sha256(certs[0]).hexdigest()
    return "peer:" + context.peer()


class AbortScope:
    """The owner of each vLLM request in flight, and the Abort check over it."""

    def __init__(self, frontend: Frontend, security: ServerSecurity | None = None) -> None:
        self.frontend = frontend
        self.security = security or ServerSecurity()
        self.owners: dict[str, tuple[str, object]] = {}  # request id -> (caller, call marker)

    def started(self, request_id: str, context: grpc.aio.ServicerContext) -> None:
        """Record the call's caller as the request's owner until the call ends. NOTE: an id
        already in flight is not taken over (the front end refuses it as a duplicate)."""
        if request_id in self.frontend.in_flight or request_id in self.owners:
            return
        entry = (caller(context), object())
        self.owners[request_id] = entry

        def forget(_: object) -> None:
            if self.owners.get(request_id) is entry:
                del self.owners[request_id]

        context.add_done_callback(forget)

    def refusal(self, request_ids: list[str], context: grpc.aio.ServicerContext) -> str | None:
        """Why this caller may not abort these ids (None: it may): an id in flight that another
        caller started needs the admin token. Unknown ids are nothing to abort."""
        authorization = dict(context.invocation_metadata() or ()).get("authorization")
        if self.security.role(authorization) == ADMIN:
            return None
        me = caller(context)
        for rid in request_ids:
            owner = self.owners.get(rid)
            if rid in self.frontend.in_flight and (owner is None or owner[0] != me):
                return (
                    f"request {rid!r} was started by another caller: aborting it needs the "
                    "admin token (send it as the bearer token)"
                )
        return None
