"""The `kivi` command (main.py): the one module that imports the command modules of every package."""
