"""A small decoder-only language model on ring attention, trained on a long-range retrieval task.

Every sequence hides one *needle* token (one of `needles` ids) at a random position in its first
quarter, among random noise tokens (`noise` other ids), and ends with `queries` copies of a QUERY
token; at every QUERY position the model must output the needle. The needle sits thousands of positions
before the questions, on another device of the ring, so the loss can only fall if attention -- and its
gradients -- reach across the ring. Nothing else in the model can see that far.

The sequence is laid out zigzag over `devices` simulated CPU devices (`shard_map` over "sp"); each
layer is RMSNorm -> `tuner.flax.RingSelfAttention` (rotary embeddings on global positions, tuned ring
attention) -> residual, RMSNorm -> MLP -> residual.

With `--packed` each row packs documents of different lengths, each with its own needle and questions,
and the model trains the way context parallelism is done at scale: the data pipeline lays every batch
out once in the documents layout (`tuner.layouts.lay_out_batch`: tokens, targets, weights and segment ids,
and the positions it gives them), and the step runs on global arrays sharded over the mesh, attention
with `laid_out=True` permuting nothing. `--per-call` trains on the same batches in token order instead,
the loader laying out q, k and v in every call: the same loss curve, more collectives.

    python examples/long_context_lm.py                  # 8 devices, 1024 tokens, 300 steps
    python examples/long_context_lm.py --seq-len 512 --steps 250
    python examples/long_context_lm.py --autotune 8     # tune the step's attention first, then train
    python examples/long_context_lm.py --packed         # packed documents, laid out once per batch
    python examples/long_context_lm.py --packed --packing lognormal:4,sigma=0.88   # declared: one ring compiled
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Config:
    """The model (option names of a typical model builder) and the task."""

    vocab_size: int = 64
    embed_dim: int = 64
    hidden_size: int = 128
    num_heads: int = 2
    num_kv_heads: int = 1
    num_layers: int = 2
    dropout: float = 0.0
    max_seq_len: int = 8192
    rope_base: float = 500_000.0
    needles: int = 8
    noise: int = 4
    queries: int = 8
    batch: int = 8
    seq_len: int = 1024
    devices: int = 8
    layout: str = "zigzag"
    packed: bool = False  # rows of packed documents, laid out in the documents layout by the pipeline
    per_call: bool = False  # with packed: rows in token order, laid out by the loader in every call
    packing: str | None = None  # with packed: the packing declared to attention (one ring compiled, not three)
    steps: int = 300
    learning_rate: float = 3e-3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len > self.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds max_seq_len={self.max_seq_len}")
        if self.per_call and not self.packed:
            raise ValueError("per_call compares the two ways of laying out packed rows: it needs packed")
        if self.packing is not None and not self.packed:
            raise ValueError("packing declares how packed rows are drawn: it needs packed")
        if self.packed and self.seq_len < 8 * self.queries * 2:
            raise ValueError(f"seq_len={self.seq_len} is too short to pack documents of {self.queries} questions")
        if self.seq_len % (2 * self.devices):
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of 2 x devices={2 * self.devices} "
                             f"(the zigzag layout gives each device two chunks)")
        if self.needles + self.noise + 1 > self.vocab_size:
            raise ValueError(f"vocab_size={self.vocab_size} must hold {self.needles} needles, {self.noise} "
                             f"noise tokens and the QUERY token")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


def build(config: Config):
    """The model and its training step, on a mesh of `config.devices` devices (jax imported here)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tuner.semantics import layouts
    from tuner.flax import RingSelfAttention

    class Block(nnx.Module):
        def __init__(self, c: Config, rngs: nnx.Rngs):
            self.attention_norm = nnx.RMSNorm(c.embed_dim, rngs=rngs)
            on_mesh = dict(mesh=mesh, layout="documents", laid_out=not c.per_call, packing=c.packing) if c.packed \
                else dict(layout=c.layout)
            self.attention = RingSelfAttention(c.embed_dim, c.num_heads, num_kv_heads=c.num_kv_heads,
                                               axis_name="sp", causal=True, rope_base=c.rope_base, rngs=rngs,
                                               **on_mesh)
            self.mlp_norm = nnx.RMSNorm(c.embed_dim, rngs=rngs)
            self.up = nnx.Linear(c.embed_dim, c.hidden_size, rngs=rngs)
            self.down = nnx.Linear(c.hidden_size, c.embed_dim, rngs=rngs)

        def __call__(self, x, dropout, positions=None, segment_ids=None):
            x = x + dropout(self.attention(self.attention_norm(x), positions=positions, segment_ids=segment_ids))
            return x + dropout(self.down(jax.nn.gelu(self.up(self.mlp_norm(x)))))

    class LanguageModel(nnx.Module):
        def __init__(self, c: Config, rngs: nnx.Rngs):
            self.embed = nnx.Embed(c.vocab_size, c.embed_dim, rngs=rngs)
            self.blocks = nnx.List([Block(c, rngs) for _ in range(c.num_layers)])
            self.norm = nnx.RMSNorm(c.embed_dim, rngs=rngs)
            self.head = nnx.Linear(c.embed_dim, c.vocab_size, rngs=rngs)

        def __call__(self, tokens, dropout_key=None, positions=None, segment_ids=None):
            def dropout(x):  # explicit keys: under shard_map the same model runs on every device of the ring
                if dropout_key is None or config.dropout == 0.0:
                    return x
                key = dropout_key if config.packed else jax.random.fold_in(dropout_key, jax.lax.axis_index("sp"))
                keep = jax.random.bernoulli(key, 1.0 - config.dropout, x.shape)
                return jnp.where(keep, x / (1.0 - config.dropout), 0.0)

            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, dropout, positions, segment_ids)
            return self.head(self.norm(x))

    mesh = Mesh(np.array(jax.devices()[:config.devices]), ("sp",))
    model = LanguageModel(config, nnx.Rngs(config.seed))
    graphdef, params = nnx.split(model)
    warmup = max(1, min(20, config.steps // 10))
    optimizer = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, warmup,
                                                               max(config.steps, warmup + 1)))
    seq = P(None, "sp")

    def logits_of(params, tokens, key, *rows):
        return nnx.merge(graphdef, params)(tokens, key, *rows)

    # packed: global arrays, the attention's own shard_map over "sp"; else the model under shard_map
    sharded = logits_of if config.packed else jax.shard_map(logits_of, mesh=mesh, in_specs=(P(), seq, P()),
                                                            out_specs=seq)

    def loss_fn(params, tokens, targets, weights, key, *rows):
        logits = sharded(params, tokens, key, *rows)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return (losses * weights).sum() / weights.sum()  # per token: the order of the tokens does not matter

    @jax.jit
    def train_step(params, opt_state, tokens, targets, weights, key, *rows):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets, weights, key, *rows)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def batch(rng: np.random.Generator):
        """Tokens, targets and loss weights of one batch, laid out for the ring."""
        b, t = config.batch, config.seq_len
        query = config.vocab_size - 1
        tokens = rng.integers(config.needles, config.needles + config.noise, size=(b, t))
        needles = rng.integers(0, config.needles, size=b)
        where = rng.integers(0, t // 4, size=b)
        tokens[np.arange(b), where] = needles
        tokens[:, t - config.queries:] = query
        targets = np.zeros((b, t), np.int32)
        targets[:, t - config.queries:] = needles[:, None]
        weights = np.zeros((b, t), np.float32)
        weights[:, t - config.queries:] = 1.0
        return tuple(layouts.lay_out(jnp.asarray(a), config.layout, config.devices)
                     for a in (tokens.astype(np.int32), targets, weights))

    def packed_batch(rng: np.random.Generator):
        """One batch of rows of packed documents, each with its needle in its first quarter and its questions at
        its end: tokens, targets, loss weights, then positions and segment ids, laid out once for the ring
        (token order and no positions with per_call), sharded over the mesh."""
        b, t = config.batch, config.seq_len
        query, shortest = config.vocab_size - 1, 8 * config.queries
        tokens = rng.integers(config.needles, config.needles + config.noise, size=(b, t))
        targets, weights = np.zeros((b, t), np.int32), np.zeros((b, t), np.float32)
        segments = np.zeros((b, t), np.int32)
        for row in range(b):
            start, document = 0, 0
            while start < t:
                left = t - start
                length = left if left < 2 * shortest else int(rng.integers(shortest, left - shortest + 1))
                end = start + length  # the last document takes what is left
                needle = rng.integers(0, config.needles)
                tokens[row, start + rng.integers(0, length // 4)] = needle
                tokens[row, end - config.queries:end] = query
                targets[row, end - config.queries:end] = needle
                weights[row, end - config.queries:end] = 1.0
                segments[row, start:end] = document
                start, document = end, document + 1
        rows = {"tokens": tokens.astype(np.int32), "targets": targets, "weights": weights, "segment_ids": segments}
        if config.per_call:
            arrays, extra = rows, (None,)
        else:
            arrays, positions = layouts.lay_out_batch(rows, config.devices, "documents", causal=True)
            extra = (positions,)
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, seq))
        laid = tuple(put(arrays[n]) for n in ("tokens", "targets", "weights"))
        return *laid, *(None if x is None else put(x) for x in extra), put(arrays["segment_ids"])

    # the state replicated over the mesh from the start, as the step returns it: one compile, not two
    state = jax.device_put((params, optimizer.init(params)), NamedSharding(mesh, P()))
    return *state, train_step, packed_batch if config.packed else batch


def train(config: Config, progress: bool = True, autotune_trials: int = 0) -> list[float]:
    """Train for `config.steps` steps; returns the loss of every step. With `autotune_trials`, first
    tune every attention problem of the training step (`tuner.autotune`) with that many trials each."""
    import jax
    import numpy as np
    from tqdm import tqdm

    params, opt_state, train_step, batch = build(config)
    if autotune_trials:
        import tuner

        example = batch(np.random.default_rng(config.seed + 1))  # the shapes of a batch, not the training data
        tokens, targets, weights, *rows = example
        report = tuner.autotune(train_step, params, opt_state, tokens, targets, weights, jax.random.key(0), *rows,
                                trials=autotune_trials, progress=progress)
        print(report.render(), file=sys.stderr)
    rng = np.random.default_rng(config.seed)
    key = jax.random.key(config.seed)
    losses = []
    with tqdm(total=config.steps, desc="train", unit="step", disable=not progress, file=sys.stderr) as bar:
        for step in range(config.steps):
            tokens, targets, weights, *rows = batch(rng)  # packed: positions (or None) and segment ids
            params, opt_state, loss = train_step(params, opt_state, tokens, targets, weights,
                                                 jax.random.fold_in(key, step), *rows)
            losses.append(float(loss))
            bar.set_postfix_str(f"loss {losses[-1]:.4f}", refresh=False)
            bar.update()
    return losses


HELP = {
    "embed_dim": "the model's width", "hidden_size": "the MLP's hidden width", "num_heads": "query heads a layer",
    "num_kv_heads": "key/value heads a layer (grouped-query attention where fewer)", "num_layers": "decoder layers",
    "max_seq_len": "the longest sequence the model is built for", "needles": "how many needle ids the task draws from",
    "noise": "how many noise ids fill the sequence", "queries": "QUERY tokens at the end of a sequence (or document)",
    "batch": "rows a step", "seq_len": "tokens a row", "devices": "simulated CPU devices in the ring",
    "steps": "training steps", "seed": "the seed of the weights and the data", "dropout": "dropout rate",
    "learning_rate": "Adam's learning rate", "rope_base": "the rotary embeddings' base",
}


def main(argv: list[str] | None = None) -> int:
    defaults = Config()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, kind in ((n, type(getattr(defaults, n))) for n in HELP):
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(defaults, name),
                            help=f"{HELP[name]} (default: %(default)s)")
    parser.add_argument("--packed", action="store_true",
                        help="rows of packed documents, laid out once per batch in the documents layout")
    parser.add_argument("--per-call", action="store_true",
                        help="with --packed: rows in token order, laid out by the loader in every call")
    parser.add_argument("--packing", metavar="TEXT",
                        help="with --packed: declare how the rows' documents are drawn (e.g. lognormal:4,sigma=0.88, "
                             "as tuner search --documents takes it); attention then compiles one ring, not one per "
                             "tile")
    parser.add_argument("--autotune", type=int, default=0, metavar="TRIALS",
                        help="first tune the training step's attention problems on the CPU, TRIALS trials each "
                             "(tuner.autotune; rows go to $TUNER_DB, else $TUNER_HOME/tuning.sqlite)")
    args = parser.parse_args(argv)
    autotune_trials = args.__dict__.pop("autotune")
    if autotune_trials < 0:
        parser.error(f"--autotune must be a number of trials (0: do not tune), got {autotune_trials}")
    try:
        config = Config(**{k: v for k, v in vars(args).items()})
    except ValueError as error:
        parser.error(str(error))
    # Before jax starts: simulate the ring on CPU devices.
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={config.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if config.packing is not None:
        from tuner.semantics.packing import Packing  # imports jax: after XLA_FLAGS

        try:
            Packing.parse(config.packing)
        except ValueError as error:
            parser.error(f"--packing: {error}")
    if config.packed:
        how = "in every call by the loader" if config.per_call else "once per batch by the pipeline"
        print(f"ring of {config.devices} devices, {config.seq_len} tokens of packed documents a row, documents "
              f"layout {how}; each document's needle in its first quarter, {config.queries} questions at its end",
              file=sys.stderr)
    else:
        print(f"ring of {config.devices} devices, {config.layout} layout, {config.seq_len} tokens "
              f"({config.seq_len // config.devices} per device); needle in the first {config.seq_len // 4} "
              f"positions, {config.queries} questions at the end", file=sys.stderr)
    start = time.perf_counter()
    losses = train(config, autotune_trials=autotune_trials)
    tail = losses[-10:]
    print(f"loss {losses[0]:.4f} -> {sum(tail) / len(tail):.4f} (mean of the last {len(tail)} steps) "
          f"in {len(losses)} steps, {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
