"""Weight sync over a torch.distributed group: SGLang's /init_weights_update_group and
/update_weights_from_distributed, both sides.

The trainer is rank 0 of a group of its own (not the default group, which a multi-process trainer
uses for itself); each server rank joins at rank_offset + its tensor-parallel rank. Per update the
trainer announces names, dtypes and shapes over HTTP and, while the server's handler waits in the
receive, broadcasts the tensors from rank 0 in the same order. NCCL when the trainer's weights are
on CUDA (real SGLang), gloo on CPU (launch.rollout_server, and the tests, on 127.0.0.1).

The group is built the way SGLang's `init_custom_process_group` builds it (a TCPStore at
master_address:master_port hosted by rank 0, a PrefixStore named after the group, then torch's
process-group helper), so the store keys agree with a real SGLang server running the same torch.
That helper is private torch API: this module is the one place that touches it. Rank 0 hosts the
store on a socket bound to master_address only (not every interface), which also removes the
race between picking a free port and binding it.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from launch.engines.base import EngineError
from launch.engines.sglang_client import ServerDown, SGLangClient
from miles_fn.config import ModelConfig
from state import hf

FLAG = "--rollout_weight_sync=distributed"


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling of a dtype in /update_weights_from_distributed ("bfloat16", "float32")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtypes: {name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def listen_socket(host: str) -> socket.socket:
    """A listening socket on host (port chosen by the OS) for rank 0's TCPStore; OSError if host is not local."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def init_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
               timeout_s: float, listen: socket.socket | None = None) -> dist.ProcessGroup:
    """Join (rank > 0) or host (rank 0, with `listen`) the group; blocks until every rank is in, or
    raises (DistStoreError / RuntimeError) after timeout_s."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    # the store takes the descriptor over (and closes it when it goes): detach it from the Python socket
    extra = {"master_listen_fd": listen.detach(), "use_libuv": True} if listen is not None else {}
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          wait_for_workers=False, **extra)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group ranks are the ranks used in broadcast
    return pg


def destroy_group(pg: dist.ProcessGroup | None) -> None:
    if pg is None:
        return
    try:
        dist.destroy_process_group(pg)
    except Exception:  # already torn down, or its peer is gone: nothing left to release
        pass


def broadcast(pg: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """Broadcast from rank 0, every tensor in order (the receiver posts the same sequence)."""
    handles = [dist.broadcast(t, src=0, group=pg, async_op=True) for t in tensors]
    for h in handles:
        h.wait()


def in_thread(fn: Callable[[], Any], name: str) -> Future:
    """Run fn on a daemon thread (so a stuck call never blocks exit); its result as a Future."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to whoever waits on the future
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


_GROUP_IDS = itertools.count()
GRACE_S = 30.0  # beyond the group timeout: how long an HTTP call of the sync may take to answer


