"""The `tuner` command line.

    tuner search --device cpu [problem] [--trials N] ...   tune a problem, store the winner in the cache
    tuner search --device tpu --dry-run [problem]          check the TPU kernels without a TPU
    tuner search --device tpu --dry-run --target v5e:2x2   compile every variant for a TPU topology (libtpu)
    tuner search --from problems.jsonl --device cpu        tune the problems a program recorded
    tuner record --out problems.jsonl -- python train.py   record the attention calls a program traces
    tuner doctor problems.jsonl                            what the loader uses for each recorded call, and why
    tuner list | show KEY | export FILE | import FILE | clear   the cache
    tuner bench --device cpu [problem]                      tuned vs default vs scan vs dense, one run
    tuner bench --device cpu --mechanisms [problem]         ring vs gathered dense: record the fastest
    tuner generate --backend triton [--compile sm_80,sm_90] render (and compile) the standard variants
    tuner generate --backend pallas_tpu [--lower]           render (and lower for TPU) the standard variants
    tuner report KEY --out FILE                             HTML report of the study behind an entry
    tuner info                                              devices, backends, versions, cache
    tuner demo                                              a ring on simulated CPU devices, checked, timed

Bad arguments print one line saying what to do and exit with status 2; jax is imported only after the
arguments are checked (on the CPU the ring size decides how many devices jax simulates).

The package: `parser` (the verbs' flags and value types), `options` (parsed options to the API's inputs,
checked before any work), `verbs` (a function per verb: call the API, print what it returns),
`recorded` (`record`, `doctor`, `search --from`), `targets` (`search --dry-run --target`), and the texts
and reports of `info`, `usage` (after a search), `demo` and `generate`. The top layer: it may import every
layer below.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tuner.cache import CacheError
from tuner.cache.views import RequestError
from tuner.cli.options import UsageError, fail
from tuner.cli.parser import build_parser, check_positive


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tuner` command with `argv` (default: the process's arguments); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.verb is None:
            parser.print_help()
            return 2
        check_positive(args)
        return args.run(args)
    except (UsageError, RequestError) as error:
        return fail(str(error))
    except CacheError as error:  # the cache cannot be read or written: one line, what to do
        return fail(str(error), status=1)
    except RuntimeError as error:
        if "Unable to initialize backend" in str(error):
            return fail(f"JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}: {str(error).splitlines()[0]}; "
                        f"unset JAX_PLATFORMS or name a platform this machine has")
        raise


__all__ = ["build_parser", "main"]
