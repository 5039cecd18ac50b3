"""Executables slurmd runs (Prolog, Epilog, HealthCheckProgram): thin, torch-free
wrappers over ``health``."""
