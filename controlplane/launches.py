"""What the control plane knows of each data plane that said hello: a *launch* (one launcher run) and its
ranks, each with the ZeroMQ ROUTER identities of its two sockets, the only ones heard as that rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from nanoplane.proto.plane import PlaneInfo


@dataclass(slots=True, eq=False)  # compared by identity: a rank is its own key in the Liveness
class Rank:
    rank: int
    pid: int
    beat_ident: bytes  # ROUTER identity of the rank's liveness socket
    data_ident: bytes = b""  # ROUTER identity of the rank's data socket, known from READY
    info: PlaneInfo | None = None


@dataclass(slots=True)
class Launch:
    launch_id: int
    epoch: int
    world_size: int
    ranks: dict[int, Rank] = field(default_factory=dict)

    def sent(self, ident: bytes) -> bool:
        """Whether `ident` is one of this launch's ranks' sockets."""
        return any(ident in (r.beat_ident, r.data_ident) for r in self.ranks.values())

    def complete(self) -> bool:
        return len(self.ranks) == self.world_size and all(r.info is not None for r in self.ranks.values())
