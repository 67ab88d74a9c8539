"""The `tuner` command run in the test process: the tests whose point is not the process boundary save an
interpreter and a jax start per command."""

import logging
import os
import subprocess
import sys

from tuner.cli import main


def in_process(capsys, *args: str, home) -> subprocess.CompletedProcess:
    """`tuner ARGS` with `TUNER_HOME` at `home`, run as the script runs it (`tuner.cli.main`) but in this
    process: no interpreter and jax to start per command. Its exit status, stdout and stderr; stderr also
    gets the WARNINGs the command logs, as a process of its own prints them (logging's last resort)."""
    saved = dict(os.environ)
    os.environ["TUNER_HOME"] = str(home)
    os.environ.pop("TUNER_DB", None)
    capsys.readouterr()
    logged = logging.StreamHandler(sys.stderr)  # capsys's stream
    logged.setLevel(logging.WARNING)
    logging.getLogger().addHandler(logged)
    try:
        code = main(list(args))
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    finally:
        logging.getLogger().removeHandler(logged)
        os.environ.clear()
        os.environ.update(saved)  # the CLI sets the device count and platform for a jax it would start
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["tuner", *args], code, out, err)
