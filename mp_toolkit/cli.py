"""`mpt`: the command line.

    mpt train --model gpt-small-cpu --pp 2 --schedule 1f1b --microbatches 4 --steps 100 \\
              --metrics runs/demo/metrics.jsonl --plot runs/demo/loss.png
    mpt train --model gpt-tiny --pp 2 --tp 2 --dp 2     # starts pp*tp*dp = 8 ranks itself
    mpt train --model bert-tiny --seq-len 64 --pp 2 --save-dir runs/bert --save-every 20
    mpt train --model bert-tiny --seq-len 64 --pp 1 --tp 2 --save-dir runs/bert --resume latest
    mpt train --model gpt-tiny --pp 2 --save-dir runs/x --save-every 20 --restarts 3   # restarts dead ranks
    mpt train --config recipes/gpt_pretrain/ds_config.json --steps 50   # a DeepSpeed config; flags override it
    torchrun --nproc_per_node 2 -m mp_toolkit.cli train --model gpt-tiny --pp 2
    torchrun --nproc_per_node 4 -m mp_toolkit.cli train --model gpt-tiny --pp 1 --tp 2 --dp 2
    torchrun --nproc_per_node 2 --max-restarts 3 -m mp_toolkit.cli train --model gpt-tiny --pp 2 \\
             --save-dir runs/x --save-every 20 --resume auto
    deepspeed --num_gpus 2 recipes/gpt_pretrain/train.py --deepspeed_config recipes/gpt_pretrain/ds_config.json
    mpt export --checkpoint runs/bert --out hf/bert   # BertForPreTraining.from_pretrained("hf/bert")

A wrong value ends with one line on stderr that names it and what would work, exit code 2. `mpt train`
exits 3 after --max-skips consecutive non-finite steps, 1 when a rank died (the line names it), 4 when
a rank hung (--hang-timeout; the line names it), 5 when SIGTERM / SIGUSR1 stopped it after a saved
step, and 128 + N when it started the ranks itself and one died of signal N (RELIABILITY.md).
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys

from mp_toolkit.cli_args import build_parser
from mp_toolkit.errors import USER_ERRORS, CheckpointError, ConfigError, PeerFailed

COMMANDS = {name: f"mp_toolkit.commands.{name}" for name in ("train", "plan", "simulate", "export", "data")}
"""Each command's module (`mp_toolkit.commands`), imported only when the command runs: the parser and
``--help`` import neither torch nor the library."""


def main(argv: list[str] | None = None, fork_ranks: bool = False) -> int:
    """``mpt <argv>``; the exit code. ``fork_ranks``: this process is the ``mpt`` command itself (a
    fresh interpreter that has run nothing else), so `mpt train` may fork its ranks from it
    (`run.spawn`); a Python caller gets ranks that start as interpreters of their own."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    held = next((a for a in argv if "\x00" in a), None)  # a shell cannot pass one; a Python caller can
    if held is not None:
        sys.stderr.write(f"mpt {args.command}: error: the argument {held!r} holds a NUL byte, which no name, "
                         "path or value may hold\n")
        return 2
    try:
        command = importlib.import_module(COMMANDS[args.command])
        return command.run(args, argv, main if fork_ranks else None)
    except (ConfigError, CheckpointError) as e:  # written as one line where raised
        sys.stderr.write(f"mpt {args.command}: error: {e}\n")
        return 2
    except USER_ERRORS as e:  # a planner's or scheduler's message: its first line
        sys.stderr.write(f"mpt {args.command}: error: {str(e).splitlines()[0]}\n")
        return 2
    except PeerFailed:  # another rank failed and reported why
        return 2


def console() -> int:
    """The ``mpt`` command (and ``python -m mp_toolkit.cli``). It ends without the interpreter's teardown of
    every module and object, which takes half a second to a second once torch is imported (an exception
    still ends the normal way, with its traceback): the exit handlers run and the output is flushed first."""
    code = main(fork_ranks=True)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (mpt plan | head) or stream
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(console())
