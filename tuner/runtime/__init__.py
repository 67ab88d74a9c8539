"""What runs at call time: the planning step (`plan`), the public `ring_attention`, the loader
`get_tuned_ring_attention` (`dispatch`) with its choice by measurement or model, the global-array call
(`meshed`, its `shard_map` body in `sharded`) and the record of every traced call. Imports every layer
below `tuning`."""
