"""The `kivi` command: its parser (main.py) and one module per subcommand. Nothing else in the project imports it."""
