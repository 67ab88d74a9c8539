"""The `tuner` argument parser: the verbs, their flags and the types that check flag values as they are
parsed (a window, a finite number, a seed); a bad value is a one-line usage error.
"""

from __future__ import annotations

import argparse
import math
from typing import NoReturn

from tuner.cache.views import LIST_FILTERS
from tuner.cli import searching, verbs
from tuner.cli.options import UsageError
from tuner.semantics.problem import DEVICES, DTYPES, OBJECTIVES, SAMPLERS, Problem
from tuner.semantics.spec import LAYOUTS


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are `UsageError`s (one line, exit status 2), not argparse's exit."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _window(text: str) -> int | tuple[int, int]:
    """`--window`: W (symmetric) or LEFT,RIGHT, non-negative."""
    try:
        parts = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT (non-negative ints), got {text!r}") from None
    if len(parts) not in (1, 2) or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"expected W or LEFT,RIGHT (non-negative ints), got {text!r}")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _finite(text: str) -> float:
    """A finite number (no nan or inf)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _seed(text: str) -> int:
    """A seed numpy and optuna take: 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"expected an integer from 0 to 2**32 - 1, got {text!r}")
    return value


def _add_problem(parser: argparse.ArgumentParser) -> None:
    """The problem flags of `search` and `bench`, defaulting to `Problem()`'s small problem."""
    d = Problem()
    group = parser.add_argument_group("problem (global shapes; defaults: a small problem)")
    group.add_argument("--device", required=True, choices=DEVICES, help="the hardware to tune on")
    group.add_argument("--batch", type=int, default=d.batch)
    group.add_argument("--seq-len", type=int, default=d.seq_len, help="global sequence length")
    group.add_argument("--heads", type=int, default=d.heads, help="query heads")
    group.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads (GQA)")
    group.add_argument("--head-dim", type=int, default=d.head_dim, help="query/key head dim")
    group.add_argument("--value-head-dim", type=int, default=None, metavar="DV",
                       help="value head dim, where it differs from --head-dim (MLA: --head-dim 192 "
                            "--value-head-dim 128)")
    group.add_argument("--dtype", choices=DTYPES, default=d.dtype)
    group.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal)
    group.add_argument("--window", type=_window, default=None, metavar="W|L,R", help="sliding window")
    group.add_argument("--chunk", type=int, default=None, help="chunked attention: chunk size")
    group.add_argument("--segments", type=int, default=0, metavar="N",
                       help="pack N documents per row (segment ids) cut at random points; 0: none")
    group.add_argument("--documents", default=None, metavar="PACKING",
                       help="pack documents of these lengths per row: '2048,128x16' (fixed, filling --seq-len), "
                            "'lognormal:14[,sigma=S][,seed=K]' or 'uniform:8[,seed=K]' (drawn per row); tuned under "
                            "its own key: pass packing= to the loader")
    group.add_argument("--softcap", type=_finite, default=None, help="logits soft cap")
    group.add_argument("--sinks", type=int, default=0, metavar="N", help="sink logits per head; 0: none")
    group.add_argument("--ring-size", type=int, default=None,
                       help=f"devices on the ring (CPU: simulated; default {d.ring_size} on the CPU, "
                            f"all devices elsewhere)")
    group.add_argument("--a2a-size", type=int, default=1, metavar="A",
                       help="the hybrid (--backend hybrid, hybrid_<kernel>): an all-to-all over groups of A devices, "
                            "the ring over ring-size / A positions; 1: one axis (default)")
    group.add_argument("--layout", choices=LAYOUTS, default=d.layout)
    group.add_argument("--backend", default="auto", help="auto (the device's best), or a registered implementation: "
                                                          "scan, triton, pallas_tpu, dense, jax_nn, ... (tuner info)")
    group.add_argument("--db", default=None, help="cache file (default $TUNER_DB, else "
                                                  "$TUNER_HOME/tuning.sqlite)")