@dataclasses.dataclass
class DistributedSync:
    """`sync(client, version, params)` for RemoteEngine over a weight-update group.

    The group is formed on first use and again after any failure or recovery (a restarted server
    has no group); each formation uses a new group name and port, so a half-formed earlier attempt
    can never be joined by mistake. A transport failure (the server gone mid-broadcast, the group
    not forming in time) raises ServerDown, which RemoteEngine answers with its recovery: restart
    the server, form the group again, send the weights again. A refusal raises EngineError.
    """

    cfg: ModelConfig
    host: str = "127.0.0.1"  # where rank 0 hosts the rendezvous; the server must reach it
    timeout_s: float = 120.0  # group formation, and one broadcast
    server_ranks: int = 1  # ranks the server adds (its tensor-parallel size)
    backend: str = ""  # "" = nccl when the weights are on CUDA, else gloo
    pg: dist.ProcessGroup | None = None
    group_name: str = ""
    url: str = ""
    groups_formed: int = 0

    def __call__(self, client: SGLangClient, version: int, params: Any) -> None:
        named = hf.named_tensors(self.cfg, params)
        backend = self.backend or ("nccl" if next(iter(named.values())).is_cuda else "gloo")
        tensors = {k: (v if backend == "nccl" else v.cpu()).contiguous() for k, v in named.items()}
        if self.pg is None or self.url != client.url:
            self.reset(client)
            self._connect(client, backend)
        try:
            self._update(client, version, tensors)
        except BaseException:
            self.reset(client)
            raise

    # --- forming the group -----------------------------------------------------------------------
    def _connect(self, client: SGLangClient, backend: str) -> None:
        try:
            listen = listen_socket(self.host)
        except OSError as e:
            raise EngineError(f"{FLAG}: cannot host the weight-update group on --rollout_weight_group_host="
                              f"{self.host}: {e}") from None
        port = listen.getsockname()[1]
        name = f"miles_weights_{os.getpid()}_{next(_GROUP_IDS)}"
        world = 1 + self.server_ranks
        where = f"{FLAG}: the weight-update group {name} ({backend}, tcp://{self.host}:{port}) with {client.url}"
        reply = in_thread(lambda: client.init_weights_update_group(
            self.host, port, 1, world, name, backend, timeout_s=self.timeout_s + GRACE_S), "weight-group-init")
        mine = in_thread(lambda: init_group(backend, self.host, port, world, 0, name, self.timeout_s, listen),
                         "weight-group-rank0")
        try:
            _settle(reply, mine, self.timeout_s + GRACE_S)
        finally:
            listen.close()  # a no-op once rank 0's store took the descriptor over
        server_err = _error(reply)
        my_err = _error(mine)
        if server_err is None and my_err is None:
            self.pg, self.group_name, self.url = mine.result(), name, client.url
            self.groups_formed += 1
            return
        if mine.done() and my_err is None:
            destroy_group(mine.result())
        detail = "; ".join(f"{who}: {_line(e)}" for who, e in (("server", server_err), ("trainer", my_err))
                           if e is not None)
        if isinstance(server_err, EngineError) and not (mine.done() and my_err is not None):
            raise EngineError(f"{where} was refused: {detail}")
        raise ServerDown(f"{where} did not form within --rollout_timeout_s={self.timeout_s:g} (the server must "
                         f"reach --rollout_weight_group_host={self.host}): {detail}")

    # --- one update ----------------------------------------------------------------------------
    def _update(self, client: SGLangClient, version: int, tensors: dict[str, torch.Tensor]) -> None:
        assert self.pg is not None
        where = f"{FLAG}: weight version {version} to {client.url} over group {self.group_name}"
        reply = in_thread(lambda: client.update_weights_from_distributed(
            list(tensors), [dtype_name(t.dtype) for t in tensors.values()], [list(t.shape) for t in tensors.values()],
            version, self.group_name, timeout_s=self.timeout_s + GRACE_S), "weight-update")
        try:
            broadcast(self.pg, list(tensors.values()))
        except Exception as e:  # gloo/nccl: the server went away, or the broadcast timed out
            try:
                server_err = reply.exception(timeout=2.0)
            except TimeoutError:
                server_err = None
            also = f"; server: {_line(server_err)}" if server_err is not None else ""
            if isinstance(server_err, EngineError):
                raise EngineError(f"{where} was refused: {_line(server_err)}") from None
            raise ServerDown(f"{where}: the broadcast failed ({_line(e)}){also}") from None
        try:
            reply.result(timeout=self.timeout_s + GRACE_S)
        except TimeoutError:
            raise ServerDown(f"{where}: the server did not confirm within {self.timeout_s + GRACE_S:g} s") from None
        except ServerDown as e:
            raise ServerDown(f"{where}: {e}") from None
        except EngineError as e:
            raise EngineError(f"{where} was refused: {e}") from None

    # --- teardown -------------------------------------------------------------------------------
    def reset(self, client: SGLangClient | None = None) -> None:
        """Forget the group on both sides (best effort): the next sync forms a new one."""
        if self.pg is not None and client is not None and client.url == self.url:
            client.destroy_weights_update_group(self.group_name)
        destroy_group(self.pg)
        self.pg, self.group_name = None, ""


def _settle(reply: Future, mine: Future, limit_s: float) -> None:
    """Wait until both are done, or the server failed (no point waiting for our side), or our side
    failed and the server had a few seconds to say why, or limit_s passed."""
    start = time.monotonic()
    mine_failed_at = None
    while time.monotonic() - start < limit_s:
        if reply.done() and (mine.done() or reply.exception() is not None):
            return
        if mine.done() and mine.exception() is not None:
            mine_failed_at = mine_failed_at or time.monotonic()
            if time.monotonic() - mine_failed_at > 5.0:
                return
        time.sleep(0.01)


def _error(fut: Future) -> BaseException | None:
    if not fut.done():
        return TimeoutError("no answer")
    return fut.exception()


def _line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text[:400]}"
