"""Slurm client: allocation facts, hostlists, command building and output parsing
(pure), and a thin CLI backend that runs the commands with timeouts."""
