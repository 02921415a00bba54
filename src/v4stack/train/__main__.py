"""`python -m v4stack.train ...` (and `torchrun ... -m v4stack.train ...`): the train command alone."""

import typer

from v4stack.train.cli import train_command

if __name__ == "__main__":
    typer.run(train_command)
