"""Process plumbing both planes and the command line share: ports, stopping, logging, GC, ZeroMQ teardown.

No torch and no ZeroMQ import here: the command line and the control plane import this module too.
"""

from __future__ import annotations

import gc
import logging
import socket
import subprocess
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import zmq

log = logging.getLogger("nanoplane.process")
TERM_WAIT_S = 3.0  # how long `terminate` waits for ZeroMQ before it gives up on a context


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after grace_s."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def configure_logging(role: str) -> None:
    """INFO to stderr, each line naming the process's role (`rank0`, `launcher`, `serve`, ...)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(message)s")


def freeze_startup_objects(thaw_first: bool = False) -> None:
    """Hand every object alive now to Python's permanent generation.

    A full collection walks every tracked object (a rank's torch, model and CUDA graphs are ~300k of
    them) and stops the process's loop, and every stream with it, meanwhile; start-up's objects live
    as long as the process, so nothing is lost by never walking them again. `thaw_first`: collect what
    was frozen before too (a process that replaces what it froze, such as an engine after a re-attach)."""
    if thaw_first:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


def terminate(ctx: zmq.Context, what: str) -> None:
    """Terminate a ZeroMQ context whose sockets are closed, waiting at most TERM_WAIT_S.

    libzmq 4.3.5 can hang in zmq_ctx_term for good, whatever the linger, when a message went to a peer
    that was disconnecting at that moment (a rank or an engine process that had just exited): a loop of
    attach, peer exit, Shutdown, close hung in about one close of five. A process that stops must not
    hang on that, so the wait runs in a daemon thread and is abandoned, with a warning, if it lasts; the
    context's threads then end with the process."""
    waiter = threading.Thread(target=ctx.term, name=f"nanoplane-term-{what}", daemon=True)
    waiter.start()
    waiter.join(TERM_WAIT_S)
    if waiter.is_alive():
        log.warning("ZeroMQ did not release the %s sockets within %.0fs; left to the process's exit",
                    what, TERM_WAIT_S)
