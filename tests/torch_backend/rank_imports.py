"""The modules the test programs (``progs/``) import, imported ahead by the fork server
their ranks are forked from (``forked.py``). The server only reads this file: it is
never run."""

import numpy  # noqa: F401
import torch  # noqa: F401
import torch.distributed  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.checkpoint.state_dict  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.nn.parallel  # noqa: F401

import shardwire.torch  # noqa: F401
