"""Run a training script on the ``lpsync`` backend without editing it: register the
backend, then run the script as ``python script.py args`` would.

    torchrun --nproc-per-node 4 -m lpsync_client.torch.run train.py --backend lpsync

Everything after the script path is the script's own argv (so ``--backend lpsync`` is
the script's option, read by the script's own init_process_group call). ``-m module``
in place of the script path runs a module instead.
"""

from __future__ import annotations

import os
import runpy
import sys

USAGE = "usage: python -m lpsync_client.torch.run (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, file=sys.stderr if not args else sys.stdout)
        raise SystemExit(0 if args else 2)
    import lpsync_client.torch  # noqa: F401 - registers the backend

    if args[0] == "-m":
        if len(args) < 2:
            raise SystemExit(USAGE)
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        # As `python script.py` does: the script's directory first on the path.
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
