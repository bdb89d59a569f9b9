"""The processes of a tensor-parallel target: rank 0 (the engine's process) and its workers.

Rank 0 runs the engine. `start_tensor_parallel` starts ranks 1 … N−1 as worker processes (one
per device; a fresh interpreter each, `python -c`, so nothing of rank 0's threads, CUDA state or
`__main__` is inherited or re-run), joins them in one torch.distributed process group (gloo on CPU, NCCL on CUDA) for
the all-reduces inside the forward, and returns a `TensorParallelTarget`: the target as the
engine sees it (core.forward.TargetModel). Each forward it sends every worker a `StepMessage`
(the ForwardBatch, and the KV-pool bookkeeping since the last one), then runs its own shard's
forward; the workers run theirs on the same inputs, and the per-layer all-reduces meet.

Why the step message travels over a socket pair per worker and not a torch.distributed broadcast: a
worker waits for its next step as long as the server is idle, unboundedly, while a collective
waits at most its timeout and leaves the group broken after it. The socket waits forever and ends
with EOF when the other end's process exits; the collectives (the compute) keep a short timeout. vLLM likewise
sends its workers their step over a message queue, not a collective.

KV-pool bookkeeping (allocate, release, truncate, compact_path) changes rank 0's pool as it is
called and is queued; the next StepMessage carries the queue and each worker applies it, in
order, to its own pool before its forward: at every forward all ranks' pools agree (each with
its own KV heads). compact_path moves KV entries, so a worker must apply it; the others keep the
workers' lengths and free slots equal to rank 0's (nothing on a worker reads them today).

Supervision. A worker that dies (or is killed) makes the next forward fail at once with
TensorParallelError naming the rank, its pid and exit code: before a step rank 0 checks that
every worker lives; a worker that dies during a step closes its gloo connections, and the
all-reduce it leaves fails at once ("connection closed by peer"); one that hangs fails the
all-reduce after `timeout_s`. After a failure the target refuses every forward (the group cannot
be repaired): the engine fails its in-flight requests with the error, and a reload builds a new
target with new workers. A worker whose rank 0 is gone ends on its pipe's EOF.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import weakref
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Union

import torch

from specserve.core.forward import CacheIO, ForwardBatch, ForwardOutput
from specserve.core.kv_cache import KVCache
from specserve.model.tensor_parallel import Shard, TensorParallelError
from specserve.model.transformer import Transformer, causal_batch, load_model

log = logging.getLogger("specserve.tensor_parallel")

COLLECTIVE_TIMEOUT_S = 120.0   # an all-reduce waiting this long for a rank: that rank hangs
START_TIMEOUT_S = 600.0        # a worker joining the group and loading its shard (a 70B shard from disk)
STOP_TIMEOUT_S = 10.0          # a worker told to stop that has not exited by then is killed
DEATH_WAIT_S = 5.0             # after a failed collective: how long to wait to see which worker died


# -- what rank 0 tells its workers ------------------------------------------------------------------

@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard (pickled into the spawned process)."""
    checkpoint: str
    dtype: str          # torch dtype name, "float32"
    device: str         # this rank's device: "cpu", "cuda:1"
    rank: int
    world: int
    store: str          # the FileStore file the ranks meet at
    num_threads: int    # torch intra-op threads (rank 0's own count)
    timeout_s: float


@dataclass(frozen=True)
class Allocate:
    slot: int           # the slot rank 0's allocate returned (the worker's must agree)


@dataclass(frozen=True)
class Release:
    slot: int


@dataclass(frozen=True)
class Truncate:
    slot: int
    length: int


@dataclass(frozen=True)
class CompactPath:
    slot: int
    base: int
    path: tuple[int, ...]


CacheOp = Union[Allocate, Release, Truncate, CompactPath]


@dataclass(frozen=True)
class NewPool:
    """Build this rank's KV pool (its KV heads only); replaces the previous one."""
    num_slots: int
    max_len: int


@dataclass(frozen=True)
class StepMessage:
    """One forward, as every worker runs it."""
    cache_ops: tuple[CacheOp, ...]   # applied in order to the worker's pool before the forward
    batch: ForwardBatch              # host tensors (tokens, positions, slots, starts, mask)
    use_pool: bool                   # forward with the KV pool (False: cache-free, like `score`)


