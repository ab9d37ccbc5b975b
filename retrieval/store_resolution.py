"""Which vector store a name or id means, for whom: the tenancy rules of store lookup.

Ray-free; the Retriever deployment (``retrieval.service``) resolves every store through here.

- The API's paths name a store by id, and only the caller's own stores exist for them:
  someone else's is answered exactly as a missing one (``owned_store``).
- A model's retrieval policy (the operator's config) names stores by id, whoever owns them, or
  by name among the operator's stores only (``policy_stores``), so no tenant's store can stand
  in for the policy's.
- A chat request's ``retrieval.collections`` may name a store the policy resolved or one of the
  caller's own, and nothing else (``requested_store``).
"""

from __future__ import annotations

import logging

from retrieval.collection import Collection
from retrieval.errors import CollectionNotFoundError
from retrieval.store import CollectionStore
from retrieval.tenancy import OPERATOR, Caller, owner_of

logger = logging.getLogger(__name__)


def owned_store(stores: CollectionStore, store_id: str, caller: Caller) -> Collection:
    """One of the caller's stores, by id (the API's paths name stores by id only). Anyone
    else's store is answered exactly as a missing one."""
    owner = owner_of(caller)
    try:
        coll = stores.get_by_id(store_id, owner=owner) if isinstance(store_id, str) else None
    except CollectionNotFoundError:
        coll = None
    if coll is None:
        raise CollectionNotFoundError(f"No vector store found with id {store_id!r}.", param="vector_store_id")
    return coll


def policy_stores(stores: CollectionStore, entries: list[str]) -> dict[str, Collection]:
    """A model policy's stores, by the entry that named them: ids resolve whoever owns the
    store (the operator wrote the id), names only among the operator's stores. Entries naming
    no store are skipped with a logged warning."""
    out: dict[str, Collection] = {}
    for entry in entries:
        try:
            coll = stores.get_by_id(entry)
        except CollectionNotFoundError:
            try:
                coll = stores.get(entry, owner=OPERATOR)
            except CollectionNotFoundError:
                logger.warning("retrieval: no vector store %r, skipped", entry)
                continue
        out[entry] = coll
    return out


def requested_store(stores: CollectionStore, entry: str, owner: str, policy: dict[str, Collection]) -> Collection:
    """A store a request names: a policy store (by id or the policy's name for it) or the
    caller's own (by id or name). Anything else is not found, like a missing store."""
    for coll in policy.values():
        if coll.id == entry:
            return coll
    try:
        return stores.get(entry, owner=owner)
    except CollectionNotFoundError:
        pass
    if entry in policy:
        return policy[entry]
    raise CollectionNotFoundError(f"no vector store {entry!r}")