CALLS_HELP = ("calls issued back to back per timed run, timed per call: keeps the host's dispatch gap out "
              "of sub-millisecond kernels (default 5 on --device gpu, 1 elsewhere)")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every verb; a parsed verb's `run` is its function in `tuner.cli.verbs` (`search`'s in
    `tuner.cli.searching`)."""
    parser = _Parser(prog="tuner", description="Generate, verify, autotune and dispatch ring flash "
                                               "attention for JAX.")
    commands = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)

    search = commands.add_parser("search", help="tune a problem and store the winner in the cache")
    _add_problem(search)
    tuning = search.add_argument_group("search")
    tuning.add_argument("--objective", choices=OBJECTIVES, default="fwd+bwd")
    tuning.add_argument("--trials", type=int, default=12, help="trials the study should reach (a re-run "
                                                               "resumes and runs the rest); with --backend auto "
                                                               "on a GPU, per engine (triton, cudnn)")
    tuning.add_argument("--timeout", type=_finite, default=None,
                        help="seconds for this run's trials, counted once the default is built (its trial "
                             "always runs); shared equally by the engines searched")
    tuning.add_argument("--trial-timeout", type=_finite, default=120.0, help="seconds per trial")
    tuning.add_argument("--sampler", choices=SAMPLERS, default="tpe")
    tuning.add_argument("--seed", type=_seed, default=0)
    tuning.add_argument("--runs", type=int, default=3, help="timed runs per trial")
    tuning.add_argument("--calls", type=int, default=None, help=CALLS_HELP)
    tuning.add_argument("--storage", default=None, help="optuna storage URL shared by workers (default: "
                                                        "a SQLite file beside the cache; "
                                                        "postgresql+psycopg://... for workers on several "
                                                        "hosts)")
    tuning.add_argument("--heartbeat", type=int, default=30, help="seconds between a running trial's "
                                                                 "heartbeats; a trial silent for twice that "
                                                                 "belonged to a dead worker and is run again")
    tuning.add_argument("--reconnect", type=_finite, default=120.0, help="seconds to keep retrying a study "
                                                                        "storage that stopped answering, then "
                                                                        "stop without writing anything")
    tuning.add_argument("--no-warm-start", dest="warm_start", action="store_false",
                        help="start from the default and the sampler only, not from the winners of the nearest "
                             "tuned problems in the cache")
    tuning.add_argument("--compile-ahead", type=int, default=None,
                        help="trials that compile while another is checked or timed (default: 0 on the CPU, "
                             "whose cores compile and run alike; 1 on a GPU or TPU)")
    tuning.add_argument("--interpret", action="store_true", help="run kernel backends in their "
                                                                 "interpreter (CPU checks)")
    tuning.add_argument("--dry-run", action="store_true",
                        help="with --device tpu, without a TPU: enumerate and constrain the search space, "
                             "lower every variant for TPU, run --samples of them in the interpreter; with "
                             "--device gpu --target, without a GPU: compile every Triton launch for that GPU")
    tuning.add_argument("--samples", type=int, default=None, help="with --dry-run: variants to run in the "
                                                                  "interpreter against scan (default 3); with "
                                                                  "--target: variants per kernel to compile besides "
                                                                  "the default (default: every one)")
    tuning.add_argument("--target", action="append", default=[], metavar="TARGET",
                        help="with --dry-run: compile every variant for this TPU topology (--device tpu: "
                             "v5e:2x2, v6e:2x2, v5p:2x2x1, v4:2x2x1; needs libtpu) or GPU (--device gpu: a100, "
                             "h100, h200, b200; needs triton); repeat, or comma-separate; 'all': every one; "
                             "store the best by the model as a 'compiled' entry. --backend may name any "
                             "implementation over the target's kernel (pallas_tpu, triton), and --a2a-size "
                             "compiles the hybrid")
    tuning.add_argument("--from", dest="from_file", default=None, metavar="FILE",
                        help="tune every problem of a record file (tuner record) not tuned yet, instead of the "
                             "problem flags")
    search.set_defaults(run=searching.run_search)

    recorder = commands.add_parser("record", help="run a command and record the attention problems it traces")
    recorder.add_argument("--out", required=True, help="record file to write (JSON lines)")
    recorder.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- python train.py")
    recorder.set_defaults(run=verbs.run_record)

    doctor = commands.add_parser("doctor", help="what the loader will use for each recorded problem, and why")
    doctor.add_argument("file", help="record file (tuner record)")
    doctor.add_argument("--db", default=None, help="cache file to decide from (default: the one each call's "
                                                   "loader reads)")
    doctor.set_defaults(run=verbs.run_doctor)

    for name, helptext, run in (("list", "the tuned entries, a page at a time (stale and invalid ones marked)",
                                 verbs.run_list),
                                ("show", "one entry, every field", verbs.run_show),
                                ("export", "write entries as JSON lines", verbs.run_export),
                                ("import", "read entries from JSON lines", verbs.run_import),
                                ("clear", "delete entries", verbs.run_clear)):
        verb = commands.add_parser(name, help=helptext)
        if name == "show":
            verb.add_argument("key", help="the entry's key, or a unique prefix of it")
        if name in ("export", "import"):
            verb.add_argument("file", help="JSON-lines file")
        if name == "export":
            verb.add_argument("--key", default=None, help="only entries whose key starts with this")
        if name == "clear":
            verb.add_argument("--stale", action="store_true", help="only the stale and invalid entries")
        if name == "import":
            verb.add_argument("--skip-invalid", action="store_true",
                              help="import the valid rows when some are invalid (default: import nothing)")
        if name == "list":
            verb.add_argument("--limit", type=int, default=50, help="entries a page (default 50)")
            verb.add_argument("--page", type=int, default=1, help="which page (from 1)")
            verb.add_argument("--all", action="store_true", help="every entry, no paging")
            for field, kind in LIST_FILTERS.items():
                verb.add_argument(f"--{field.replace('_', '-')}", type=kind, default=None,
                                  help=f"only entries with this {field.replace('_', ' ')}")
        verb.add_argument("--db", default=None, help="cache file")
        verb.set_defaults(run=run)

    bench = commands.add_parser("bench", help="tuned vs default vs scan vs dense attention, side by side")
    _add_problem(bench)
    bench.add_argument("--objective", choices=OBJECTIVES, default="fwd+bwd")
    bench.add_argument("--runs", type=int, default=7)
    bench.add_argument("--calls", type=int, default=None, help=CALLS_HELP)
    bench.add_argument("--mechanisms", nargs="?", const="all", default=None, metavar="NAMES",
                       help="time the ring backends against gathered dense attention on this ring and record "
                            "the fastest for the problem: get_tuned_ring_attention(backend='auto') follows it; "
                            "NAMES (comma-separated, e.g. triton,cudnn): only those implementations")
    bench.set_defaults(run=verbs.run_bench)

    report = commands.add_parser("report", help="HTML report of the study behind a cache entry")
    report.add_argument("key", help="the entry's key, or a unique prefix of it")
    report.add_argument("--out", default=None, help="HTML file to write (default: report-KEY.html here, KEY the "
                        "entry's first 8 characters)")
    report.add_argument("--storage", default=None, help="optuna storage of the study")
    report.add_argument("--db", default=None, help="cache file")
    report.set_defaults(run=verbs.run_report)

    dashboard = commands.add_parser("dashboard", help="serve optuna-dashboard on the study storage (Ctrl-C "
                                                      "stops it)")
    dashboard.add_argument("--storage", default=None, help="optuna storage of the studies (default: the SQLite "
                                                           "file beside the cache)")
    dashboard.add_argument("--db", default=None, help="cache file whose default storage to serve")
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this "
                                                               "host only; 0.0.0.0 serves the network)")
    dashboard.add_argument("--port", type=int, default=8080)
    dashboard.set_defaults(run=verbs.run_dashboard)

    generate = commands.add_parser("generate", help="render the standard kernel variants (and compile them)")
    generate.add_argument("--backend", default="triton", help="whose templates: triton or pallas_tpu")
    generate.add_argument("--out", default=None, help="folder (default: kernels_generated/ of the checkout, "
                                                      "else $TUNER_HOME/kernels_generated)")
    generate.add_argument("--compile", default=None, metavar="sm_80,sm_90,sm_100",
                          help="also compile every kernel for these targets (no GPU needed) and report "
                               "shared memory, registers, spills, the MMA instructions, whether they are the "
                               "target's tensor-core path, and the occupancy")
    generate.add_argument("--lower", action="store_true",
                          help="pallas_tpu: also export every variant for TPU (no TPU needed), which runs "
                               "the Mosaic lowering of its kernels")
    generate.add_argument("--dtypes", default=None, metavar="bfloat16,float16",
                          help="only these dtypes (float32 kernels take ptxas about a minute each)")
    generate.add_argument("--json", default=None, help="write the compile or lowering report as JSON")
    generate.set_defaults(run=verbs.run_generate)

    info = commands.add_parser("info", help="devices, backends, versions, cache")
    info.add_argument("--db", default=None, help="cache file")
    info.set_defaults(run=verbs.run_info)

    memory = commands.add_parser("memory", help="what one device holds for a problem: the compiler's count, the "
                                                "ring's floor, the longest sequence a chip holds")
    _add_problem(memory)
    memory.add_argument("--target", default=None, metavar="TOPOLOGY",
                        help="--device tpu without a TPU: compile for this topology (v5e:2x2, v6e:2x2, v5p:2x2x1, "
                             "v4:2x2x1; needs libtpu); --device gpu without a GPU: for this many GPUs (h100:8; "
                             "needs jax's CUDA plugin; the cudnn and scan rings build, not triton)")
    memory.add_argument("--objective", choices=("fwd", "fwd+bwd", "both"), default="both")
    memory.add_argument("--headroom", type=float, default=0.2,
                        help="the fraction of a chip's memory left for the rest of the model (default 0.2)")
    memory.add_argument("--argument-layouts", choices=("fixed", "compiler"), default="fixed",
                        help="fixed: q, k, v row-major, as arrays given to a jitted function (default); compiler: "
                             "laid out by the compiler, as where a model makes them in the same program")
    memory.set_defaults(run=verbs.run_memory)

    demo = commands.add_parser("demo", help="run a ring on simulated CPU devices, check it, time it")
    demo.add_argument("--devices", type=int, default=4, help="ring size (simulated CPU devices)")
    demo.add_argument("--batch", type=int, default=1)
    demo.add_argument("--seq-len", type=int, default=2048, help="global sequence length")
    demo.add_argument("--heads", type=int, default=8)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--head-dim", type=int, default=64)
    demo.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    demo.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    demo.add_argument("--runs", type=int, default=5)
    demo.set_defaults(run=verbs.run_demo)
    return parser


POSITIVE = ("devices", "batch", "seq_len", "heads", "kv_heads", "head_dim", "value_head_dim", "runs", "calls", "trials",
            "ring_size", "a2a_size", "chunk", "timeout", "trial_timeout", "limit", "page", "heartbeat",
            "reconnect")
NON_NEGATIVE = ("compile_ahead",)


def check_positive(args: argparse.Namespace) -> None:
    """The counts and sizes argparse takes as plain numbers are positive (`NON_NEGATIVE` ones at least 0)."""
    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in NON_NEGATIVE:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")
