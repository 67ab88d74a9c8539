"""Small helpers every layer shares, knowing nothing of attention: positive-int checks, text tables and
one-line errors, where files live, the platform a program is built for, shard_map's varying axes, the
work counter, the version. Imports nothing of ring-tuner."""
