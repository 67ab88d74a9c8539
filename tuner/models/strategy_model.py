"""An analytic model that ranks the context-parallel strategies of one attention problem on a platform,
so that a strategy can be picked without measuring and the pick explained.

Strategies over the P = `problem.ring_size` devices of one axis (B batch, S tokens, H query and Hkv key/value
heads, D head size, `item` bytes per element; T = S / P tokens per device):

- "ring" (`tuner.strategies.ring`): P steps; each of the first P - 1 sends the visiting K, V shard (2 B T Hkv D item,
  plus int32 positions, and segment ids with packed documents) to the next device while the step's block is
  computed: a step takes max(compute, transfer). Backward: P steps of 2.5x the forward FLOPs (five matmuls
  for two), P - 1 K,V sends and P sends of the float32 dK, dV accumulators, the last one not overlapped and
  in the input dtype (the sums are finished: the ring casts them before that hop). A ring of 2 sends no
  K,V in the backward: its one send is the forward's, same operands, and XLA merges the two. With a mask,
  the driver all-gathers every shard's position bounds once (`masks.ring_mask`; XLA:TPU builds that as a
  small all-reduce, which `hlo.collective_bytes` does not read), unless the trace decides every step from
  the layout's positions (zigzag or striped under a causal mask: every step runs; `tuner.semantics.known`).
- "all_to_all" (`tuner.strategies.all_to_all`, Ulysses): q, k, v exchanged to head groups (kv heads repeated to a
  multiple of P, `kv_repeats`), the whole sequence attended on H / P heads, the output exchanged back; the
  backward exchanges dout in and dq, dk, dv back, in the input dtype (the inner ring returns its gradients
  in that dtype); the float32 lse travels only with `return_lse`. Needs H % P == 0. Nothing overlaps.
- "all_gather" (`tuner.strategies.all_gather`): K and V all-gathered to full length (Hkv heads); local queries attend
  every key. Backward: dK, dV reduce-scattered in the input dtype (the gathered K's cotangent has K's
  dtype); K, V are not gathered again: autodiff keeps the gathered copies from the forward, so they stay in
  memory until the backward (`gathered_bytes`). Refused, as the implementation does, when they would take
  over half the device's memory. XLA:TPU builds every reduce-scatter as an all-reduce of the whole buffer
  and keeps its slice (`benchmarks/strategies/results/strategy_bytes.md`): on a TPU (`Platform.scatter_as_all_reduce`)
  it is timed as that, twice a reduce-scatter's link bytes; `bytes` still counts the reduce-scatter asked.
- "hybrid" (USP, `tuner.strategies.hybrid`): P = Pr x Pa; an all-to-all among Pa devices to H / Pa heads of
  S / Pr tokens, then a ring of Pr steps over those, then the all-to-all back. `axes=(Pr, Pa)`, or the
  fastest split with both > 1.

Compute: FLOPs / (peak x efficiency), 4 B H Tq Tk D per full block; the efficiency is an assumption per platform
(override it). Masked work is counted the way the kernels skip it, tile by tile (`_work_share`): a query tile x
key tile is computed unless every key in it comes after every query (causal), or the documents its queries and its
keys belong to cannot meet (packed rows: the first row of the problem's packing, `Problem.documents`), over the
token positions each strategy's kernels see (a ring's shards in its layout, all_to_all's whole sequence in the
layout's order, all_gather's shard against it, the hybrid's chunks over its ring positions), and the slowest
device's share counts. So a packing that leaves one device of the ring a long document's tail costs the ring,
while all_to_all, whose every device holds the whole sequence, stays balanced. Tiles: the ring kernel's default
forward tiles on the platform (`Platform.ring_tiles`; with a causal, window or chunk mask square, at most
`Platform.ring_masked_tile`; with documents at most `PACKED_TILE`, or the declared packing's tile, as the ring's
default), the same kernel's inside the other strategies, which run the platform's kernel (only a declared
packing's tile caps them), cut to the lengths; the backward is taken to skip the same share. Windows, chunks, HBM
traffic and kernel overheads are not modelled. Transfers: latency + bytes on the links / rate. `Prediction.bytes`
counts what `tuner.models.hlo.collective_bytes` reads from a compiled program -- each collective's result size on
one device -- from which a device puts on its links (P-1)/P of an all-gather's or all-to-all's result, all of a
collective-permute's and (P-1) times a reduce-scatter's (`link_bytes`). XLA:CPU widens bf16 collectives to
float32; the model does not.

The platforms' rates, memory and tiles: `tuner.models.platforms`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from tuner.models.hlo import COLLECTIVE_KINDS
from tuner.models.platforms import Platform, get_platform
from tuner.registry import STRATEGIES
from tuner.semantics import documents, known, layouts
from tuner.semantics.problem import Problem
from tuner.strategies.all_to_all import kv_repeats
from tuner.strategies.configs import masked_side

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
BACKWARD_FLOPS = 2.5  # backward FLOPs per forward FLOP: five block matmuls (s, dp, dv, dk, dq) for two


@dataclass(frozen=True)
class Prediction:
    """The model's verdict on one strategy: seconds of the forward and backward (0 without it); compute
    seconds within them; `bytes` per collective kind, as `hlo.collective_bytes` counts them (result sizes
    per device, both passes); `link_bytes` each device sends; `gathered_bytes` of full-length tensors each
    device holds; the hybrid's `axes` (Pr, Pa); `unsupported`, why it cannot run (times are then inf)."""

    strategy: str
    platform: str
    forward_s: float = math.inf
    backward_s: float = math.inf
    compute_s: float = 0.0
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVE_KINDS, 0))
    link_bytes: float = 0.0
    gathered_bytes: int = 0
    axes: tuple[int, int] | None = None
    unsupported: str | None = None

    @property
    def seconds(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def why(self) -> str:
        """A few words: what bounds it."""
        if self.unsupported:
            return f"unsupported: {self.unsupported}"
        exposed = 1 - self.compute_s / self.seconds if self.seconds else 0.0
        text = "compute-bound (<1% exposed transfers)" if exposed < 0.01 else f"{exposed:.0%} exposed transfers"
        return text + (f", holds {self.gathered_bytes / 2**20:.3g} MiB gathered" if self.gathered_bytes else "")


class _Pass:
    """Accumulates one prediction: seconds per pass, compute, bytes per kind and link bytes."""

    def __init__(self, platform: Platform) -> None:
        self.platform, self.seconds, self.compute = platform, [0.0, 0.0], 0.0
        self.bytes, self.link = dict.fromkeys(COLLECTIVE_KINDS, 0), 0.0

    def compute_for(self, backward: bool, seconds: float) -> None:
        self.seconds[backward] += seconds
        self.compute += seconds

    def wait(self, backward: bool, seconds: float, overlap: float = 0.0) -> None:
        """Transfers of `seconds` running beside `overlap` seconds of compute (already counted)."""
        self.seconds[backward] += max(seconds - overlap, 0.0)

    def collective(self, kind: str, result: int, group: int) -> float:
        """Records one collective among `group` devices whose result is `result` bytes; its seconds."""
        if group == 1:
            return 0.0
        share, rate = {"collective-permute": (1, self.platform.p2p),
                       "all-gather": ((group - 1) / group, self.platform.all_gather),
                       "reduce-scatter": ((2 if self.platform.scatter_as_all_reduce else 1) * (group - 1),
                                          self.platform.all_gather),
                       "all-to-all": ((group - 1) / group, self.platform.all_to_all)}[kind]
        self.bytes[kind] += int(result)
        self.link += share * result
        return self.platform.latency + share * result / rate


def _block_seconds(problem: Problem, platform: Platform, heads: int, tq: int, tk: int, share: float) -> float:
    """Forward seconds of `heads` heads of `tq` queries over `tk` keys, `share` of it unmasked."""
    rate = (platform.flops_f32 if problem.dtype == "float32" else platform.flops) * platform.efficiency
    return 4.0 * problem.batch * heads * tq * tk * problem.head_dim * share / rate


def _shards(problem: Problem, positions: int) -> list[np.ndarray]:
    """The token positions each of `positions` ring positions holds in the problem's layout."""
    length = problem.seq_len // positions
    return [layouts.local_positions_np(problem.layout, length, positions, r) for r in range(positions)]


def _computed(queries: np.ndarray, keys: np.ndarray, tiles: tuple[int, int], causal: bool,
              documents: np.ndarray | None) -> int:
    """The logits a kernel computes of `queries` against `keys` (positions, in the order it walks them) in
    tiles of `tiles`, cut to the lengths: every tile but those whose keys all follow its queries (`causal`)
    and those whose documents' ranges cannot meet (`documents`: the document of every position of a row).

    Documents are numbered in token order, so a tile's documents run from its first position's to its last
    one's. Then a key tile whose documents all come before a query tile's also precedes it (it is never
    causally skipped), and one whose documents all come after follows it (always causally skipped): each
    rule is a count over sorted key tiles, and the whole count takes O(n log n) in the tiles, not n^2 (a
    6M-token sequence has 49152 tiles of 128)."""
    block_q, block_kv = min(tiles[0], len(queries)), min(tiles[1], len(keys))

    def cut(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        starts = np.arange(0, len(x), block)
        return np.minimum.reduceat(x, starts), np.maximum.reduceat(x, starts), np.diff([*starts, len(x)])

    q_first, q_last, q_size = cut(queries, block_q)
    k_first, k_last, k_size = cut(keys, block_kv)
    reached = _weight_up_to(k_first, k_size, q_last) if causal else np.full(len(q_size), k_size.sum())
    if documents is not None:
        if np.any(np.diff(documents) < 0):
            raise ValueError("documents must be numbered in token order (non-decreasing along the row)")
        reached -= _weight_up_to(documents[k_last], k_size, documents[q_first] - 1)  # their documents end first
        if not causal:  # their documents start after the queries' last one
            reached -= k_size.sum() - _weight_up_to(documents[k_first], k_size, documents[q_last])
    return int(np.sum(q_size * reached))


def _weight_up_to(values: np.ndarray, weights: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """For each of `bounds`, the sum of the `weights` whose value is at most that bound."""
    order = np.argsort(values, kind="stable")
    cumulative = np.concatenate([[0], np.cumsum(weights[order])])
    return cumulative[np.searchsorted(values[order], bounds, side="right")]


def _work_share(problem: Problem, queries: list[np.ndarray], keys: list[np.ndarray], tiles: tuple[int, int]
                ) -> float:
    """The share of its logits the slowest device computes (1 with neither a causal mask nor documents): each
    device attends its `queries[i]` to every shard of `keys` (a ring's steps, or one gathered sequence), in
    `tiles`. Documents are those of the first row of the problem's packing (`Problem.documents`)."""
    packing = problem.documents
    documents = None if packing is None else packing.segment_ids(problem.seq_len, 1)[0]
    if not problem.causal and documents is None:
        return 1.0
    total = sum(len(k) for k in keys)
    return max(sum(_computed(q, k, tiles, problem.causal, documents) for k in keys) / (len(q) * total)
               for q in queries)


def _capped(tiles: tuple[int, int], cap: int | None) -> tuple[int, int]:
    return tiles if cap is None else (min(tiles[0], cap), min(tiles[1], cap))


def _masked(tiles: tuple[int, int], masked_tile: int | None, problem: Problem) -> tuple[int, int]:
    """`tiles`, or with a causal, window or chunk mask the square tile the kernel's default takes there
    (`tuner.strategies.configs.kernel_default`)."""
    if masked_tile is None or not problem.spec.has_position_mask:
        return tiles
    return (masked_side(masked_tile, *tiles),) * 2


def _ring_tiles(problem: Problem, platform: Platform) -> tuple[int, int]:
    """The forward tiles the ring runs by default (`tuner.strategies.implementations.Ring.default_config`):
    the platform's, square and at most its masked tile with a causal, window or chunk mask, and with
    documents at most the declared packing's tile, else `PACKED_TILE`."""
    tiles = _masked(platform.ring_tiles, platform.ring_masked_tile, problem)
    if not problem.segments:
        return tiles
    declared = documents.declared_tile(problem.packing, problem.seq_len, problem.ring_size, problem.spec)
    return _capped(tiles, declared or documents.PACKED_TILE)


def _exchanged_tiles(problem: Problem, platform: Platform) -> tuple[int, int]:
    """The forward tiles the kernel inside all_to_all, all_gather and the hybrid runs by default
    (`tuner.strategies.implementations.Exchanged.default_config`): the platform's kernel's, as `strategy=`
    runs it, so the ring's tiles, except that only a declared packing caps them."""
    tiles = _masked(platform.ring_tiles, platform.ring_masked_tile, problem)
    if not problem.segments:
        return tiles
    return _capped(tiles, documents.declared_tile(problem.packing, problem.seq_len, problem.ring_size, problem.spec))


def _steps_undecided(problem: Problem, size: int, tokens: int, groups: tuple[range, ...]) -> bool:
    """Whether some group of steps the ring driver traces as one has a visit the trace cannot decide from the
    layout's positions (`tuner.semantics.known`), so that the driver all-gathers every shard's bounds."""
    if problem.layout == documents.DOCUMENTS:
        return True
    return any(known.visited(known.ring_block(problem.layout, tokens, tokens, size, steps), problem.spec) is None
               for steps in groups if steps)


def _ring(acc: _Pass, problem: Problem, size: int, heads: int, kv_heads: int, tokens: int, backward: bool,
          share: float, passed_positions: bool = False) -> None:
    """A ring of `size` devices of `tokens` tokens each, on `heads` query and `kv_heads` key/value heads, the
    slowest device computing `share` of its logits; `passed_positions` where its caller passes positions
    (the hybrid), not the layout's."""
    b, d, ints, item = problem.batch, problem.head_dim, 2 if problem.segments else 1, ITEMSIZE[problem.dtype]
    shard = b * tokens * (2 * kv_heads * d * item + 4 * ints)
    grads = b * tokens * 2 * kv_heads * d * 4
    block = _block_seconds(problem, acc.platform, heads, tokens, tokens, share)
    if problem.spec.has_mask and size > 1:  # the driver's groups of steps (`tuner.strategies.ring`)
        forward = (range(size - 1), range(size - 1, size))
        backward_steps = (range(1), range(1, size - 1), range(size - 1, size))
        if passed_positions or _steps_undecided(problem, size, tokens, forward):
            acc.wait(False, acc.collective("all-gather", size * 2 * ints * b * 4, size))
        elif backward and _steps_undecided(problem, size, tokens, backward_steps):
            acc.wait(True, acc.collective("all-gather", size * 2 * ints * b * 4, size))
    acc.compute_for(False, size * block)
    for _ in range(size - 1):
        acc.wait(False, acc.collective("collective-permute", shard, size), overlap=block)
    if not backward:
        return
    block *= BACKWARD_FLOPS
    acc.compute_for(True, size * block)
    if size > 1:  # step 0 sends keys (with 2, the forward's send); 1..P-2 keys and grads; P-1 grads; one hop home
        if size > 2:
            acc.wait(True, acc.collective("collective-permute", shard, size), overlap=block)
        for _ in range(size - 2):
            pair = acc.collective("collective-permute", shard, size) + acc.collective("collective-permute", grads, size)
            acc.wait(True, pair, overlap=block)
        acc.wait(True, acc.collective("collective-permute", grads, size), overlap=block)
        acc.wait(True, acc.collective("collective-permute", grads * item // 4, size))


def _exchange(acc: _Pass, problem: Problem, group: int, tokens: int, backward: bool, return_lse: bool) -> int:
    """The all-to-alls among `group` devices of `tokens` tokens each; the kv heads that then travel."""
    b, h, d, item = problem.batch, problem.heads, problem.head_dim, ITEMSIZE[problem.dtype]
    kv_heads = problem.kv_heads * kv_repeats(h, problem.kv_heads, group)
    q, kv, lse = b * tokens * h * d * item, b * tokens * kv_heads * d * item, b * h * tokens * 4
    for result in (q, kv, kv, q, *([lse] if return_lse else [])):  # q, k, v in, out (and lse) back
        acc.wait(False, acc.collective("all-to-all", result, group))
    for result in (q, q, kv, kv, *([lse] if return_lse else [])) if backward else ():  # dout in, dq, dk, dv back
        acc.wait(True, acc.collective("all-to-all", result, group))
    for _ in range(2 if problem.segments else 0):  # q and kv segment ids, gathered
        acc.wait(False, acc.collective("all-gather", b * tokens * group * 4, group))
    return kv_heads


def _unsupported(problem: Problem, strategy: str, platform: Platform, axes) -> str | None:
    p, h = problem.ring_size, problem.heads
    group = {"all_to_all": p, "hybrid": axes[1] if axes else 1}.get(strategy, 1)
    if h % group:
        return f"heads ({h}) must be a multiple of the {'ring size' if strategy == 'all_to_all' else 'Pa'} ({group})"
    gathered = 2 * problem.batch * problem.seq_len * problem.kv_heads * problem.head_dim * ITEMSIZE[problem.dtype]
    if strategy == "all_gather" and platform.memory and 2 * gathered > platform.memory:
        return f"gathered K/V ({gathered / 2**30:.3g} GiB) over half the device memory"
    return None


def _predict(problem: Problem, strategy: str, platform: Platform, backward: bool, axes, return_lse: bool
             ) -> Prediction:
    reason = _unsupported(problem, strategy, platform, axes)
    if reason:
        return Prediction(strategy, platform.name, axes=axes, unsupported=reason)
    p, s, h, item = problem.ring_size, problem.seq_len, problem.heads, ITEMSIZE[problem.dtype]
    b, d, acc, gathered = problem.batch, problem.head_dim, _Pass(platform), 0
    if strategy == "ring":
        shards = _shards(problem, p)
        _ring(acc, problem, p, h, problem.kv_heads, s // p, backward,
              _work_share(problem, shards, shards, _ring_tiles(problem, platform)))
    elif strategy == "all_gather":
        kv = b * s * problem.kv_heads * d * item
        for _ in range(2):  # K and V (and back dK and dV)
            acc.wait(False, acc.collective("all-gather", kv, p))
            if backward:
                acc.wait(True, acc.collective("reduce-scatter", kv // p, p))
        if problem.segments:
            acc.wait(False, acc.collective("all-gather", b * s * 4, p))
        shards = _shards(problem, p)
        share = _work_share(problem, shards, [layouts.global_order(problem.layout, s, p)],
                            _exchanged_tiles(problem, platform))
        block = _block_seconds(problem, platform, h, s // p, s, share)
        acc.compute_for(False, block)
        if backward:
            acc.compute_for(True, BACKWARD_FLOPS * block)
        gathered = 2 * kv
    else:  # all_to_all is the hybrid with one ring position
        rows, group = axes or (1, p)
        kv_heads = _exchange(acc, problem, group, s // p, backward, return_lse)
        # all_to_all's one position holds the sequence in the layout's order over p; the hybrid's chunks are
        # laid out over its ring positions
        chunks = [layouts.global_order(problem.layout, s, p)] if rows == 1 else _shards(problem, rows)
        _ring(acc, problem, rows, h // group, kv_heads // group, s // rows, backward,
              _work_share(problem, chunks, chunks, _exchanged_tiles(problem, platform)), passed_positions=True)
        gathered = 2 * b * (s // rows) * (h + kv_heads) // group * d * item  # q, k, v and out of the head group
    return Prediction(strategy, platform.name, acc.seconds[0], acc.seconds[1], acc.compute, acc.bytes, acc.link,
                      gathered, axes)


def predict(problem: Problem, strategy: str, platform: str | Platform, *, backward: bool = True,
            axes: tuple[int, int] | None = None, return_lse: bool = False) -> Prediction:
    """The model's `Prediction` for `strategy` on `problem` over `problem.ring_size` devices of `platform`
    (a name of `platforms.PLATFORMS`, "cpu" or a `Platform`); `backward` adds the gradient pass; `axes=(Pr, Pa)`
    splits the devices for "hybrid" (default: its fastest split with both > 1); `return_lse` makes the
    float32 lse travel too. `ValueError` naming the argument for anything it cannot take."""
    if not isinstance(problem, Problem):
        raise ValueError(f"problem must be a tuner.semantics.problem.Problem, got {type(problem).__name__}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    chosen, p = get_platform(platform), problem.ring_size
    if axes is not None:
        if strategy != "hybrid":
            raise ValueError(f"axes applies to the hybrid strategy only, got axes={axes!r} for {strategy!r}")
        if (not isinstance(axes, tuple) or len(axes) != 2 or not all(isinstance(a, int) and a > 0 for a in axes)
                or axes[0] * axes[1] != p):
            raise ValueError(f"axes must be (Pr, Pa), positive ints with Pr * Pa == ring_size ({p}), got {axes!r}")
    if strategy != "hybrid" or axes is not None:
        return _predict(problem, strategy, chosen, backward, axes, return_lse)
    splits = [(p // a, a) for a in range(2, p) if p % a == 0]
    if not splits:
        return Prediction(strategy, chosen.name, unsupported=f"ring size {p} has no split Pr x Pa with both > 1")
    tries = [_predict(problem, strategy, chosen, backward, split, return_lse) for split in splits]
    return min(tries, key=lambda t: (t.unsupported is not None, t.seconds))


def rank(problem: Problem, platform: str | Platform, *, backward: bool = True, return_lse: bool = False,
         strategies: tuple[str, ...] = STRATEGIES) -> list[Prediction]:
    """Every strategy's `Prediction`, fastest first (ties in `STRATEGIES` order), unsupported ones last."""
    ranked = [predict(problem, s, platform, backward=backward, return_lse=return_lse) for s in strategies]
    return sorted(ranked, key=lambda t: (t.unsupported is not None, t.seconds if t.unsupported is None else 0))


def verdict(ranked: list[Prediction]) -> str:
    """One line: the pick of `rank()` and why (its bound, its lead over the runner-up)."""
    best = ranked[0]
    if best.unsupported:
        return "no strategy can run: " + "; ".join(f"{t.strategy}: {t.unsupported}" for t in ranked)
    rest = [t for t in ranked[1:] if t.unsupported is None]
    margin = rest[0].seconds / best.seconds - 1 if rest else 0.0
    lead = f"; {f'{margin:.1%} ahead of' if margin >= 1e-3 else 'tied with'} {rest[0].strategy}" if rest else ""
    return f"{best.strategy}{f' {best.axes[0]}x{best.axes[1]}' if best.axes else ''}: {best.why}{lead}"


def explain(ranked: list[Prediction]) -> str:
    """A short markdown table of `rank()`'s predictions (ms, MB each device sends, why) and the pick."""
    lines = ["| strategy | fwd ms | bwd ms | total ms | MB sent/device | why |", "|---|---|---|---|---|---|"]
    for t in ranked:
        name = t.strategy + (f" {t.axes[0]}x{t.axes[1]}" if t.axes and not t.unsupported else "")
        numbers = (t.forward_s * 1e3, t.backward_s * 1e3, t.seconds * 1e3, t.link_bytes / 1e6)
        cells = ["-"] * 4 if t.unsupported else [f"{x:.4g}" for x in numbers]
        lines.append(f"| {name} | {' | '.join(cells)} | {t.why} |")
    return "\n".join([*lines, "", f"pick: {verdict(ranked)}"])


__all__ = ["BACKWARD_FLOPS", "ITEMSIZE", "STRATEGIES", "Prediction", "explain", "predict", "rank", "verdict"]
