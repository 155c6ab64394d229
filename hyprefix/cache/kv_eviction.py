"""Which free KV block a full ``BlockPool`` reuses (``--kv-cache-eviction-policy``; no torch).

``lru``: the least recently freed (a hit takes a block off the free list; its release puts it
back as the most recent), the pool's O(1) pop; nothing below is built.

``cost-aware``: the Marconi-style utility of ``checkpoint_policy.py`` applied to KV blocks.
- Chains stay whole. A prefix hit walks a request's block hashes from the first and stops at the
  first miss, so evicting a cached block whose child is still indexed strands the child: its
  hash can never hit until the parent is computed again. So a cached free block is a candidate
  only while it is a leaf (no indexed child); the pool learns each indexed block's parent when
  it is published (``KVCacheManager.publish`` indexes block i of a table after block i - 1).
- Free blocks that carry no hash hold nothing anyone can find: they go first, in LRU order. A
  stranded leaf (chain index > 0 but no indexed parent) holds nothing a hit can reach: next.
- Among the ``window`` least recently freed leaves (the pool keeps its free leaves in a list of
  their own), the one of least utility = recency + ``alpha`` * recompute FLOPs, both min-max
  normalised over the candidates (``checkpoint_policy.utilities``). A block at chain index i
  holds tokens [iB, (i+1)B), which a miss recomputes at ``RecomputeCost.flops_saved((i+1)B) -
  flops_saved(iB)`` = linear * B + attention * B * (iB + B/2). Every block has the same bytes,
  so FLOPs per block orders as FLOPs per byte. That cost is affine in i, so after normalisation
  it is the chain index: the model's sizes only decide whether it grows at all (no attention:
  every block costs the same, and the least recently freed leaf goes).
- With no free leaf at all (every free cached block extends into a held or retained one), the
  least recently freed block goes, as under LRU. The window bounds one eviction's work to
  O(``window``) whatever the pool's size.

Retained blocks (``BlockPool.mark_retained``) are not candidates: they go last, in LRU order,
under either policy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import islice

from hyprefix.cache.checkpoint_policy import COST_AWARE_ALPHA, RecomputeCost, utilities

POLICIES = ("lru", "cost-aware")  # --kv-cache-eviction-policy (config.KV_EVICTION_POLICIES)

# Least recently freed leaves a cost-aware eviction weighs: bounds its cost per allocated block
# (measured: docs/benchmarks.md 2026-12-07).
DEFAULT_WINDOW = 64


@dataclass(frozen=True)
class KVEvictionPolicy:
    """How a full KV pool chooses the free block it reuses. ``block_size`` turns a chain index
    into the tokens a block holds; ``alpha`` is the checkpoints' (``COST_AWARE_ALPHA``)."""

    name: str = "lru"  # one of ``POLICIES``
    cost: RecomputeCost = field(default_factory=RecomputeCost)
    block_size: int = 16
    alpha: float = COST_AWARE_ALPHA
    window: int = DEFAULT_WINDOW

    def __post_init__(self) -> None:
        if self.name not in POLICIES:
            raise ValueError(f"KV eviction policy must be one of {POLICIES}, got {self.name!r}")
        if not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha!r}")
        if self.block_size < 1 or self.window < 1:
            raise ValueError(f"block_size and window must be >= 1, got {self.block_size}, {self.window}")

    @property
    def cost_aware(self) -> bool:
        return self.name == "cost-aware"

    def block_flops(self, chain_index: int) -> float:
        """Prefill FLOPs of recomputing the block at ``chain_index`` when every block before it hits."""
        start = chain_index * self.block_size
        return self.cost.flops_saved(start + self.block_size) - self.cost.flops_saved(start)


