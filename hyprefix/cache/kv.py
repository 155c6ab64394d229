"""Per-request block tables over a shared ``BlockPool``, with content-hashed
prefix sharing.

Rules this module keeps (see docs/architecture.md):
- Only full blocks are hashed; hashes chain from a root that names the model and
  the request's ``cache_salt``.
- On admission a request takes the longest run of cached blocks matching its
  tokens; a *full* hit keeps the last token to compute (its logits are needed)
  and that token's K/V is already in a shared block, so it is not rewritten.
- A block is published (findable) only after the step that wrote its last
  token has finished (``publish``).
- Blocks that a running request will write next and whose hash is already
  known (full prompt blocks) are *pending*: a request that needs one of them
  next waits instead of computing it again. Pending entries die with the
  request that owns them (finish, abort, preemption).
- Blocks are released tail first, so chain tails are evicted before heads.
- Block i of a table is published after block i - 1, so a pool that keeps chains whole
  (``--kv-cache-eviction-policy cost-aware``, ``kv_eviction.py``) learns each block's parent.
"""

from __future__ import annotations

from hyprefix.cache.block_pool import BlockPool, ImportHold
from hyprefix.cache.events import BlockStored, EventLog
from hyprefix.cache.hashing import extend_hashes, root_hash
from hyprefix.cache.kv_eviction import KVEvictionPolicy
from hyprefix.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 model_identity: str = "", events: EventLog | None = None,
                 eviction: KVEvictionPolicy | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.model_identity = model_identity
        self.pool = BlockPool(num_blocks, events, eviction)  # eviction None: LRU
        self.events = self.pool.events
        self._tables: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}
        self._pending: dict[bytes, str] = {}  # block hash -> id of the request computing it
        self._pending_by_request: dict[str, list[bytes]] = {}
        self._roots: dict[str | None, bytes] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def holds(self, request_id: str) -> bool:
        return request_id in self._tables

    # ---------------------------------------------------------------- hashing
    def set_model_identity(self, identity: str) -> None:
        """New weights (a weight update): hashes chain from a new root from now on, so no
        block computed before can match a request hashed after (old blocks age out of the
        LRU; nothing is flushed). A request that holds hashes keeps its chain."""
        self.model_identity = identity
        self._roots.clear()

    def update_hashes(self, request: Request) -> list[bytes]:
        """The request's full-block hashes, extended to cover all its known tokens."""
        if self.enable_caching and len(request.block_hashes) < request.num_tokens // self.block_size:
            root = self._roots.get(request.cache_salt)
            if root is None:
                root = self._roots[request.cache_salt] = root_hash(self.model_identity, request.cache_salt)
            extend_hashes(request.block_hashes, root, request.all_token_ids, self.block_size)
        return request.block_hashes

    # -------------------------------------------------------------- admission
    def match_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached run of the request's full blocks."""
        if not self.enable_caching:
            return []
        hits = []
        for h in self.update_hashes(request):
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def pending_owner(self, request: Request, block_index: int) -> str | None:
        """Id of another running request that is computing the request's block
        ``block_index`` right now, if any."""
        hashes = request.block_hashes
        if not self.enable_caching or block_index >= len(hashes):
            return None
        owner = self._pending.get(hashes[block_index])
        return owner if owner != request.request_id else None

    def shared_path(self, request: Request) -> tuple[int, str | None]:
        """How many of the request's leading blocks are cached or being computed
        by someone, and the id of the request computing the last of them (None
        when it is already cached)."""
        count, owner = 0, None
        for h in self.update_hashes(request):
            if self.pool.lookup(h) is not None:
                owner = None
            elif h in self._pending:
                owner = self._pending[h]
            else:
                break
            count += 1
        return count, owner

    def can_admit(self, hit_blocks: list[int], num_tokens: int) -> bool:
        need = self.blocks_for(num_tokens) - len(hit_blocks)
        free_hits = sum(1 for b in hit_blocks if self.pool.is_free(b))
        return need <= self.pool.num_free - free_hits

    def admit(self, request: Request, hit_blocks: list[int], num_tokens: int) -> bool:
        """Give a waiting request the cached ``hit_blocks`` plus new blocks up to
        ``num_tokens`` tokens. All or nothing: on failure no ref count changes."""
        if not self.can_admit(hit_blocks, num_tokens):
            return False
        need = self.blocks_for(num_tokens) - len(hit_blocks)
        self.pool.acquire(hit_blocks)
        new = self.pool.allocate(need)
        assert new is not None
        rid = request.request_id
        self._tables[rid] = hit_blocks + new
        self._num_published[rid] = len(hit_blocks)
        if self.enable_caching:
            self._register_pending(request, len(hit_blocks))
        return True

    def _register_pending(self, request: Request, start_block: int) -> None:
        owned = self._pending_by_request.setdefault(request.request_id, [])
        for h in request.block_hashes[start_block: request.num_prompt_tokens // self.block_size]:
            if h not in self._pending and self.pool.lookup(h) is None:
                self._pending[h] = request.request_id
                owned.append(h)

    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(request_id)))

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow a running request's table to hold ``num_tokens`` tokens. On failure nothing changes."""
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need == 0:
            self._tables.setdefault(request_id, [])
            return True
        new = self.pool.allocate(need)
        if new is None:
            return False
        self._tables.setdefault(request_id, []).extend(new)
        self._num_published.setdefault(request_id, 0)
        return True

    # ------------------------------------------------------------ publication
    def publish(self, request: Request) -> int:
        """Make every block whose tokens are all computed findable; returns how many
        blocks were newly indexed. Call after the step that computed them."""
        if not self.enable_caching:
            return 0
        rid = request.request_id
        table = self._tables.get(rid)
        if not table:
            return 0
        done = self._num_published.get(rid, 0)
        full = min(request.num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return 0
        hashes = self.update_hashes(request)
        added: list[int] = []
        for i in range(done, full):
            if self.pool.publish(table[i], hashes[i], self._parent(hashes, i), i):
                added.append(i)
            if self._pending.get(hashes[i]) == rid:
                del self._pending[hashes[i]]
        self._num_published[rid] = full
        if self.events.enabled:
            self._announce(request, added)
        return len(added)

    # ----------------------------------------------------------------- imports
    def reserve_import(self, request: Request, first_block: int, count: int) -> ImportHold | None:
        """Fresh blocks to hold ``count`` of the request's blocks from ``first_block`` on, read
        from a lower tier, with the request's cached blocks before them, all held until
        ``publish_import`` or the pool's ``end_import`` (``BlockPool.reserve_import``); None
        when the pool has no room."""
        held = [b for h in request.block_hashes[:first_block] if (b := self.pool.lookup(h)) is not None]
        return self.pool.reserve_import(held, count)

    def publish_import(self, request: Request, first_block: int, hold: ImportHold) -> int:
        """Publish the blocks of ``hold``, filled by ``reserve_import``'s caller, as the request's
        blocks ``first_block, first_block + 1, ...`` and let them and the prefix go (tail first):
        cached, findable, held by nobody. Returns how many were indexed (a hash another block got
        meanwhile leaves its copy private, and it returns to the free list unindexed)."""
        hashes = request.block_hashes
        added = [i for i, b in enumerate(hold.blocks, first_block)
                 if self.pool.publish(b, hashes[i], self._parent(hashes, i), i)]
        if self.events.enabled and added:
            self._announce(request, added)
        self.pool.end_import(hold)
        return len(added)

    def _parent(self, hashes: list[bytes], index: int) -> int | None:
        """The parent of a request's block ``index``: whichever block the previous hash is indexed
        under now (published before it, by this request or another; None for the first block, when
        that hash has gone since, or when the pool does not track chains, an LRU pool)."""
        return self.pool.lookup(hashes[index - 1]) if index and self.pool.tracks_chains else None

    def _announce(self, request: Request, indices: list[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly indexed blocks."""
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        bs, tokens = self.block_size, request.all_token_ids
        for run in runs:
            self.events.add(BlockStored(
                block_hashes=[request.block_hashes[i] for i in run],
                parent_block_hash=request.block_hashes[run[0] - 1] if run[0] else None,
                token_ids=list(tokens[run[0] * bs:(run[-1] + 1) * bs]), block_size=bs))

    # ---------------------------------------------------------------- release
    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first; hashes stay findable) and
        drop the pending entries it owned."""
        for h in self._pending_by_request.pop(request_id, ()):
            if self._pending.get(h) == request_id:
                del self._pending[h]
        self._num_published.pop(request_id, None)
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(list(reversed(table)))

    def reset_cache(self) -> int:
        return self.pool.reset_cache()

    def check_invariants(self, running_ids: set[str] | None = None) -> None:
        refs: dict[int, int] = {}
        for table in self._tables.values():
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_invariants(refs)
        for h, owner in self._pending.items():
            assert owner in self._tables, f"pending block owned by {owner}, which holds no blocks"
            assert running_ids is None or owner in running_ids, f"pending owner {owner} is not running"
            assert h in self._pending_by_request.get(owner, ()), "pending index out of sync"
        for rid, n in self._num_published.items():
            assert n <= len(self._tables.get(rid, ())), f"{rid}: published more blocks than it holds"
