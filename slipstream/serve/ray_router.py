"""Ray Serve request router for the engine replicas: prefix affinity, power-of-two-choices fallback.

Plugged in through Ray Serve's custom request-router interface (`RequestRouterConfig(
request_router_class=PrefixAwareRouter, request_router_kwargs={"page_size": ...})`, Ray >= 2.47;
checked against 2.60). Each DeploymentHandle to the engine deployment (the HTTP ingress holds
one) runs its own instance; the policy itself is `slipstream.serve.prefix_router`.

The first positional argument of every routed call is the prompt's token ids (the ingress
tokenizes) and the second its SamplingParams, so the router hashes exactly the blocks the replica
will cache, salted by the request's cache_salt as the replica's cache salts them.
"""
from __future__ import annotations

from typing import List, Optional

import structlog
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from slipstream.serve.prefix_router import PrefixTable, choose, request_hashes

log = structlog.get_logger(__name__)


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, page_size: int = 16, imbalance_threshold: int = 8,
                         table_capacity: int = 1 << 18, **_ignored) -> None:
        self.page_size = int(page_size)
        self.imbalance_threshold = int(imbalance_threshold)
        self.table = PrefixTable(table_capacity)
        self._hashes: dict[str, list[bytes]] = {}  # internal request id → its chain, until routed
        self.decisions: dict[str, int] = {"prefix": 0, "balance": 0, "no_match": 0}

    def _chain(self, pending: Optional[PendingRequest]) -> list[bytes]:
        if pending is None or not pending.args or not isinstance(pending.args[0], list):
            return []
        rid = pending.metadata.internal_request_id
        if rid not in self._hashes:
            if len(self._hashes) > 65536:  # requests cancelled before routing never reach on_request_routed
                self._hashes.clear()
            params = pending.args[1] if len(pending.args) > 1 else None
            self._hashes[rid] = request_hashes(pending.args[0], self.page_size, params)
        return self._hashes[rid]

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        cache = self.replica_queue_len_cache
        got = choose(self._chain(pending_request), candidate_replicas, lambda r: cache.get(r.replica_id),
                     self.table, key=lambda r: r.replica_id, imbalance_threshold=self.imbalance_threshold)
        self.decisions[got.reason] += 1
        return got.ranks

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        chain = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        if chain:
            self.table.record(chain, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        dropped = self.table.forget(replica_id)
        log.warning("replica_prefixes_forgotten", replica=replica_id.unique_id,
                    prefixes=dropped)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for rid in self.table.owners() - live:  # replaced or scaled down
            self.table.forget(rid)