class ChainBook:
    """A cost-aware pool's bookkeeping: each indexed block's parent and indexed children, its
    chain index, when it last joined the free list, the free blocks without a hash and the free
    leaves (cached, no indexed child), each in the order eviction looks at them.

    The pool calls ``published`` / ``adopt`` / ``dropped`` as hashes come and go, ``freed`` /
    ``taken`` as blocks join and leave its unretained free list (``free``, which this reads and
    never writes) other than through ``victim``, and ``reset`` when it drops every free block's
    hash. Children are sets, not counts: a parent that goes first (LRU fallback, a reset, a block
    no request of the chain holds) strands them, and they must forget it before its id names
    another block.

    The window is the least recently freed *leaves*, not free blocks: a pool whose oldest free
    blocks are long conversations' (mostly inner blocks) would otherwise show a window with only
    their tails in it, and eat them as LRU does (measured: docs/benchmarks.md 2026-12-07). A
    parent left without children by an eviction goes to the front, so the chain it ends stays
    in view.
    """

    def __init__(self, policy: KVEvictionPolicy, num_blocks: int, free: OrderedDict[int, None]) -> None:
        self.policy = policy
        self._free = free  # the pool's unretained free list
        self._cost_grows = policy.block_flops(1) > policy.block_flops(0)  # block_flops is affine in the index
        self._parent: dict[int, int] = {}  # indexed block -> its indexed parent (none: first or stranded)
        self._children: dict[int, set[int]] = {}  # indexed block -> its indexed children (never empty)
        self._chain_index = [0] * num_blocks  # of each indexed block
        self._freed_at = [0] * num_blocks  # logical clock when each free block joined the free list
        self._clock = 0
        self._plain: OrderedDict[int, None] = OrderedDict.fromkeys(free)  # free, unretained, no hash
        self._leaves: OrderedDict[int, None] = OrderedDict()  # free, unretained, cached, no indexed child

    # ------------------------------------------------------------------ hashes
    def published(self, block_id: int, parent: int | None, chain_index: int) -> None:
        """``block_id`` (held) is now indexed as block ``chain_index`` of a chain under ``parent``
        (the block indexed under the previous hash; None: the first block, or that hash is gone)."""
        self._chain_index[block_id] = chain_index
        if parent is not None:
            self._link(block_id, parent)

    def adopt(self, block_id: int, parent: int | None) -> None:
        """A request computed again the hash ``block_id`` is indexed under, below ``parent``: a
        stranded ``block_id`` is reachable again."""
        if parent is not None and block_id not in self._parent:
            self._link(block_id, parent)

    def _link(self, block_id: int, parent: int) -> None:
        self._parent[block_id] = parent
        self._children.setdefault(parent, set()).add(block_id)
        self._leaves.pop(parent, None)

    def dropped(self, block_id: int) -> None:
        """``block_id`` lost its hash: a free parent left childless becomes the first leaf, free
        children (stranded) go before it."""
        self._leaves.pop(block_id, None)
        parent = self._parent.pop(block_id, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(block_id)
            if not siblings:
                del self._children[parent]
                if parent in self._free:
                    self._leaves[parent] = None
                    self._leaves.move_to_end(parent, last=False)
        for child in self._children.pop(block_id, ()):
            del self._parent[child]
            if child in self._leaves:
                self._leaves.move_to_end(child, last=False)

    def num_children(self, block_id: int) -> int:
        return len(self._children.get(block_id, ()))

    # ------------------------------------------------------------- free list
    def freed(self, block_id: int, cached: bool) -> None:
        """``block_id`` joined the unretained free list (released, or its retention ended)."""
        self._clock += 1
        self._freed_at[block_id] = self._clock
        if not cached:
            self._plain[block_id] = None
        elif block_id not in self._children:
            self._leaves[block_id] = None

    def taken(self, block_id: int) -> None:
        """``block_id`` left the unretained free list (a hit, or a retention) other than by ``victim``."""
        self._plain.pop(block_id, None)
        self._leaves.pop(block_id, None)

    def reset(self) -> None:
        """Every block of the free list lost its hash."""
        self._plain = OrderedDict.fromkeys(self._free)
        self._leaves.clear()

    def victim(self) -> int:
        """The free block to reuse next (the pool takes it off its free list). O(``window``): a
        block without a hash, else a stranded leaf, else the leaf of least utility among the
        ``window`` first leaves (a tie goes to the first), else the least recently freed block."""
        if self._plain:
            return self._plain.popitem(last=False)[0]
        if not self._leaves:
            return next(iter(self._free))
        candidates: list[int] = []
        for block_id in islice(self._leaves, self.policy.window):
            if block_id not in self._parent and self._chain_index[block_id]:
                candidates = [block_id]  # stranded: no prefix hit reaches it
                break
            candidates.append(block_id)
        chosen = candidates[0]
        if len(candidates) > 1 and self._cost_grows:  # else equal FLOPs: recency alone, the least recent
            # Min-max normalisation of an increasing affine function is that of its argument: the
            # chain indices score exactly as ``block_flops`` of them would, without a call per block.
            scores = utilities([self._freed_at[b] for b in candidates], [self._chain_index[b] for b in candidates],
                               self.policy.alpha)
            chosen = candidates[min(range(len(scores)), key=scores.__getitem__)]
        del self._leaves[chosen]
        return chosen

    # ------------------------------------------------------------ invariants
    def check(self, hashes: list[bytes | None]) -> None:
        """``hashes``: each block's hash (None: not indexed)."""
        for block_id, parent in self._parent.items():
            assert hashes[block_id] is not None, f"block {block_id} has a parent but no hash"
            assert hashes[parent] is not None, f"block {block_id}'s parent {parent} is not indexed"
            assert block_id in self._children.get(parent, ()), f"block {block_id} missing from its parent's children"
            assert self._chain_index[block_id] == self._chain_index[parent] + 1, (
                f"block {block_id} at chain index {self._chain_index[block_id]} under {parent} at "
                f"{self._chain_index[parent]}")
        for parent, children in self._children.items():
            assert children, f"block {parent}: an empty set of children kept"
            assert hashes[parent] is not None, f"block {parent} has children but no hash"
            for child in children:
                assert self._parent.get(child) == parent, f"block {child} listed under {parent}, not its parent"
        plain = [b for b in self._free if hashes[b] is None]
        assert list(self._plain) == plain, f"unhashed free blocks {list(self._plain)}, expected {plain}"
        leaves = {b for b in self._free if hashes[b] is not None and b not in self._children}
        assert self._leaves.keys() == leaves, f"free leaves {sorted(self._leaves)}, expected {sorted(leaves)}"
