"""The control plane's ZeroMQ port for data planes: one ROUTER socket, bound once; with keys, a CURVE
server behind pyzmq's ZAP authenticator, so a peer without an authorised key never completes its handshake."""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator

from nanoplane.plane_keys import PlaneKeys
from nanoplane.process import terminate


class PlanePort:
    def __init__(self, address: str, keys: PlaneKeys | None = None):
        """Bind `address` (tcp://host:port, tcp://host:* or ipc:///path); `keys`: accept only the data planes
        whose public keys are in keys.authorized. A failed bind leaves no thread or context behind."""
        self.ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.sock = self.ctx.socket(zmq.ROUTER)
        if keys is not None:
            self._auth = ThreadAuthenticator(self.ctx, log=logging.getLogger("nanoplane.plane_auth"))
            self._auth.start()
            self._auth.configure_curve(domain="*", location=keys.authorized)
            keys.apply(self.sock)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a departed rank fails instead of vanishing
        # A blocking recv with a timeout, not Socket.poll (which builds a Poller per call): the
        # client's loops wait in recv and wake at least every 100 ms for liveness checks.
        self.sock.rcvtimeo = 100
        try:
            self.sock.bind(address)
        except zmq.ZMQError:
            if self._auth is not None:
                self._auth.stop()
            self.sock.close(0)
            self.ctx.term()
            raise
        self.address: str = self.sock.last_endpoint.decode()

    def release(self) -> None:
        """After the socket is closed: stop the authenticator and end the context (bounded)."""
        if self._auth is not None:
            self._auth.stop()
        terminate(self.ctx, "data-plane")