@dataclass(frozen=True)
class Stop:
    pass


Message = Union[NewPool, StepMessage, Stop]


def _host(t: torch.Tensor) -> torch.Tensor:
    """t on the host, holding only its own elements (pickle writes a tensor's whole storage, and
    a step's tensors may be views of larger buffers)."""
    t = t.cpu()
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def _batch_to(batch: ForwardBatch, device: torch.device | str) -> ForwardBatch:
    return ForwardBatch(*(t.to(device) for t in (batch.tokens, batch.positions, batch.slots, batch.starts, batch.mask)))


def _process_group(store_path: str, rank: int, world: int, device: torch.device, timeout_s: float):
    """The ranks' process group, not the process-global default one: one engine process may build
    several targets (a reload, tests), each with its own group and workers."""
    import torch.distributed as dist

    store = dist.FileStore(store_path, world)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world, opts)
    return dist.ProcessGroupGloo(store, rank, world, timeout)


# -- the KV pool's bookkeeping: queued on rank 0, replayed on each worker ----------------------------

class _Pool(KVCache):
    """A KV pool that queues its bookkeeping for the workers (rank 0's pool)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.ops: list[CacheOp] = []

    def take_ops(self) -> tuple[CacheOp, ...]:
        ops, self.ops = tuple(self.ops), []
        return ops

    def allocate(self) -> int:
        slot = super().allocate()
        self.ops.append(Allocate(slot))
        return slot

    def release(self, slot: int) -> None:
        super().release(slot)
        self.ops.append(Release(slot))

    def truncate(self, slot: int, length: int) -> None:
        super().truncate(slot, length)
        self.ops.append(Truncate(slot, length))

    def compact_path(self, slot: int, base: int, path: list[int]) -> None:
        super().compact_path(slot, base, path)
        self.ops.append(CompactPath(slot, base, tuple(path)))


def apply_cache_op(pool: KVCache, op: CacheOp) -> None:
    """Replay one of rank 0's pool calls on a worker's pool."""
    if isinstance(op, Allocate):
        slot = pool.allocate()
        if slot != op.slot:
            raise RuntimeError(f"KV pools disagree: rank 0 allocated slot {op.slot}, this rank {slot}")
    elif isinstance(op, Release):
        pool.release(op.slot)
    elif isinstance(op, Truncate):
        pool.truncate(op.slot, op.length)
    else:
        pool.compact_path(op.slot, op.base, list(op.path))


# -- a worker ---------------------------------------------------------------------------------------

def worker_main(fd: int) -> None:
    """A worker process (`fd`: its end of the socket pair): take its WorkerSpec, join the group,
    load the shard, say it is ready, then run every forward rank 0 sends until Stop or EOF."""
    conn = Connection(fd)
    spec: WorkerSpec = pickle.loads(conn.recv_bytes())
    torch.set_num_threads(spec.num_threads)
    device = torch.device(spec.device)
    try:
        group = _process_group(spec.store, spec.rank, spec.world, device, spec.timeout_s)
        model = load_model(spec.checkpoint, dtype=getattr(torch, spec.dtype), device=device,
                           shard=Shard(spec.rank, spec.world, group))
    except Exception as e:  # noqa: BLE001 — reported to rank 0, which raises it
        conn.send_bytes(pickle.dumps(f"{type(e).__name__}: {e}"))
        return
    conn.send_bytes(pickle.dumps(None))   # ready
    pool: KVCache | None = None
    while True:
        try:
            msg: Message = pickle.loads(conn.recv_bytes())
        except EOFError:   # rank 0 is gone
            return
        if isinstance(msg, Stop):
            return
        if isinstance(msg, NewPool):
            pool = model.new_cache(msg.num_slots, msg.max_len)
            continue
        for op in msg.cache_ops:
            apply_cache_op(pool, op)
        with torch.inference_mode():
            # A failed all-reduce raises here and ends the process: the group is broken.
            model.forward(_batch_to(msg.batch, device), pool if msg.use_pool else None)


# -- rank 0 -----------------------------------------------------------------------------------------

@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    conn: Connection    # rank 0's end of the worker's socket pair

    def death(self) -> str | None:
        """Why this worker is gone, or None while it lives."""
        code = self.process.poll()
        return None if code is None else f"tensor-parallel worker rank {self.rank} (pid {self.process.pid}) exited with code {code}"

    def wait_death(self) -> str | None:
        """death(), after a bounded wait for a worker whose socket has closed (it is exiting)."""
        try:
            self.process.wait(DEATH_WAIT_S)
        except subprocess.TimeoutExpired:
            pass
        return self.death()


def _spawn(rank: int, spec: WorkerSpec) -> _Worker:
    ours, theirs = socket.socketpair()
    code = f"from specserve.model.tp_processes import worker_main; worker_main({theirs.fileno()})"
    # stdout/stderr inherited: a worker's log and traceback land in the server's. A session of its
    # own: a Ctrl-C or SIGTERM to the server's process group is rank 0's to handle; the worker
    # ends when rank 0 stops it or exits (EOF on its socket).
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), start_new_session=True)
    theirs.close()
    conn = Connection(ours.detach())
    conn.send_bytes(pickle.dumps(spec))
    return _Worker(rank, proc, conn)


def _shutdown(workers: list[_Worker], tmpdir: str) -> None:
    for w in workers:
        if w.process.poll() is None:
            try:
                w.conn.send_bytes(pickle.dumps(Stop()))
            except OSError:
                pass
    for w in workers:
        try:
            w.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()
        w.conn.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


class TensorParallelTarget:
    """The target sharded over N ranks, as the engine and the drafters see it (rank 0's side).

    Satisfies core.forward.TargetModel; the embedding, final norm and LM head are replicated, so
    what fused drafters reuse of the target (embed_tokens, lm_head) is rank 0's, whole. One KV
    pool per target (the engine's): `new_cache` replaces the workers' pool.
    """

    def __init__(self, model: Transformer, workers: list[_Worker], tmpdir: str):
        self.model, self._workers = model, workers
        self._pool: _Pool | None = None
        self._failed: str | None = None
        self._finalizer = weakref.finalize(self, _shutdown, workers, tmpdir)

    # -- what drafters and the engine read -------------------------------------------------------
    @property
    def cfg(self):
        return self.model.cfg

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def embed_tokens(self):
        return self.model.embed_tokens

    @property
    def lm_head(self):
        return self.model.lm_head

    @property
    def norm(self):
        return self.model.norm

    @property
    def world(self) -> int:
        return self.model.shard.world

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers]

    # -- the TargetModel protocol ----------------------------------------------------------------
    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        c = self.model.cfg
        self._send(NewPool(num_slots, max_len))
        self._pool = _Pool(num_layers=c.num_layers, num_slots=num_slots, num_kv_heads=c.num_kv_heads // self.world,
                           max_len=max_len, head_dim=c.head_dim, dtype=self.dtype, device=self.device)
        return self._pool

    def forward(self, batch: ForwardBatch, cache: CacheIO | None,
                hidden_layers: tuple[int, ...] = ()) -> ForwardOutput:
        """`cache`: the pool new_cache made (KVCache, or the static step's DeviceKV over it), or None."""
        ops = self._pool.take_ops() if self._pool is not None else ()
        host = ForwardBatch(*(_host(t) for t in (batch.tokens, batch.positions, batch.slots, batch.starts, batch.mask)))
        self._send(StepMessage(ops, host, cache is not None))
        try:
            return self.model.forward(batch, cache, hidden_layers)
        except TensorParallelError as e:
            raise self._fail(str(e)) from e

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.logits(hidden)   # the replicated LM head, on rank 0 alone

    @torch.inference_mode()
    def score(self, tokens: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a cache: tokens [B, T] → logits [B, T, V]."""
        return self.logits(self.forward(causal_batch(tokens, self.cfg.sliding_window), cache=None).hidden)

    def close(self) -> None:
        """Stop the workers (idempotent; also run when the target is collected or at exit)."""
        self._finalizer()

    # -- supervision -----------------------------------------------------------------------------
    def _send(self, msg: Message) -> None:
        if self._failed is not None:
            raise TensorParallelError(self._failed)
        dead = [d for w in self._workers if (d := w.death())]
        if dead:
            raise self._fail("; ".join(dead))
        data = pickle.dumps(msg)
        for w in self._workers:
            try:
                w.conn.send_bytes(data)
            except OSError as e:   # the pipe broke: the worker is gone
                raise self._fail(w.death() or f"tensor-parallel worker rank {w.rank}: {e}") from e

    def _fail(self, why: str) -> TensorParallelError:
        """Mark the target failed for good and say why (naming dead workers where there are)."""
        if self._failed is None:
            # A broken collective: the worker that broke it is exiting (its socket closes as it
            # does); wait for that, bounded, to name it.
            closed = wait([w.conn for w in self._workers], timeout=DEATH_WAIT_S)
            dead = [d for w in self._workers if (d := w.wait_death() if w.conn in closed else w.death())]
            self._failed = self._failure("; ".join(dead) if dead else why)
            log.error("%s", self._failed)
        return TensorParallelError(self._failed)

    def _failure(self, why: str) -> str:
        return (f"{why}: the {self.world}-way tensor-parallel target cannot run without it; reload the model "
                "to start new workers")

    def health(self) -> str | None:
        """Why this target cannot run (the error its next forward would raise), or None while every
        worker lives. Reads only (a reap of a worker that exited): any thread may ask, between
        steps or during one, and the server's watcher does, so a worker that dies while the server
        idles is noticed before a request finds it."""
        if self._failed is not None:
            return self._failed
        dead = [d for w in self._workers if (d := w.death())]
        return self._failure("; ".join(dead)) if dead else None


def start_tensor_parallel(checkpoint: str | Path, world: int, *, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu", timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TensorParallelTarget:
    """Start ranks 1 … world−1, load rank 0's shard here, and return the target once every
    worker has loaded its shard. On CUDA rank r runs on device index (device's index) + r."""
    from specserve.model.tensor_parallel import check_divisible, rank_devices
    from specserve.model.transformer import load_config

    if world < 2:
        raise ValueError(f"a tensor-parallel target needs at least 2 ranks, got {world}")
    check_divisible(load_config(checkpoint), world)
    devices = rank_devices(torch.device(device), world)
    tmpdir = tempfile.mkdtemp(prefix="specserve-tp-")
    store = os.path.join(tmpdir, "store")
    workers: list[_Worker] = []
    try:
        for r in range(1, world):
            workers.append(_spawn(r, WorkerSpec(str(checkpoint), str(dtype).removeprefix("torch."), str(devices[r]),
                                                r, world, store, torch.get_num_threads(), timeout_s)))
        try:
            group = _process_group(store, 0, world, devices[0], timeout_s)
        except RuntimeError as e:   # a worker that died before it joined leaves rank 0 waiting its timeout
            dead = [d for w in workers if (d := w.death())]
            raise TensorParallelError(f"the tensor-parallel group did not form: {'; '.join(dead) or e}") from e
        model = load_model(checkpoint, dtype=dtype, device=devices[0], shard=Shard(0, world, group))
        for w in workers:
            _wait_ready(w)
    except BaseException:
        _shutdown(workers, tmpdir)
        raise
    log.info("tensor-parallel target: %d ranks on %s, worker pids %s", world,
             ", ".join(map(str, devices)), [w.process.pid for w in workers])
    return TensorParallelTarget(model, workers, tmpdir)


def _wait_ready(w: _Worker) -> None:
    """The worker's 'loaded' (or its error), watching that it lives while waiting."""
    if not wait([w.conn], timeout=START_TIMEOUT_S):
        raise TensorParallelError(f"tensor-parallel worker rank {w.rank} did not load its shard in {START_TIMEOUT_S:.0f} s")
    try:
        error = pickle.loads(w.conn.recv_bytes())
    except EOFError:
        raise TensorParallelError(f"{w.wait_death() or f'tensor-parallel worker rank {w.rank}'} before it was ready") from None
    if error is not None:
        raise TensorParallelError(f"tensor-parallel worker rank {w.rank} failed to start: {error}")
