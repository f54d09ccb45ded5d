"""The router's workers: where a sequence goes (`jaxserve.placement`, the data-parallel engine's
placement), their health, and what every worker must be sent when it (re)joins (the LoRA adapters
loaded through the router, the session pin budget)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc

from jaxserve.engine_client import EngineDeadError, UnknownAdapterError
from jaxserve.placement import Placement, PlacementPolicy
from server.cluster.router.worker_calls import CALL_TIMEOUT
from server.cluster.router.worker_client import WorkerClient, WorkerInfo
from server.cluster.worker import worker_pb2 as pb

logger = logging.getLogger(__name__)


class WorkerPool:
    """Generating (colocated or decode) workers and prefill workers, and their placement."""

    def __init__(
        self, workers: Sequence[WorkerClient], policy: PlacementPolicy, prefill_workers: Sequence[WorkerClient] = ()
    ) -> None:
        self.placement: Placement[WorkerClient] = Placement(workers, policy)
        self.workers = self.placement.targets  # they generate to the end
        self.prefill_workers = list(prefill_workers)
        self.policy = policy
        self.reference: WorkerInfo | None = None  # what every worker must serve: the first one's
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded through the router: name -> directory
        self.pin_budget: int | None = None
        self._background: set[asyncio.Task] = set()
        self._kv_events: dict[WorkerClient, asyncio.Task] = {}  # each generating worker's event stream

    @property
    def everyone(self) -> list[WorkerClient]:
        return self.workers + self.prefill_workers

    # ----- placement -------------------------------------------------------------------------

    def candidates(
        self, among: Sequence[WorkerClient], exclude: Sequence[WorkerClient] = (), lora: str | None = None
    ) -> list[WorkerClient]:
        """The workers of `among` that are up, not excluded and, for an adapter loaded through the
        router, have it loaded (a worker that joined gets the run-time loads first);
        EngineDeadError when none is."""
        up = [w for w in among if w.up and w not in exclude]
        if lora in self.adapters:
            up = [w for w in up if lora in w.loaded_adapters]
        if not up:
            details = "; ".join(f"{w.address}: {w.detail or 'failed'}" for w in among)
            raise EngineDeadError(f"no worker is available ({details})")
        return up

    def place(self, ids: list[int], session_id: str | None, lora: str | None = None) -> WorkerClient:
        """The generating worker for a prompt: its session's while that worker serves, else by the
        policy (the session sticks to it)."""
        return self.placement.place(ids, session_id, lora, self.candidates(self.workers, (), lora))

    def pick(
        self,
        ids: list[int],
        exclude: Sequence[WorkerClient] = (),
        among: Sequence[WorkerClient] | None = None,
        lora: str | None = None,
    ) -> WorkerClient:
        """By the policy alone, among `among` (the generating workers by default)."""
        among = self.workers if among is None else among
        return self.placement.choose(ids, None, lora, self.candidates(among, exclude, lora))

    # ----- health ----------------------------------------------------------------------------

    async def check(self) -> None:
        """One health check of every worker; a worker that (re)joined is set up afresh."""
        restarted = await asyncio.gather(*(w.refresh(self.reference) for w in self.everyone))
        for worker, fresh in zip(self.everyone, restarted):
            if not fresh:
                continue
            if self.reference is None:
                self.reference = worker.info
            if worker in self.prefill_workers:
                continue
            self.placement.forget_target(worker)  # its sessions' KV is gone with the old process
            if self.pin_budget is not None:
                await self.send_pin_budget(worker)
        await asyncio.gather(
            *(self._send_adapters(w) for w in self.workers if w.up and not w.loaded_adapters.issuperset(self.adapters))
        )
        for worker, fresh in zip(self.everyone, restarted):
            if worker in self.workers and worker.up and self.policy.kv_events:
                self._follow_kv_events(worker, fresh)

    def _follow_kv_events(self, worker: WorkerClient, restarted: bool) -> None:
        """Follow a worker's KV events (again, once it restarted or its stream ended)."""
        task = self._kv_events.get(worker)
        if restarted and task is not None:
            task.cancel()  # the old process's stream
            worker.kv_events_refused = False
        elif worker.kv_events_refused or (task is not None and not task.done()):
            return
        self._kv_events[worker] = asyncio.get_running_loop().create_task(worker.follow_kv_events())

    async def health_loop(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 - keep checking
                logger.exception("worker health check failed")

    async def _send_adapters(self, worker: WorkerClient) -> None:
        """The adapters loaded through the router that a worker lacks (it joined, restarted or was
        down at the load): until one is loaded there, requests for it go to other workers."""
        for name, path in list(self.adapters.items()):
            if name in worker.loaded_adapters:
                continue
            try:
                reply = await worker.stub.LoadLoraAdapter(
                    pb.LoraAdapterRequest(name=name, path=path), timeout=CALL_TIMEOUT
                )
            except grpc.aio.AioRpcError as e:
                logger.warning(
                    "loading LoRA adapter %s on worker %s failed: %s: %s",
                    name,
                    worker.address,
                    e.code().name,
                    e.details(),
                )
                continue
            worker.note_adapters(reply)
            if self.adapters.get(name) == path:  # not unloaded meanwhile
                worker.loaded_adapters.add(name)

    async def send_pin_budget(self, worker: WorkerClient) -> None:
        request = pb.SetPinBudgetRequest(blocks_per_owner=self.pin_budget)
        await self.quietly(worker, worker.stub.SetPinBudget(request, timeout=CALL_TIMEOUT))

    # ----- calls on workers ------------------------------------------------------------------

    async def on_every_worker(
        self, call: Callable[[WorkerClient], Awaitable[pb.LoraAdaptersResponse]]
    ) -> list[WorkerClient]:
        """A LoRA call on every generating worker that serves (returned): ValueError (a bad
        adapter) or UnknownAdapterError (an unknown name) as the first worker that refuses says."""
        up = [w for w in self.workers if w.up]
        if not up:
            raise EngineDeadError("no worker serves")
        results = await asyncio.gather(*(call(w) for w in up), return_exceptions=True)
        for worker, result in zip(up, results):
            if isinstance(result, grpc.aio.AioRpcError):
                if result.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    raise ValueError(result.details())
                if result.code() == grpc.StatusCode.NOT_FOUND:
                    raise UnknownAdapterError(result.details())
                raise EngineDeadError(f"worker {worker.address}: {result.code().name}: {result.details()}")
            if isinstance(result, BaseException):
                raise result
        for worker, reply in zip(up, results):
            worker.note_adapters(reply)
        return up

    @staticmethod
    async def quietly(worker: WorkerClient, call: grpc.aio.UnaryUnaryCall) -> None:
        """Await a bookkeeping call; a worker that fails it is found by the health check."""
        try:
            await call
        except grpc.aio.AioRpcError as e:
            logger.warning("call to worker %s failed: %s", worker.address, e.code().name)

    def spawn(self, call: grpc.aio.UnaryUnaryCall) -> None:
        """Send a call in the background (an abort, a lease release): its failure is the worker's."""

        async def run() -> None:
            try:
                await call
            except grpc.aio.AioRpcError:
                pass  # the request is gone with its worker

        task = asyncio.get_running_loop().create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        tasks = [*self._background, *self._kv_events.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in self.everyone:
            await worker.close()
