"""The entry the launchers run: the same program as `mpt train` (DeepSpeed's launcher runs a script path).

    deepspeed --num_gpus 8 train.py --deepspeed_config ds_config.json --model gpt2
    torchrun --nproc_per_node 8 train.py --deepspeed_config ds_config.json --model gpt2

The deepspeed launcher's ``--local_rank=N`` is accepted and ignored (LOCAL_RANK says the same).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # a checkout that is not pip-installed

from mp_toolkit.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
