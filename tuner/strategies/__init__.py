"""How the devices share the work: the ring driver over any block kernel, all-to-all (Ulysses),
all-gather KV, the 2-D hybrid, the gathered mechanisms; each registers itself as an implementation.
Imports `support`, `semantics`, `kernels` and `registry`."""
