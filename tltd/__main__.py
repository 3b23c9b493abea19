"""`python -m tltd` is the `tltd` command."""

from tltd.cli import main

main()
